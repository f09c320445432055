"""The throughput-interactivity frontier of ``dspark serve`` with an 8B-shaped target and acceptance
replay: ``python -m dspark.bench.frontier --out DIR`` (on a GPU; the paper's Fig. 7).

1. Profile the target's verify forward per total token count and the draft pass per batch size
   (``dspark profile --draft``'s measurements) into ``DIR/cost_table.json``.
2. Serve the target three times (``dspark serve --engine-factory dspark.bench.replay:...``) and drive
   each with ``python -m dspark.bench.serve`` at concurrency 1, 2, 4, ..., 64: ``plain`` decoding,
   ``dspark-fixed`` (DSpark verifying every draft: ``--scheduler off``) and ``dspark-scheduled``
   (the paper's Algorithm 1 across the batch: ``--scheduler cost --cost-table DIR/cost_table.json``);
   ``--configs`` may add ``dspark-scheduled-online`` (the same on ``--schedule-signal online``).
   The target is ``bench.replay.peaked_target`` (random weights, 8B shape, bf16); DSpark's drafter is
   a random one of that shape whose acceptance and confidences replay the demo pair's recorded rounds
   (``bench.replay``), so tau and the confidence-acceptance relation are the demo pair's.
3. ``DIR/frontier.md`` / ``frontier.json``: per concurrency and configuration total tokens/s, tokens/s
   per request, TTFT, inter-token latency p50 / p99, tau, failed requests; whether every prompt got
   the same tokens from all three (greedy: it must); the targets. ``DIR/frontier.png``: the frontier.

``--prompt-tokens-max N``: prompt lengths drawn from ``[--prompt-tokens, N]`` (seeded), e.g. 128 to
2048. ``--workload mixed``: instead of the three configurations, plain decoding and DSpark with a
random drafter drafting for real (``bench.replay.random_engine``: tau ~ 1, since acceptance replay
serves greedy requests only) are each driven twice, with greedy requests and with ``bench.serve
--mixed-settings`` (every batch mixes greedy rows and three sampled settings, each request with its
own seed); ``DIR/mixed.md`` / ``mixed.json`` put the two side by side per concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import serve
from .replay import TRACES, load_traces

CONFIGS = {  # label -> (engine factory, scheduler arguments)
    "plain": ("plain_engine", []),
    "dspark-fixed": ("replay_engine", ["--scheduler", "off"]),
    "dspark-scheduled": ("replay_engine", ["--scheduler", "cost", "--cost-table", "{cost_table}"]),
    # Algorithm 1 on the online acceptance estimator instead of the confidence head (--configs only)
    "dspark-scheduled-online": ("replay_engine", ["--scheduler", "cost", "--cost-table", "{cost_table}",
                                                  "--schedule-signal", "online"]),
}
DEFAULT_CONFIGS = ("plain", "dspark-fixed", "dspark-scheduled")


def profile(spec: dict, out: Path, num_drafts: int, max_batch: int) -> Path:
    """``DIR/cost_table.json`` of the spec's target (the format ``dspark profile`` writes)."""
    if spec.get("tensor_parallel_size") is not None:
        return _profile_parallel(spec, out, num_drafts, max_batch)
    from ..engine import EngineConfig, LLMEngine
    from ..engine.profile import default_token_counts, profile_costs
    from ..model.llama import TargetLM
    from .engine import random_drafter
    from .replay import _shape, _target

    model = _target(spec)
    target = TargetLM.from_hf_model(model, [])
    context = spec["prompt_tokens"] + spec["max_tokens"] // 2
    # the round's draft pass per batch size: the same random drafter the DSpark servers build
    engine = LLMEngine(target, random_drafter(model, _shape(spec), rank=spec.get("draft_rank", 256)),
                       EngineConfig(max_batch=max_batch, max_model_len=context + 64,
                                    gpu_memory_utilization=None))
    table = profile_costs(target, default_token_counts(max_batch * (num_drafts + 1)), context=context,
                          tokens_per_row=num_drafts + 1, engine=engine)
    del engine
    path = out / "cost_table.json"
    table.write_json(path, device=spec["device"], target=f"bench.replay.peaked_target({spec['shape']!r})",
                     context=context)
    del model, target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def _profile_parallel(spec: dict, out: Path, num_drafts: int, max_batch: int) -> Path:
    """``profile`` of the spec's tensor-parallel target: an engine of its ranks (the servers' random
    target and drafter builders) measures on every rank at once (``LLMEngine.profile_costs``)."""
    from ..engine import EngineConfig, LLMEngine
    from ..engine.profile import default_token_counts
    from .replay import _models

    context = spec["prompt_tokens"] + spec["max_tokens"] // 2
    config = EngineConfig(max_batch=max_batch, max_model_len=context + 64, device=spec["device"],
                          dtype=getattr(torch, spec["dtype"]), gpu_memory_utilization=None,
                          tensor_parallel_size=spec["tensor_parallel_size"])
    engine = LLMEngine(*_models(spec, config, draft=True), config)
    try:
        table = engine.profile_costs(default_token_counts(max_batch * (num_drafts + 1)), context=context,
                                     tokens_per_row=num_drafts + 1)
    finally:
        engine.close()
    path = out / "cost_table.json"
    table.write_json(path, device=spec["device"], context=context,
                     target=f"bench.tensor_parallel.random_shard({spec['shape']!r}) x {spec['tensor_parallel_size']}")
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def run_config(label: str, args, spec: dict, cost_table: Path | None, *, factory: str | None = None,
               scheduler: list[str] | None = None, load_extra: tuple[str, ...] = ()) -> int:
    """Serve one configuration (``CONFIGS[label]`` unless ``factory`` / ``scheduler`` are given) and
    drive it with ``bench.serve``; ``load_extra``: more load-generator arguments."""
    if factory is None:
        factory, scheduler = CONFIGS[label]
    longest = args.prompt_tokens_max or args.prompt_tokens
    server = ["--engine-factory", f"dspark.bench.replay:{factory}", "--max-batch", str(args.max_batch),
              "--max-model-len", str(longest + args.max_tokens + 64), "--device", args.device,
              "--served-model-name", label,
              # each prompt is sent many times: from the prefix cache its prefill would vanish, and
              # the frontier measures decoding (prefix_chat measures the cache)
              "--no-enable-prefix-caching"] + [a.format(cost_table=cost_table) for a in scheduler]
    if spec.get("tensor_parallel_size") is not None:
        server += ["--tensor-parallel-size", str(spec["tensor_parallel_size"])]
    load = ["--out", args.out, "--label", label, "--concurrency", args.concurrency,
            "--requests-per-client", str(args.requests_per_client), "--max-tokens", str(args.max_tokens),
            "--random-prompts", str(args.prompt_tokens), "--vocab", str(spec["vocab"]),
            "--num-prompts", str(args.num_prompts), *load_extra]
    if args.prompt_tokens_max:
        load += ["--random-prompts-max", str(args.prompt_tokens_max)]
    print(f"== {label}: python -m dspark.bench.serve {' '.join(load)} -- {' '.join(server)}", flush=True)
    return serve.main(load + ["--"] + server)


