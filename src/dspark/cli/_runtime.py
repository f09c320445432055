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
