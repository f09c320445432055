"""Chain vs tree (DDTree): acceptance on the demo pair's held-out prompts, round times on a GPU.

    python -m dspark.bench.tree --out DIR [--budgets 8,16,32,64] [--top-k 2,4,8] [--max-new-tokens 128]
    python -m dspark.bench.tree --out DIR --round-times [--shape qwen3-8b] [--batches 1,8,32] \
        [--tau-from DIR/tree.json]

Greedy, fp32, on the CPU by default: every prompt of the shipped pair's held-out set (26 files)
decoded by plain decoding, by chain DSpark (every draft verified, ``--scheduler off``) and by tree
DSpark at each node budget and top-k, all batched in one ``LLMEngine`` per configuration. Reports
τ (tokens per round, bonus included), the mean nodes verified per round, the accepted-depth
histogram and whether every output equals plain decoding; writes ``DIR/tree.json`` and ``tree.md``.
With ``--scheduler threshold --threshold X`` the confidence head biases the tree scores and X is
the survival floor (the chain then verifies the threshold scheduler's prefix); ``--temperature``
samples (prompt i with seed + i).

``--round-times`` (a GPU; bf16): a random-weight target of ``--shape`` (``bench.engine.SHAPES`` or
a shape as JSON) and a random 1-layer drafter, ``--batches`` rows of 128-token prompts, each
configuration's engine with its graphs captured; the median wall time of a full step (tree or chain
verify, draft, the host synchronisation) per batch and node budget at ``--round-top-k``, against
the chain round. With ``--tau-from`` (this module's JSON of the demo pair) it also estimates tokens
per second as τ x rows / step time, and names the batch past which the tree stops paying.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from ..engine import EngineConfig, LLMEngine, Request, SamplingParams


def run_config(target, draft, prompts, max_new_tokens: int, device: str, sampling: SamplingParams, **tree) -> dict:
    engine = LLMEngine(target, draft, EngineConfig(max_batch=len(prompts), device=device, dtype=torch.float32,
                                                   gpu_memory_utilization=None, **tree))
    start = time.perf_counter()
    results = engine.generate([Request(p, max_new_tokens, replace(sampling, seed=sampling.seed + i))
                               for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    accepts = [a for r in results for a in r.stats.accept_lengths]
    verified = [v for r in results for v in r.stats.scheduled_lengths]
    return dict(tau=round(sum(accepts) / len(accepts), 4), rounds=len(accepts),
                nodes_verified=round(sum(verified) / len(verified), 3),
                depth_histogram=dict(sorted(Counter(a - 1 for a in accepts).items())),
                seconds=round(seconds, 1), outputs=[r.token_ids for r in results])


def round_times(args) -> dict:
    """Step time of chain and tree rounds per batch (module docstring)."""
    from .engine import SHAPES, engine_run, random_drafter, random_target

    shape = SHAPES[args.shape] if args.shape in SHAPES else json.loads(args.shape)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_target(shape, device=args.device, dtype=dtype, vocab=args.vocab)
    draft = random_drafter(target, shape)
    taus = {}
    if args.tau_from:
        for row in json.loads(Path(args.tau_from).read_text())["rows"]:
            taus[(row.get("top_k", 1), row.get("budget"))] = row["tau"]
    rows, gen = [], torch.Generator().manual_seed(0)
    budgets = [None] + [int(x) for x in args.budgets.split(",")]
    for batch in [int(x) for x in args.batches.split(",")]:
        prompts = [torch.randint(0, args.vocab, (128,), generator=gen).tolist() for _ in range(batch)]
        for budget in budgets:
            tree = {} if budget is None else dict(draft_top_k=args.round_top_k, tree_budget=budget)
            engine = LLMEngine(target, draft, EngineConfig(max_batch=batch, gpu_memory_utilization=None,
                                                           max_model_len=128 + args.max_new_tokens + 80,
                                                           **tree))
            engine.capture_graphs()
            run = engine_run(engine, prompts, args.max_new_tokens)
            key = (1, None) if budget is None else (args.round_top_k, budget)
            row = dict(batch=batch, mode="chain" if budget is None else "tree", budget=budget, step_ms=run["step_ms"],
                       graphs=len(engine.runner.graphs), eager_keys=len(engine.runner.uncapturable))
            if key in taus:
                row["tau_demo"] = taus[key]
                row["est_tok_per_s"] = round(1000 * taus[key] * batch / run["step_ms"], 1)
            rows.append(row)
            print(row, flush=True)
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    for row in rows:
        chain = next(r for r in rows if r["batch"] == row["batch"] and r["mode"] == "chain")
        row["step_over_chain"] = round(row["step_ms"] / chain["step_ms"], 3)
        if "est_tok_per_s" in row and "est_tok_per_s" in chain:
            row["est_speed_over_chain"] = round(row["est_tok_per_s"] / chain["est_tok_per_s"], 3)
    return dict(shape=args.shape, top_k=args.round_top_k, device=args.device, rows=rows,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.tree", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", default="8,16,32,64")
    parser.add_argument("--top-k", default="2,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--scheduler", choices=("off", "threshold", "sps"), default="off")
    parser.add_argument("--threshold", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else prompt i samples with seed + i")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    parser.add_argument("--round-times", action="store_true", help="time rounds on a random target instead")
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--round-top-k", type=int, default=8)
    parser.add_argument("--tau-from", default=None, help="tree.json of the demo pair (for estimated tokens/s)")
    args = parser.parse_args(argv)
    command = "python -m dspark.bench.tree " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.round_times:
        report = dict(command=command, torch=torch.__version__, **round_times(args))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "round-times.json").write_text(json.dumps(report, indent=1))
        lines = ["| B | mode | nodes | step ms | × chain | est. tok/s | × chain |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['mode']} | {r['budget'] or '-'} | {r['step_ms']} | {r['step_over_chain']} | "
                  f"{r.get('est_tok_per_s', '-')} | {r.get('est_speed_over_chain', '-')} |" for r in report["rows"]]
        (out / "round-times.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    from ..engine import load_tokenizer
    from ..training.data import demo_pair, read_prompts

    pair = demo_pair()
    tokenizer = load_tokenizer(pair.target)
    records = read_prompts(str(pair.prompts))
    prompts = [tokenizer(r["text"])["input_ids"] for r in records][: args.limit or None]
    target, draft = str(pair.target), str(pair.draft)
    sampling = SamplingParams(args.temperature, top_p=args.top_p, seed=args.seed)
    common = dict(scheduler=args.scheduler, threshold=args.threshold)
    plain = LLMEngine(target, None, EngineConfig(max_batch=len(prompts), device=args.device, dtype=torch.float32,
                                                 gpu_memory_utilization=None))
    expected = [r.token_ids for r in plain.generate([Request(p, args.max_new_tokens) for p in prompts])]
    rows = [dict(mode="chain", **run_config(target, draft, prompts, args.max_new_tokens, args.device, sampling, **common))]
    for k in [int(x) for x in args.top_k.split(",")]:
        for budget in [int(x) for x in args.budgets.split(",")]:
            rows.append(dict(mode="tree", top_k=k, budget=budget,
                             **run_config(target, draft, prompts, args.max_new_tokens, args.device, sampling,
                                          draft_top_k=k, tree_budget=budget, **common)))
            print(rows[-1]["mode"], k, budget, rows[-1]["tau"], flush=True)
    chain_tau = rows[0]["tau"]
    for row in rows:
        outputs = row.pop("outputs")
        row["identical"] = sum(o == e for o, e in zip(outputs, expected)) if sampling.greedy else None
        row["tau_over_chain"] = round(row["tau"] / chain_tau, 3)
    report = dict(command=command,
                  prompts=len(prompts), max_new_tokens=args.max_new_tokens, device=args.device,
                  sampling=dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
                  torch=torch.__version__, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree.json").write_text(json.dumps(report, indent=1))
    how = "greedy" if sampling.greedy else f"temperature {args.temperature}, top-p {args.top_p}, seeds {args.seed} + i"
    lines = [f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, {how}, fp32 on {args.device}, "
             f"scheduler {args.scheduler}", "",
             "| mode | top-k | nodes (budget) | τ | τ / chain | nodes verified per round | identical to plain |",
             "|---|---|---|---|---|---|---|"]

    def same(count):
        return "-" if count is None else f"{count}/{len(prompts)}"

    for row in rows:
        lines.append(f"| {row['mode']} | {row.get('top_k', 1)} | {row.get('budget', '-')} | {row['tau']} | "
                     f"{row['tau_over_chain']} | {row['nodes_verified']} | {same(row['identical'])} |")
    (out / "tree.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
