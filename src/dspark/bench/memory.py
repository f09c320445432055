"""Where an engine's GPU memory goes: the KV blocks it sized, its estimate of a step's working memory
(``engine.block_manager.WorkingMemory``) against what capturing every CUDA graph takes, graph by graph.

``python -m dspark.bench.memory --shape qwen3-8b --batch 256 --out DIR`` (on a GPU): the 8B-shaped
random target with a random DSpark drafter (``--plain``: none), ``capture_graphs()`` as ``LLM`` runs
it at start, each new graph's warm-up peak (eager, outside the graphs' pool) and the pool's growth
recorded. ``DIR/memory.json``: the estimate's parts, the KV bytes, free memory before and after the
captures, the largest warm-up peak, the pool's size and the 12 graphs that grew it most. The
estimate holds where the pool plus the largest warm-up peak stay within it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

__all__ = ["main"]


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


def measure(engine) -> dict:
    """Capture every graph of ``engine`` (idle), recording per new graph key the warm-up's peak
    allocation above what was allocated before it and the pool's growth."""
    runner, device = engine.runner, engine.runner.device
    replay, growth = runner._replay, []

    def recorded(key, fn):
        new = runner.use_graphs and key not in runner.graphs and key not in runner.uncapturable
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        replay(key, fn)
        if new:
            growth.append({"key": [str(k) for k in key],
                           "warm_up_peak_gib": _gib(torch.cuda.max_memory_allocated(device) - allocated),
                           "reserved_growth_gib": _gib(torch.cuda.memory_reserved(device) - reserved)})

    free_before = torch.cuda.mem_get_info(device)[0]
    runner._replay = recorded
    start = time.perf_counter()
    try:
        graphs = engine.capture_graphs()
    finally:
        del runner._replay
    free_after, total = torch.cuda.mem_get_info(device)
    return {"graphs": graphs, "capture_seconds": round(time.perf_counter() - start, 1),
            "free_before_captures_gib": _gib(free_before), "free_after_captures_gib": _gib(free_after),
            "total_gib": _gib(total), "captures_took_gib": _gib(free_before - free_after),
            "largest_warm_up_peak_gib": max((g["warm_up_peak_gib"] for g in growth), default=0.0),
            "top_growth": sorted(growth, key=lambda g: -g["reserved_growth_gib"])[:12]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for memory.json")
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of bench.engine.SHAPES")
    parser.add_argument("--batch", type=int, default=256, help="max_batch of the engine")
    parser.add_argument("--plain", action="store_true", help="no drafter: plain decoding's graphs")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args(argv)
    from .engine import SHAPES, VOCAB

    if args.shape not in SHAPES:
        parser.error(f"--shape must be one of {list(SHAPES)}, got {args.shape!r}")
    if args.batch < 1 or args.max_model_len < 16:
        parser.error(f"--batch must be >= 1 and --max-model-len >= 16, got {args.batch} and {args.max_model_len}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the graphs' memory is what it measures)")
    from ..engine import EngineConfig, LLMEngine
    from .replay import _models

    spec = {"shape": args.shape, "vocab": VOCAB, "device": "cuda", "dtype": "bfloat16", "draft_rank": 256}
    config = EngineConfig(max_batch=args.batch, max_model_len=args.max_model_len, enable_prefix_caching=False,
                          device="cuda", dtype=torch.bfloat16, scheduler="off")
    target, draft = _models(spec, config, draft=not args.plain)
    engine = LLMEngine(target, draft, config)
    cache = engine.runner.cache
    report = {"command": "python -m dspark.bench.memory " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "batch": args.batch, "drafter": not args.plain,
              "kv_blocks": engine.runner.num_kv_blocks,
              "target_kv_gib": _gib(sum(t.numel() * t.element_size() for t in (cache.k, cache.v))),
              "estimate_gib": {k: _gib(v) for k, v in asdict(engine.working_memory).items()}
              | {"total": _gib(engine.working_memory.total)}}
    report |= measure(engine)
    report["estimate_holds"] = report["captures_took_gib"] + report["largest_warm_up_peak_gib"] \
        <= report["estimate_gib"]["total"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
