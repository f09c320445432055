"""The ``dspark`` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module in dspark.cli defining ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "demo": "dspark.cli.demo",
    "generate": "dspark.cli.generate",
    "train": "dspark.cli.train",
    "calibrate": "dspark.cli.calibrate",
    "eval": "dspark.cli.eval",
    "bench": "dspark.cli.bench",
    "serve": "dspark.cli.serve",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__))
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
