"""Run the H200 kernel benchmarks and write JSON (same as ``python -m dspark.bench``)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of python -m dspark.bench")


def run(args: argparse.Namespace) -> int:
    from dspark.bench.__main__ import main

    return main(args.bench_args)
