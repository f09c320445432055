"""Chain vs tree (DDTree) acceptance on the demo pair's held-out prompts (issue 25's τ grid).

    python -m dspark.bench.tree --out DIR [--budgets 8,16,32,64] [--top-k 2,4,8] [--max-new-tokens 128]

Greedy, fp32, on the CPU by default: every prompt of the shipped pair's held-out set (26 files)
decoded by plain decoding, by chain DSpark (every draft verified, ``--scheduler off``) and by tree
DSpark at each node budget and top-k, all batched in one ``LLMEngine`` per configuration. Reports
τ (tokens per round, bonus included), the mean nodes verified per round, the accepted-depth
histogram and whether every output equals plain decoding; writes ``DIR/tree.json`` and ``tree.md``.
With ``--scheduler threshold --threshold X`` the confidence head biases the tree scores and X is
the survival floor (the chain then verifies the threshold scheduler's prefix).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from ..engine import EngineConfig, LLMEngine, Request


def run_config(target, draft, prompts, max_new_tokens: int, device: str, **tree) -> dict:
    engine = LLMEngine(target, draft, EngineConfig(max_batch=len(prompts), device=device, dtype=torch.float32, **tree))
    start = time.perf_counter()
    results = engine.generate([Request(p, max_new_tokens) for p in prompts])
    seconds = time.perf_counter() - start
    accepts = [a for r in results for a in r.stats.accept_lengths]
    verified = [v for r in results for v in r.stats.scheduled_lengths]
    return dict(tau=round(sum(accepts) / len(accepts), 4), rounds=len(accepts),
                nodes_verified=round(sum(verified) / len(verified), 3),
                depth_histogram=dict(sorted(Counter(a - 1 for a in accepts).items())),
                seconds=round(seconds, 1), outputs=[r.token_ids for r in results])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.tree", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", default="8,16,32,64")
    parser.add_argument("--top-k", default="2,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--scheduler", choices=("off", "threshold", "sps"), default="off")
    parser.add_argument("--threshold", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    args = parser.parse_args(argv)
    from ..engine import load_tokenizer
    from ..training.data import demo_pair, read_prompts

    pair = demo_pair()
    tokenizer = load_tokenizer(pair.target)
    records = read_prompts(str(pair.prompts))
    prompts = [tokenizer(r["text"])["input_ids"] for r in records][: args.limit or None]
    target, draft = str(pair.target), str(pair.draft)
    common = dict(scheduler=args.scheduler, threshold=args.threshold)
    plain = LLMEngine(target, None, EngineConfig(max_batch=len(prompts), device=args.device, dtype=torch.float32))
    expected = [r.token_ids for r in plain.generate([Request(p, args.max_new_tokens) for p in prompts])]
    rows = [dict(mode="chain", **run_config(target, draft, prompts, args.max_new_tokens, args.device, **common))]
    for k in [int(x) for x in args.top_k.split(",")]:
        for budget in [int(x) for x in args.budgets.split(",")]:
            rows.append(dict(mode="tree", top_k=k, budget=budget,
                             **run_config(target, draft, prompts, args.max_new_tokens, args.device,
                                          draft_top_k=k, tree_budget=budget, **common)))
            print(rows[-1]["mode"], k, budget, rows[-1]["tau"], flush=True)
    chain_tau = rows[0]["tau"]
    for row in rows:
        row["identical"] = sum(o == e for o, e in zip(row.pop("outputs"), expected))
        row["tau_over_chain"] = round(row["tau"] / chain_tau, 3)
    report = dict(command="python -m dspark.bench.tree " + " ".join(argv if argv is not None else sys.argv[1:]),
                  prompts=len(prompts), max_new_tokens=args.max_new_tokens, device=args.device,
                  torch=torch.__version__, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree.json").write_text(json.dumps(report, indent=1))
    lines = [f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy fp32 on {args.device}, "
             f"scheduler {args.scheduler}", "",
             "| mode | top-k | nodes (budget) | τ | τ / chain | nodes verified per round | identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['mode']} | {row.get('top_k', 1)} | {row.get('budget', '-')} | {row['tau']} | "
                     f"{row['tau_over_chain']} | {row['nodes_verified']} | {row['identical']}/{len(prompts)} |")
    (out / "tree.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
