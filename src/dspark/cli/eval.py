"""Evaluate DSpark drafts: tau, per-position acceptance and speedup over plain decoding.

Runs plain target decoding and speculative decoding with each --draft on every prompt (back to back,
same target), prints a table and optionally writes the report as JSON. tau is the mean number of
tokens a verification round produces (accepted drafts + the target's own bonus token); the speedup
is speculative tokens/s over plain tokens/s. Prompts: held-out standard library files
(stdlib:test), the demo pair's held-out prompts (src/dspark/data/demo/prompts.jsonl, next to its
target/ and draft/ directories), or any JSON Lines file of {"text": ...} or {"turns": [...]} records
(the first turn, through the chat template). Without --target/--draft the demo pair shipped with the
package runs; both may be Hugging Face Hub names. Greedy runs check that every output equals plain
decoding (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._runtime import (add_parallel_argument, add_runtime_arguments, add_sampling_arguments, add_scheduler_arguments,
                       check_scheduler_arguments, load_target, mismatch_status, progress_bar, resolve_pair, runtime,
                       sampling_params)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM (with its tokenizer): a directory or a Hub name "
                                         "(default: the demo pair's target)")
    parser.add_argument("--draft", nargs="+", help="one or more DSpark drafts: directories or Hub names "
                                                   "(default: the demo pair's draft)")
    parser.add_argument("--prompts", default="stdlib:test", help="stdlib:<split> or a JSON Lines prompt file")
    parser.add_argument("--num-prompts", type=int, default=16, help="use the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt")
    add_sampling_arguments(parser)
    add_scheduler_arguments(parser)
    parser.add_argument("--per-prompt", action="store_true", help="also print each prompt's tau and speedup")
    parser.add_argument("--engine", choices=("auto", "batched", "reference"), default="auto",
                        help="the LLMEngine and its plain twin, one prompt at a time: batched with CUDA graphs (on a "
                             "GPU), reference eagerly; auto: batched on CUDA, else reference")
    parser.add_argument("--json", default=None, help="write the report to this JSON file")
    add_parallel_argument(parser, " (then plain decoding runs every prompt, then each draft: one engine of N ranks "
                                  "at a time)")
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dspark.evaluation import evaluate, format_per_prompt, format_table
    from dspark.model import load_draft
    from dspark.training.data import prompt_token_ids, read_prompts

    try:
        if args.draft is not None and len(set(args.draft)) != len(args.draft):
            raise ValueError(f"--draft names a directory twice: {args.draft}")
        if args.num_prompts < 0:
            raise ValueError(f"--num-prompts must be >= 0 (0 = all), got {args.num_prompts}")
        device, dtype = runtime(args)
        check_scheduler_arguments(args)
        sampling = sampling_params(args, "eval")
        records = read_prompts(args.prompts)
        records = records[: args.num_prompts] if args.num_prompts else records
        resolve_pair(args, drafts="several")
        if args.tensor_parallel_size > 1:  # each rank loads its shard of the checkpoint, and the drafts
            from dspark.engine import load_tokenizer

            target, tokenizer = args.target, load_tokenizer(args.target)
            if tokenizer is None:
                raise ValueError(f"--target {args.target} has no tokenizer (tokenizer.json / tokenizer_config.json)")
            drafts = {path: path for path in args.draft}
        else:
            target, tokenizer = load_target(args, device, dtype)
            drafts = {path: load_draft(path, target=target, device=device, dtype=dtype) for path in args.draft}
        prompts = [prompt_token_ids(tokenizer, r) for r in records]
        bar = progress_bar(args, "dspark eval")
        report = evaluate(target, drafts, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          scheduler=args.scheduler, threshold=args.threshold, cost_table=args.cost_table,
                          min_predicted_gain=args.min_predicted_gain, engine=args.engine,
                          draft_top_k=args.draft_top_k, tree_budget=args.tree_budget,
                          draft_candidates=args.draft_candidates, draft_successors=args.draft_successors,
                          schedule_signal=args.schedule_signal, tensor_parallel_size=args.tensor_parallel_size,
                          device=device, dtype=dtype,
                          progress=None if bar is None else lambda done, total: bar.update(
                              done / total, f"prompt {done}/{total}"))
        if bar is not None:
            bar.close()
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark eval: {exc}", file=sys.stderr)
        return 2
    report.update(target=args.target_name, prompt_set=args.prompts, device=str(device), dtype=str(dtype))
    print(format_table(report))
    if args.per_prompt:
        print()
        print(format_per_prompt(report, [r.get("file") or f"prompt {i}" for i, r in enumerate(records)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    lossy = [d["name"] for d in report["drafts"] if d["identical"] is not None and d["identical"] < report["prompts"]]
    return mismatch_status(dtype, str(lossy), "eval") if lossy else 0
