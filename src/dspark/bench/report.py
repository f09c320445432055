"""Markdown tables from a benchmark JSON (``python -m dspark.bench --out X.json``), so the tables in
``docs/`` are printed from the measurements rather than typed: ``python -m dspark.bench.report X.json``.

One table per kernel, one line per shape: median µs, GB/s, % of the copy ceiling, the PyTorch
reference and ``torch.compile`` of it (µs and how many times slower), and the row's own ratios
(``ratio_to_w2_read``, ``per_step_us``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

STANDARD = {"kernel", "backend", "shape", "median_us", "bytes", "gb_per_s", "pct_of_copy_ceiling", "reference_us",
            "speedup_vs_reference", "compiled_us", "speedup_vs_compiled", "target"}
CONSTANT_SHAPE_KEYS = {"V", "P"}  # the same in every row: said once in the header


def _shape(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items() if k not in CONSTANT_SHAPE_KEYS)


def _timed(us: float | None, speedup: float | None) -> str:
    return "–" if us is None else f"{us:g} ({speedup:g}×)"


def tables(report: dict) -> str:
    """The report's rows as markdown, grouped by kernel in order of first appearance."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in report["results"]:
        groups[r["kernel"]].append(r)
    lines = [f"{report['device']}, torch {report['torch']}, copy ceiling {report['copy_ceiling_gb_per_s']:g} GB/s"]
    for kernel, rows in groups.items():
        extras = sorted({k for r in rows for k in r if k not in STANDARD})
        lines += ["", f"### {kernel}", ""]
        if rows[0].get("target"):
            lines += [f"Target: {rows[0]['target']}.", ""]
        header = ["shape", "µs", "GB/s", "% ceiling", "reference µs (×)", "compiled µs (×)", *extras]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            cells = [_shape(r["shape"]), f"{r['median_us']:g}", f"{r['gb_per_s']:g}", f"{r['pct_of_copy_ceiling']:g}",
                     _timed(r.get("reference_us"), r.get("speedup_vs_reference")),
                     _timed(r.get("compiled_us"), r.get("speedup_vs_compiled")),
                     *(str(r.get(k, "")) for k in extras)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.report", description=__doc__)
    parser.add_argument("json", help="a file written by python -m dspark.bench --out")
    args = parser.parse_args(argv)
    try:
        with open(args.json) as f:
            report = json.load(f)
        print(tables(report))
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        print(f"dspark.bench.report: cannot read {args.json}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
