"""Where an engine's GPU memory goes: the KV blocks it sized, its estimate of a step's working memory
(``engine.block_manager.WorkingMemory``) against what capturing every CUDA graph takes, graph by graph.

``python -m dspark.bench.memory --shape qwen3-8b --batch 256 --out DIR`` (on a GPU): the 8B-shaped
random target with a random DSpark drafter (``--plain``: none), ``capture_graphs()`` as ``LLM`` runs
it at start, each new graph's warm-up peak (eager, outside the graphs' pool) and the pool's growth
recorded. ``DIR/memory.json``: the estimate's parts, the KV bytes, free memory before and after the
captures, the largest warm-up peak, the graphs' pool (its segments, from the allocator's snapshot)
and the 12 graphs that grew it most. The estimate holds where the pool stays within its
``graph_pool`` and the largest warm-up peak within its ``warm_up``. A capture that raises (out of
memory) still writes what was recorded until then, with the error, and the command fails.
``--gpu-memory-utilization`` lower than the engine's 0.9 leaves fewer KV blocks, so that every graph
is captured and the pool's real size measured where 0.9 runs out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

__all__ = ["main", "measure", "write_report"]


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


def _pool_bytes(device) -> int:
    """Bytes of the allocator's segments in private pools (the CUDA graphs'): reserved, used or not."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if s.get("device", device.index) == device.index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def measure(engine, report: dict, recorded_one=lambda: None) -> None:
    """Capture every graph of ``engine`` (idle), recording into ``report`` as it goes -- per new graph
    key (``report["growth"]``) the warm-up's peak allocation above what was allocated before it and
    the reserved memory's growth (``recorded_one()`` called after each), then the totals
    (``summarise``) -- so that a capture that raises leaves what was measured until then."""
    runner = engine.runner
    device = runner.device if runner.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    replay, growth = runner._replay, report.setdefault("growth", [])

    def recorded(key, fn):
        new = runner.use_graphs and key not in runner.graphs and key not in runner.uncapturable
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        replay(key, fn)
        if new:
            growth.append({"key": [str(k) for k in key],
                           "warm_up_peak_gib": _gib(torch.cuda.max_memory_allocated(device) - allocated),
                           "reserved_growth_gib": _gib(torch.cuda.memory_reserved(device) - reserved)})
            recorded_one()

    report["free_before_captures_gib"] = _gib(torch.cuda.mem_get_info(device)[0])
    runner._replay = recorded
    start = time.perf_counter()
    try:
        report["graphs"] = engine.capture_graphs()
    finally:
        del runner._replay
        summarise(report, device, time.perf_counter() - start)


def summarise(report: dict, device, seconds: float) -> None:
    """The totals of the graphs recorded so far (all, or those before a capture raised)."""
    growth = report.get("growth", [])
    free, total = torch.cuda.mem_get_info(device)
    estimate = report["estimate_gib"]
    report |= {"graphs_recorded": len(growth), "capture_seconds": round(seconds, 1),
               "free_after_captures_gib": _gib(free), "total_gib": _gib(total),
               "captures_took_gib": round(report["free_before_captures_gib"] - _gib(free), 3),
               "graph_pool_gib": _gib(_pool_bytes(device)),
               "largest_warm_up_peak_gib": max((g["warm_up_peak_gib"] for g in growth), default=0.0),
               "top_growth": sorted(growth, key=lambda g: -g["reserved_growth_gib"])[:12]}
    report["estimate_holds"] = (report["graph_pool_gib"] <= estimate["graph_pool"]
                                and report["largest_warm_up_peak_gib"] <= estimate["warm_up"])


def write_report(engine, out: Path, report: dict) -> dict:
    """``measure`` ``engine`` into ``report`` and write it to ``out/memory.json`` -- after each graph (a
    run its time limit kills keeps what it measured) and when a capture raises: what was recorded
    until then, with the error, then the error is raised again."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        measure(engine, report, lambda: (out / "memory.json").write_text(json.dumps(report, indent=1)))
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        (out / "memory.json").write_text(json.dumps(report, indent=1))
    return report


def engine_report(engine, command: str) -> dict:
    """What ``engine`` sized before any capture: its KV blocks and its working-memory estimate."""
    cache, working = engine.runner.cache, engine.working_memory
    return {"command": command, "device": torch.cuda.get_device_name(engine.runner.device),
            "batch": engine.config.max_batch, "drafter": engine.draft_model is not None,
            "gpu_memory_utilization": engine.config.gpu_memory_utilization,
            "kv_blocks": engine.runner.num_kv_blocks,
            "target_kv_gib": _gib(sum(t.numel() * t.element_size() for t in (cache.k, cache.v))),
            "estimate_gib": {k: _gib(v) for k, v in asdict(working).items()} | {"total": _gib(working.total)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for memory.json")
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of bench.engine.SHAPES")
    parser.add_argument("--batch", type=int, default=256, help="max_batch of the engine")
    parser.add_argument("--plain", action="store_true", help="no drafter: plain decoding's graphs")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory the engine sizes its KV blocks in (lower: fewer blocks, "
                             "room for every capture)")
    args = parser.parse_args(argv)
    from .engine import SHAPES, VOCAB

    if args.shape not in SHAPES:
        parser.error(f"--shape must be one of {list(SHAPES)}, got {args.shape!r}")
    if args.batch < 1 or args.max_model_len < 16:
        parser.error(f"--batch must be >= 1 and --max-model-len >= 16, got {args.batch} and {args.max_model_len}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the graphs' memory is what it measures)")
    from ..engine import EngineConfig, LLMEngine
    from .replay import _models

    spec = {"shape": args.shape, "vocab": VOCAB, "device": "cuda", "dtype": "bfloat16", "draft_rank": 256}
    config = EngineConfig(max_batch=args.batch, max_model_len=args.max_model_len, enable_prefix_caching=False,
                          device="cuda", dtype=torch.bfloat16, scheduler="off",
                          gpu_memory_utilization=args.gpu_memory_utilization)
    engine = LLMEngine(*_models(spec, config, draft=not args.plain), config)
    command = "python -m dspark.bench.memory " + " ".join(argv if argv is not None else sys.argv[1:])
    report = write_report(engine, Path(args.out), engine_report(engine, command))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