MIXED_CONFIGS = {  # the mixed-settings workload: drafts for real (acceptance replay serves greedy requests only)
    "plain": ("plain_engine", []),
    "dspark-random": ("random_engine", ["--scheduler", "off"]),
    # sampled drafts over the whole vocabulary (--configs only: the engine's default is candidate sets)
    "dspark-random-vocabulary": ("random_engine", ["--scheduler", "off", "--draft-candidates", "0"]),
}
DEFAULT_MIXED_CONFIGS = ("plain", "dspark-random")


def run_mixed(args, spec: dict) -> int:
    """``--workload mixed``: each of ``MIXED_CONFIGS`` under greedy requests (``<label>``) and under
    ``bench.serve --mixed-settings`` (``<label>-mixed``: greedy and three sampled settings in every
    batch); ``DIR/mixed.md`` / ``mixed.json``: total tokens/s of the two side by side per
    concurrency, and issue 22's target (mixed within 10 % of single-setting at every concurrency)."""
    status, out = 0, Path(args.out)
    labels = [x for x in (args.configs or ",".join(DEFAULT_MIXED_CONFIGS)).split(",") if x]
    for label in labels:
        factory, scheduler = MIXED_CONFIGS[label]
        if not args.summarize_only:
            status |= run_config(label, args, spec, None, factory=factory, scheduler=scheduler)
            status |= run_config(f"{label}-mixed", args, spec, None, factory=factory, scheduler=scheduler,
                                 load_extra=("--mixed-settings",))
    rows = []
    for label in MIXED_CONFIGS:
        if not (out / f"{label}.json").is_file() or not (out / f"{label}-mixed.json").is_file():
            continue
        runs = [{lv["concurrency"]: lv for lv in json.loads((out / f"{name}.json").read_text())["levels"]}
                for name in (label, f"{label}-mixed")]
        for c in sorted(set(runs[0]) & set(runs[1])):
            single, mixed = (r[c]["total_tokens_per_s"] for r in runs)
            rows.append(dict(config=label, concurrency=c, single_tokens_per_s=single, mixed_tokens_per_s=mixed,
                             ratio=_ratio(mixed, single), single_step_ms=runs[0][c].get("engine_step_ms"),
                             mixed_step_ms=runs[1][c].get("engine_step_ms"),
                             failed=runs[0][c]["failed"] + runs[1][c]["failed"]))
    result = {"spec": spec, "command": "python -m dspark.bench.frontier " + " ".join(sys.argv[1:]),
              "environment": _environment(args.device), "settings": list(serve.MIXED_SETTINGS), "levels": rows,
              "mixed within 10 % of single at every concurrency": all((r["ratio"] or 0) >= 0.9 for r in rows)}
    (out / "mixed.json").write_text(json.dumps(result, indent=1))
    lines = [f"Environment: {result['environment']}; mixed settings: {result['settings']}", "",
             "| config | C | single-setting tok/s | mixed tok/s | mixed / single | step ms single / mixed | failed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = "/".join("-" if x is None else f"{x:.2f}" for x in (r["single_step_ms"], r["mixed_step_ms"]))
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['single_tokens_per_s']:.1f} | "
                     f"{r['mixed_tokens_per_s']:.1f} | {r['ratio']} | {steps} | {r['failed']} |")
    lines += ["", f"Mixed within 10 % of single-setting at every concurrency: "
                  f"**{result['mixed within 10 % of single at every concurrency']}**"]
    (out / "mixed.md").write_text("\n".join(lines) + "\n")
    print((out / "mixed.md").read_text())
    return status


