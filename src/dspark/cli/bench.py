"""Run the H200 kernel benchmarks and write JSON (same as ``python -m dspark.bench``; its options pass through).

``dspark bench --help`` shows them: --out FILE, --family greedy|sampling, --quick.
"""

from __future__ import annotations

import argparse

PASSTHROUGH = True  # every argument goes to python -m dspark.bench unparsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from dspark.bench.__main__ import main

    return main(args.passthrough)
