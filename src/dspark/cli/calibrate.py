"""Fit the confidence head's STS temperatures on held-out text and store them with the draft.

The target greedily continues held-out prompts; every position of the continuation is a drafting
round whose outcome greedy verification would decide (see ``dspark.training.calibration``). Every
other prompt fits one temperature per draft position (Sequential Temperature Scaling: left to right,
each minimising the ECE of the prefix survival); the remaining prompts report the expected
calibration error and AUC per position before and after. The temperatures are written to
``dspark_calibration.json`` (key ``sts_temperatures``) and to the draft's ``config.json``, from
which the engine applies them: in --draft itself, or in a calibrated copy with --output DIR. Without
--target/--draft the demo pair shipped with the package is calibrated; it, and a draft given by its
Hugging Face Hub name (the cache), are never changed in place: only --output writes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
from pathlib import Path

from ._runtime import add_runtime_arguments, load_target, progress_bar, resolve_pair, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM (with its tokenizer): a directory or a Hub name "
                                         "(default: the demo pair's target)")
    parser.add_argument("--draft", help="DSpark draft: a directory (updated in place unless --output) or a Hub name "
                                        "(default: the demo pair's draft)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="write the calibrated draft here (a copy of --draft) instead of updating --draft")
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
        in_place = args.output is None and args.draft is not None and Path(args.draft).expanduser().is_dir()
        _check_output(args.output)
        resolve_pair(args)
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
        written = _save(args, in_place, temperatures, report, save_calibration)
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark calibrate: {exc}", file=sys.stderr)
        return 2
    print(_table(report, len(fit_rounds.accepted), len(test_rounds.accepted), test_rounds.tau))
    if written is None:
        print(f"{args.draft} is the demo pair's or the Hugging Face cache's: left as it is; "
              f"pass --output DIR to write a calibrated copy")
    else:
        print(f"wrote {written} and sts_temperatures in {written.parent}/config.json")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sts_temperatures": temperatures, "tau_greedy": test_rounds.tau, "report": report}, f, indent=2)
    return 0


def _check_output(output: str | None) -> None:
    """``--output`` must be a new or empty directory (a calibrated copy never overwrites files)."""
    if output is None:
        return
    path = Path(output)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"--output {output} exists and is not an empty directory: give a new one")


def _save(args: argparse.Namespace, in_place: bool, temperatures, report, save_calibration) -> Path | None:
    """Write the temperatures: into ``--output`` (a copy of the draft, symlinks of a Hub cache
    followed), into ``--draft`` when it is a local directory the user gave, else nowhere (None)."""
    if args.output is not None:
        shutil.copytree(args.draft, args.output, dirs_exist_ok=True)
        return save_calibration(args.output, temperatures, report)
    return save_calibration(args.draft, temperatures, report) if in_place else None


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
