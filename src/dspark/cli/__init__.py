"""The ``dspark`` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ._runtime import HelpFormatter

# subcommand -> module in dspark.cli defining ``add_arguments(parser)`` and ``run(args) -> int``; a
# module with ``PASSTHROUGH = True`` receives its arguments unparsed in ``args.passthrough``.
SUBCOMMANDS = {
    "demo": "dspark.cli.demo",
    "generate": "dspark.cli.generate",
    "train": "dspark.cli.train",
    "calibrate": "dspark.cli.calibrate",
    "eval": "dspark.cli.eval",
    "bench": "dspark.cli.bench",
    "profile": "dspark.cli.profile",
    "serve": "dspark.cli.serve",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        passthrough = getattr(module, "PASSTHROUGH", False)
        module.add_arguments(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__,
                                            formatter_class=HelpFormatter, add_help=not passthrough))
    args, extra = parser.parse_known_args(argv)
    module = modules[args.command]
    if extra and not getattr(module, "PASSTHROUGH", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    try:
        return module.run(args)
    except KeyboardInterrupt:  # Ctrl-C outside generation: no traceback
        print(f"\ndspark {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
