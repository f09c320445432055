"""``--device`` / ``--dtype`` options shared by the subcommands that load models."""

from __future__ import annotations

import argparse

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="models' dtype; auto: bfloat16 on cuda, float32 on cpu")


def runtime(args: argparse.Namespace):
    """``(device, dtype)`` from ``--device`` / ``--dtype``."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, args.dtype)


REDUCED_PRECISION_NOTE = (
    "in {dtype} a verify forward over several tokens and a one-token decode step round differently, so "
    "a near-tie between the two best tokens can go either way and greedy outputs may part there; "
    "run with --dtype float32 to check exactness")


def mismatch_status(dtype, where: str, command: str) -> int:
    """Exit status for greedy outputs that differ from plain decoding: 1 (an error) in float32/float64,
    where the engine must reproduce plain greedy decoding token for token; in reduced precision the
    difference is rounding, so a note on stderr and 0."""
    import sys

    import torch

    if dtype in (torch.float32, torch.float64):
        print(f"dspark {command}: greedy outputs differ from plain decoding for {where}", file=sys.stderr)
        return 1
    note = REDUCED_PRECISION_NOTE.format(dtype=str(dtype).replace("torch.", ""))
    print(f"dspark {command}: greedy outputs differ from plain decoding for {where}: {note}", file=sys.stderr)
    return 0
