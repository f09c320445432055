"""``python -m dspark.bench.structured`` with the grammar's host work timed: per measured run, the
median ms per step of ``StructuredStage.constrain`` + ``GrammarStager.stage_drafts`` (including any
device work they launch and wait for), added to each result as ``host_median_ms``. Same arguments as
the benchmark, e.g. ``PYTHONPATH=src python scripts/structured_host_time.py --device cpu --shape tiny
--batches 1,64 --new 200 --out DIR``; run it against two checkouts' ``src`` to compare them."""

import sys
import time

import dspark.bench.structured as bench
import dspark.engine.structured as structured

steps: list[float] = []


def _timed(cls, name: str, starts_step: bool) -> None:
    run = getattr(cls, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            if starts_step:
                steps.append(spent)
            elif steps:
                steps[-1] += spent

    setattr(cls, name, timed)


def _measured(measure):
    def run(*args, **kwargs):
        steps.clear()
        result = measure(*args, **kwargs)
        ordered = sorted(steps)
        result["host_median_ms"] = round(1000 * ordered[len(ordered) // 2], 3) if ordered else 0.0
        return result

    return run


_timed(structured.StructuredStage, "constrain", True)
_timed(structured.GrammarStager, "stage_drafts", False)
bench.measure = _measured(bench.measure)
sys.exit(bench.main(sys.argv[1:]))
