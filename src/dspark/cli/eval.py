"""Evaluate DSpark drafts: tau, per-position acceptance and speedup over plain decoding.

Runs plain target decoding and speculative decoding with each --draft on every prompt (back to back,
same target), prints a table and optionally writes the report as JSON. Prompts: held-out standard
library files (stdlib:test), the demo pair's prompts.jsonl, or an evaluation JSON Lines file such as
../shared/data/eval/*.jsonl ({"turns": [...]}: the first turn, through the chat template).
Greedy runs check that every output equals plain decoding (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._runtime import add_runtime_arguments, mismatch_status, runtime
from .train import load_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="Hugging Face causal LM directory (with its tokenizer)")
    parser.add_argument("--draft", required=True, nargs="+", help="one or more DSpark draft directories")
    parser.add_argument("--prompts", default="stdlib:test", help="stdlib:<split> or a JSON Lines prompt file")
    parser.add_argument("--num-prompts", type=int, default=16, help="use the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scheduler", choices=("off", "threshold", "sps"), default="off")
    parser.add_argument("--threshold", type=float, default=0.0)
    parser.add_argument("--per-prompt", action="store_true", help="also print each prompt's tau and speedup")
    parser.add_argument("--json", default=None, help="write the report to this JSON file")
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dspark.engine import SamplingParams
    from dspark.evaluation import evaluate, format_per_prompt, format_table
    from dspark.model import load_draft
    from dspark.training.data import prompt_token_ids, read_prompts

    try:
        if len(set(args.draft)) != len(args.draft):
            raise ValueError(f"--draft names a directory twice: {args.draft}")
        device, dtype = runtime(args)
        target, tokenizer = load_target(args.target, device, dtype)
        drafts = {path: load_draft(path, target=target, device=device, dtype=dtype) for path in args.draft}
        records = read_prompts(args.prompts)
        records = records[: args.num_prompts] if args.num_prompts else records
        prompts = [prompt_token_ids(tokenizer, r) for r in records]
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        report = evaluate(target, drafts, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          scheduler=args.scheduler, threshold=args.threshold)
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark eval: {exc}", file=sys.stderr)
        return 2
    report.update(target=args.target, prompt_set=args.prompts, device=str(device), dtype=str(dtype))
    print(format_table(report))
    if args.per_prompt:
        print()
        print(format_per_prompt(report, [r.get("file") or f"prompt {i}" for i, r in enumerate(records)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    lossy = [d["name"] for d in report["drafts"] if d["identical"] is not None and d["identical"] < report["prompts"]]
    return mismatch_status(dtype, str(lossy), "eval") if lossy else 0
