"""Run the kernel benchmarks on a GPU and write JSON: ``python -m dspark.bench --out results.json``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

FAMILIES = ("greedy", "sampling", "layers")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark.bench", description=__doc__)
    p.add_argument("--out", default="bench_results.json", help="JSON file to write")
    p.add_argument("--family", choices=FAMILIES, action="append", help="benchmark only these families")
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    p.add_argument("--kernels-only", action="store_true",
                   help="time dspark's kernels only, not the PyTorch reference / torch.compile baselines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch  # after parsing: --help stays fast

    from .common import measure_copy_ceiling_gbps, skip_baselines

    if not torch.cuda.is_available():
        print("dspark bench: needs a CUDA device", file=sys.stderr)
        return 2
    if args.kernels_only:
        skip_baselines()
    ceiling = measure_copy_ceiling_gbps()
    print(f"device: {torch.cuda.get_device_name()}  copy ceiling: {ceiling:.0f} GB/s (read+write)")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_ceiling_gb_per_s": round(ceiling, 1),
        "results": [],
    }
    for family in args.family or FAMILIES:
        module = importlib.import_module(f"dspark.bench.{family}")
        for result in module.run(ceiling, quick=args.quick):
            report["results"].append(result)
            print(json.dumps(result), flush=True)
            with open(args.out, "w") as f:  # rewritten after every row: a run cut short keeps what it measured
                json.dump(report, f, indent=1)
    print(f"wrote {len(report['results'])} results to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