def summarize(out: Path, labels: list[str]) -> dict:
    """The three runs side by side, the targets, and whether the outputs agree."""
    runs = {label: json.loads((out / f"{label}.json").read_text()) for label in labels}
    levels = {label: {lv["concurrency"]: lv for lv in run["levels"]} for label, run in runs.items()}
    concurrency = sorted(set.intersection(*(set(v) for v in levels.values())))
    table = []
    for c in concurrency:
        row = {"concurrency": c}
        for label in labels:
            lv = levels[label][c]
            row[label] = {"total_tokens_per_s": lv["total_tokens_per_s"],
                          "steady_tokens_per_s": lv.get("steady_tokens_per_s"),
                          "per_request_tokens_per_s": lv["per_request_tokens_per_s"]["p50"],
                          "ttft_p50_s": lv["ttft_s"]["p50"], "ttft_p99_s": lv["ttft_s"]["p99"],
                          "itl_p50_s": lv["itl_s"]["p50"], "itl_p99_s": lv["itl_s"]["p99"], "tau": lv["tau"],
                          "failed": lv["failed"], "mismatched": lv["mismatched"], "requests": lv["requests"],
                          "engine_step_ms": lv.get("engine_step_ms"), "engine_busy": lv.get("engine_busy"),
                          "engine_host_ms": lv.get("engine_host_ms"),
                          "engine_host_phase_ms": lv.get("engine_host_phase_ms"),
                          "engine_host_overlapped_ms": lv.get("engine_host_overlapped_ms")}
        table.append(row)
    outputs = [run.get("outputs", {}) for run in runs.values()]
    same = all(o == outputs[0] for o in outputs[1:]) and bool(outputs[0])
    result = {"labels": labels, "levels": table, "outputs_identical_across_configs": same,
              "failed_requests": sum(lv["failed"] for run in runs.values() for lv in run["levels"]),
              "requests": sum(lv["requests"] for run in runs.values() for lv in run["levels"])}
    result["targets"] = _targets(table, labels)
    return result


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _targets(table: list[dict], labels: list[str]) -> dict:
    """Issue 22's targets on total tokens/s (and the same ratios on the steady-state rate, without
    the drain at the end of each level), and issue 14's per-request ones at concurrency 1."""
    targets, by_c = {}, {r["concurrency"]: r for r in table}
    three = {"plain", "dspark-fixed", "dspark-scheduled"} <= set(labels)
    for rate in ("total_tokens_per_s", "steady_tokens_per_s"):
        if not three:
            break
        ratios = {c: {other: _ratio(r["dspark-scheduled"][rate], r[other][rate]) for other in ("plain", "dspark-fixed")}
                  for c, r in by_c.items()}
        targets[f"scheduled / plain, / fixed ({rate})"] = ratios
        if 64 in ratios:
            targets[f"scheduled >= 1.4x plain at 64 ({rate})"] = (ratios[64]["plain"] or 0) >= 1.4
            targets[f"scheduled >= 1.25x fixed at 64 ({rate})"] = (ratios[64]["dspark-fixed"] or 0) >= 1.25
        best = {c: _ratio(r["dspark-scheduled"][rate], max(r["plain"][rate] or 0, r["dspark-fixed"][rate] or 0))
                for c, r in by_c.items()}
        targets[f"scheduled >= 0.97x max(plain, fixed) at every concurrency ({rate})"] = \
            all(x is not None and x >= 0.97 for x in best.values())
    if three and 64 in by_c:
        itl = _ratio(by_c[64]["dspark-scheduled"]["itl_p99_s"], by_c[64]["plain"]["itl_p99_s"])
        targets["scheduled p99 ITL / plain at 64"] = itl
        targets["scheduled p99 ITL <= 1.2x plain at 64"] = itl is not None and itl <= 1.2
    first = by_c.get(1)
    if first is not None and "plain" in labels:
        for label in labels[1:]:
            ratio = _ratio(first[label]["per_request_tokens_per_s"], first["plain"]["per_request_tokens_per_s"])
            targets[f"{label} per request / plain at 1"] = ratio
            targets[f"{label} >= 1.5x plain per request at 1"] = ratio is not None and ratio >= 1.5
    return targets


