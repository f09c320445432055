"""Options and helpers shared by the subcommands: the help format, ``--device`` / ``--dtype`` /
``--allow-pickle`` / ``--quiet``, the target loader, sampling and scheduler options, progress bars."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("auto", "float32", "bfloat16", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it is None or False (nothing to show)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="models' dtype; auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load a target that has only pickled weights (pytorch_model.bin); unpickling can run "
                             "code from the file, so only for a checkpoint you trust (safetensors are always preferred)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no loading or progress bars")


def runtime(args: argparse.Namespace):
    """``(device, dtype)`` from ``--device`` / ``--dtype`` (ValueError for a device this machine
    lacks); with ``--quiet`` also silences transformers' loading bars and reports."""
    import torch

    from dspark.engine import resolve_device

    if args.quiet:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
    device = resolve_device(args.device, name="--device")
    if args.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, args.dtype)


def load_target(args: argparse.Namespace, device, dtype):
    """``(model, tokenizer)`` of ``--target`` (a Hugging Face causal LM directory with its
    tokenizer), the model frozen on ``device``; ValueError naming what is wrong with it."""
    from dspark.engine import load_target_model, load_tokenizer

    model = load_target_model(args.target, device=device, dtype=dtype, allow_pickle=args.allow_pickle)
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise ValueError(f"--target {args.target} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return model.requires_grad_(False), tokenizer


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off, 1 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this probability")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling uniforms")


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark.engine.drafting import SCHEDULERS

    parser.add_argument("--scheduler", choices=SCHEDULERS, default="off",
                        help="how many drafts to verify per round: off = all, threshold / sps = by the confidence head")
    parser.add_argument("--threshold", type=float, default=0.0,
                        help="in [0, 1]; threshold scheduler: minimum prefix survival; sps: survival floor")


def sampling_params(args: argparse.Namespace, command: str):
    """``SamplingParams`` of the sampling options; warns (stderr) about filters greedy decoding ignores."""
    from dspark.engine import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if sampling.greedy and args.temperature < 1e-3 and (args.top_k > 1 or args.top_p != 1.0):
        print(f"dspark {command}: warning: --top-k / --top-p do nothing with greedy decoding (--temperature 0)",
              file=sys.stderr)
    return sampling


def check_scheduler_arguments(args: argparse.Namespace) -> None:
    """ValueError for a ``--threshold`` out of [0, 1] or given while the scheduler is off."""
    if not 0.0 <= args.threshold <= 1.0:
        raise ValueError(f"--threshold must be in [0, 1] (a survival probability), got {args.threshold}")
    if args.scheduler == "off" and args.threshold != 0.0:
        raise ValueError(f"--threshold {args.threshold} does nothing with --scheduler off: "
                         f"add --scheduler threshold or --scheduler sps")


def progress_bar(args: argparse.Namespace, name: str):
    """A ``Progress`` bar on stderr, or None with ``--quiet``."""
    from dspark.training.trainer import Progress

    return None if args.quiet else Progress(name)


REDUCED_PRECISION_NOTE = (
    "in {dtype} a verify forward over several tokens and a one-token decode step round differently, so "
    "a near-tie between the two best tokens can go either way and greedy outputs may part there; "
    "run with --dtype float32 to check exactness")


def mismatch_status(dtype, where: str, command: str) -> int:
    """Exit status for greedy outputs that differ from plain decoding: 1 (an error) in float32/float64,
    where the engine must reproduce plain greedy decoding token for token; in reduced precision the
    difference is rounding, so a note on stderr and 0."""
    import torch

    if dtype in (torch.float32, torch.float64):
        print(f"dspark {command}: greedy outputs differ from plain decoding for {where}", file=sys.stderr)
        return 1
    note = REDUCED_PRECISION_NOTE.format(dtype=str(dtype).replace("torch.", ""))
    print(f"dspark {command}: greedy outputs differ from plain decoding for {where}: {note}", file=sys.stderr)
    return 0
