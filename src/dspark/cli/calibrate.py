"""Fit the confidence head's STS temperatures on held-out text and store them with the draft.

The target greedily continues held-out prompts; every position of the continuation is a drafting
round whose outcome greedy verification would decide (see ``dspark.training.calibration``). Every
other prompt fits one temperature per draft position (Sequential Temperature Scaling: left to right,
each minimising the ECE of the prefix survival); the remaining prompts report the expected
calibration error and AUC per position before and after. The temperatures are written to
``dspark_calibration.json`` (key ``sts_temperatures``) and to the draft's ``config.json``, from
which the engine applies them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from ._runtime import add_runtime_arguments, load_target, progress_bar, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="Hugging Face causal LM directory (with its tokenizer)")
    parser.add_argument("--draft", required=True, help="DSpark draft directory (updated in place)")
    parser.add_argument("--data", default="stdlib:valid", help="held-out corpus (see dspark train --data)")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts (half fit, half report)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of held-out text per prompt")
    parser.add_argument("--new-tokens", type=int, default=192, help="greedy tokens generated per prompt")
    parser.add_argument("--bins", type=int, default=15, help="ECE bins")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per batched forward")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.model import load_draft
    from dspark.training.calibration import (calibration_report, collect_rounds, fit_sts, save_calibration)
    from dspark.training.data import pack_sequences, read_corpus, tokenize

    try:
        if args.num_prompts < 2:
            raise ValueError(f"--num-prompts must be >= 2 (half fit, half report), got {args.num_prompts}")
        device, dtype = runtime(args)
        target, tokenizer = load_target(args, device, dtype)
        draft = load_draft(args.draft, target=target, device=device, dtype=dtype)
        if draft.confidence_head is None:
            raise ValueError(f"the draft in {args.draft} has no confidence head to calibrate")
        rows = pack_sequences(tokenize(tokenizer, read_corpus(args.data)), args.prompt_tokens, tokenizer.eos_token_id)
        pick = torch.linspace(0, rows.shape[0] - 1, min(args.num_prompts, rows.shape[0])).long().unique()
        prompts = rows[pick].to(device)
        bar = progress_bar(args, "dspark calibrate")
        halves = (prompts[0::2], prompts[1::2])  # alternate prompts: neighbouring rows come from the same files
        total, batches = sum(-(-h.shape[0] // args.batch_size) for h in halves), itertools.count(1)

        def advance():
            done = next(batches)
            bar.update(done / total, f"batch {done}/{total}")

        gather = dict(new_tokens=args.new_tokens, batch_size=args.batch_size, progress=None if bar is None else advance)
        fit_rounds, test_rounds = (collect_rounds(target, draft, half, **gather) for half in halves)
        if bar is not None:
            bar.close()
        temperatures = fit_sts(fit_rounds, bins=args.bins)
        report = calibration_report(test_rounds, temperatures, args.bins)
        file = save_calibration(args.draft, temperatures, report)
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark calibrate: {exc}", file=sys.stderr)
        return 2
    print(_table(report, len(fit_rounds.accepted), len(test_rounds.accepted), test_rounds.tau))
    print(f"wrote {file} and sts_temperatures in {args.draft}/config.json")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sts_temperatures": temperatures, "tau_greedy": test_rounds.tau, "report": report}, f, indent=2)
    return 0


def _table(report: list[dict], fit: int, test: int, tau: float) -> str:
    def auc(v):
        return "    -" if v is None else f"{v:5.3f}"

    lines = [f"STS fitted on {fit} greedy rounds, reported on {test} others (greedy tau {tau:.2f}, bonus included)",
             "pos  accept  survival      T   ECE before  ECE after  AUC before  AUC after"]
    for r in report:
        accept = "    -" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        lines.append(f"{r['position']:>3}  {accept:>6}  {r['survival']:8.3f}  {r['temperature']:5.2f}  "
                     f"{100 * r['ece_before']:9.2f}%  {100 * r['ece_after']:8.2f}%  {auc(r['auc_before']):>10}  "
                     f"{auc(r['auc_after']):>9}")
    mean = {k: sum(r[k] for r in report) / len(report) for k in ("ece_before", "ece_after")}
    lines.append(f"mean ECE {100 * mean['ece_before']:.2f}% -> {100 * mean['ece_after']:.2f}%, "
                 f"max {100 * max(r['ece_after'] for r in report):.2f}% after STS")
    return "\n".join(lines)