def markdown(result: dict, environment: str) -> str:
    labels = result["labels"]

    def ms(x):
        return "-" if x is None else f"{1000 * x:.1f}"

    def num(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [f"Environment: {environment}", "",
             "| C | config | total tok/s | steady tok/s | tok/s per request (median) | TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| τ | engine step ms (busy) | host ms (plan / launch / commit; behind a draft pass) | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["levels"]:
        for label in labels:
            x = row[label]
            lines.append(f"| {row['concurrency']} | {label} | {num(x['total_tokens_per_s'])} | "
                         f"{num(x.get('steady_tokens_per_s'))} | "
                         f"{num(x['per_request_tokens_per_s'])} | {ms(x['ttft_p50_s'])} / {ms(x['ttft_p99_s'])} | "
                         f"{ms(x['itl_p50_s'])} / {ms(x['itl_p99_s'])} | {num(x['tau'], 2)} | "
                         f"{num(x['engine_step_ms'], 2)} ({num(x['engine_busy'] and 100 * x['engine_busy'], 0)} %) | "
                         f"{num(x.get('engine_host_ms'), 2)}{_phases(x)} | "
                         f"{x['failed']} of {x['requests']} |")
    lines += ["", f"Outputs identical across {', '.join(labels)} for every prompt: "
                  f"**{result['outputs_identical_across_configs']}**; failed requests: "
                  f"{result['failed_requests']} of {result['requests']}.", "", "Targets:", ""]
    lines += [f"- {name}: {value}" for name, value in result["targets"].items()]
    return "\n".join(lines) + "\n"


def _phases(level: dict) -> str:
    """A level's host time by phase and the part of it behind a draft pass, when it has them."""
    phases, overlapped = level.get("engine_host_phase_ms"), level.get("engine_host_overlapped_ms")
    if not phases:
        return ""
    hidden = "" if overlapped is None else f"; {overlapped:.2f}"
    return " (" + " / ".join(f"{v:.2f}" for v in phases.values()) + hidden + ")"


def _environment(device: str) -> str:
    import triton
    import transformers

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device
    return f"{gpu}, torch {torch.__version__}, Triton {triton.__version__}, transformers {transformers.__version__}"


def _check(parser, args) -> tuple:
    """The target shape (a name or a dict) and the traces' drafts per round; parser errors name the flag."""
    from .engine import SHAPES

    for name in ("requests_per_client", "max_tokens", "prompt_tokens", "num_prompts", "max_batch", "draft_rank",
                 "tensor_parallel_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompt_tokens_max is not None and args.prompt_tokens_max < args.prompt_tokens:
        parser.error(f"--prompt-tokens-max must be >= --prompt-tokens ({args.prompt_tokens}), got {args.prompt_tokens_max}")
    if args.vocab is not None and args.vocab < 2:
        parser.error(f"--vocab must be >= 2, got {args.vocab}")
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        parser.error(f"--concurrency must be comma-separated integers >= 1, got {args.concurrency!r}")
    if args.shape.lstrip().startswith("{"):
        try:
            shape = json.loads(args.shape)
        except ValueError as exc:
            parser.error(f"--shape: not valid JSON ({exc})")
    elif args.shape in SHAPES:
        shape = args.shape
    else:
        parser.error(f"--shape must be one of {list(SHAPES)} or a shape as JSON, got {args.shape!r}")
    try:
        num_drafts = load_traces(args.traces)["num_drafts"]
    except ValueError as exc:
        parser.error(f"--traces: {exc}")
    return shape, num_drafts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the runs, cost_table.json, frontier.md/.json/.png")
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of bench.engine.SHAPES, or one as JSON")
    parser.add_argument("--vocab", type=int, default=None, help="target vocabulary (default: 151936)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-rank", type=int, default=256, help="Markov rank of the random drafter")
    parser.add_argument("--traces", default=str(TRACES), help="recorded rounds (python -m dspark.bench.replay)")
    parser.add_argument("--configs", default=None,
                        help=f"subset of {','.join(CONFIGS)} (--workload mixed: of {','.join(MIXED_CONFIGS)})")
    parser.add_argument("--concurrency", default=serve.DEFAULT_CONCURRENCY)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens-max", type=int, default=None,
                        help="prompt lengths drawn from [--prompt-tokens, this] (default: all --prompt-tokens)")
    parser.add_argument("--workload", choices=("single", "mixed"), default="single",
                        help="single: greedy requests, plain / fixed / scheduled with acceptance replay; mixed: "
                             "plain and a random drafter under greedy and under mixed greedy / sampled requests")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="serve (and profile) the target sharded over N GPUs; its weights are then built on "
                             "every rank (bench.tensor_parallel.random_shard: the same peaked random model at every "
                             "N, 1 included, which no process holds whole): e.g. --shape 70b -tp 2")
    parser.add_argument("--summarize-only", action="store_true",
                        help="only redo frontier.md/.json/.png from the runs already in --out")
    args = parser.parse_args(argv)
    known = MIXED_CONFIGS if args.workload == "mixed" else CONFIGS
    labels = [x for x in (args.configs or ",".join(DEFAULT_MIXED_CONFIGS if args.workload == "mixed" else DEFAULT_CONFIGS))
              .split(",") if x]
    unknown = [x for x in labels if x not in known]
    if unknown or not labels:
        parser.error(f"--configs must name some of {list(known)}, got {args.configs!r}")
    out = Path(args.out)
    if args.summarize_only and args.workload != "mixed":
        missing = [str(out / f) for f in ["frontier.json"] + [f"{x}.json" for x in labels] if not (out / f).is_file()]
        if missing:
            parser.error(f"--summarize-only needs a finished run in --out; missing {missing}")
        return write_summary(out, labels, json.loads((out / "frontier.json").read_text()))
    shape, num_drafts = _check(parser, args)
    from .engine import VOCAB

    out.mkdir(parents=True, exist_ok=True)
    spec = {"shape": shape, "vocab": args.vocab or VOCAB, "device": args.device, "dtype": args.dtype,
            "draft_rank": args.draft_rank, "traces": args.traces, "num_prompts": args.num_prompts,
            "prompt_tokens": args.prompt_tokens, "prompt_tokens_max": args.prompt_tokens_max,
            "max_tokens": args.max_tokens, "tensor_parallel_size": args.tensor_parallel_size}
    os.environ["DSPARK_REPLAY"] = json.dumps(spec)  # the servers' engine factories read it
    if args.workload == "mixed":
        return run_mixed(args, spec)
    start = time.time()
    cost_table = profile(spec, out, num_drafts, args.max_batch)
    print(f"profiled the verify forward in {time.time() - start:.0f} s: {cost_table}", flush=True)
    status = 0
    for label in labels:
        status |= run_config(label, args, spec, cost_table)
    run = {"spec": spec, "command": "python -m dspark.bench.frontier " + " ".join(argv or sys.argv[1:]),
           "environment": _environment(args.device)}
    return status | write_summary(out, labels, run)


def write_summary(out: Path, labels: list[str], run: dict) -> int:
    """frontier.json / .md / .png from the runs in ``out``; ``run``: the spec, command and environment.
    Returns 1 when some prompt's outputs differ between the configurations."""
    result = {**summarize(out, labels), **{k: run[k] for k in ("spec", "command", "environment")}}
    (out / "frontier.json").write_text(json.dumps(result, indent=1))
    (out / "frontier.md").write_text(markdown(result, result["environment"]))
    serve.plot(out)
    print((out / "frontier.md").read_text())
    return int(not result["outputs_identical_across_configs"])


if __name__ == "__main__":
    sys.exit(main())
