"""Timing and reporting helpers shared by the per-family benchmarks (GPU only).

Each result row: kernel, backend, shape, median_us, bytes, gb_per_s, pct_of_copy_ceiling,
and, where measured, the median of the PyTorch reference and of ``torch.compile`` of it and the
ratios ``speedup_vs_reference`` / ``speedup_vs_compiled``.
"""

from __future__ import annotations

import gc
import statistics
from typing import Callable

import torch

from .isolate import attempt


def median_us(fn: Callable[[], object], *, warmup: int = 10, reps: int = 50) -> float:
    """Median wall time of ``fn`` in microseconds, one pair of CUDA events per repetition."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def cold_l2_us(fn: Callable[[], object], *, warmup: int = 10, reps: int = 60) -> float:
    """Median microseconds of ``fn`` with a cold L2 (``triton.testing.do_bench`` flushes a 256 MB
    buffer before each repetition and times it with CUDA events)."""
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=warmup, rep=reps, return_mode="median")


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph; it runs once first on a side stream so that nothing compiles
    or sizes a workspace inside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn: Callable[[], object]) -> float:
    """Median microseconds of ``fn`` replayed as a CUDA graph (cold L2, no Python launch cost)."""
    return cold_l2_us(capture_graph(fn).replay)


def measure_copy_ceiling_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), warmup=3, reps=20)
    return 2 * num_bytes / (us * 1e-6) / 1e9


_BASELINES = {"measure": True}  # False: --kernels-only, the dspark kernels alone (layout before/after runs)


def skip_baselines() -> None:
    """Measure the dspark kernels only: ``baseline_us`` and ``try_compile`` answer None from now on."""
    _BASELINES["measure"] = False


def baseline_us(fn: Callable[[], object]) -> float | None:
    """``cold_l2_us`` of a baseline (the PyTorch reference, eager or compiled), None when skipped."""
    return cold_l2_us(fn) if _BASELINES["measure"] else None


def try_compile(fn: Callable) -> Callable | None:
    """``torch.compile(fn)``, or None when compilation is unavailable here or baselines are skipped."""
    if not _BASELINES["measure"]:
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception:  # noqa: BLE001 - benchmark only: report "not measured"
        return None


def append_row(out: list, make_row) -> None:
    """Append ``make_row()``; a configuration that fails is reported and skipped, not fatal."""
    try:
        out.append(make_row())
    except Exception as exc:  # noqa: BLE001 - benchmark only
        print(f"benchmark configuration failed: {type(exc).__name__}: {exc}", flush=True)


def row(
    kernel: str,
    backend: str,
    shape: dict,
    us: float,
    num_bytes: int,
    ceiling_gbps: float,
    *,
    reference_us: float | None = None,
    compiled_us: float | None = None,
    target: str | None = None,
) -> dict:
    """One JSON result row; ``target`` is the issue's speed target in words, for the report."""
    gbps = num_bytes / (us * 1e-6) / 1e9
    out = {
        "kernel": kernel,
        "backend": backend,
        "shape": shape,
        "median_us": round(us, 2),
        "bytes": int(num_bytes),
        "gb_per_s": round(gbps, 1),
        "pct_of_copy_ceiling": round(100.0 * gbps / ceiling_gbps, 1),
    }
    if reference_us is not None:
        out["reference_us"] = round(reference_us, 2)
        out["speedup_vs_reference"] = round(reference_us / us, 2)
    if compiled_us is not None:
        out["compiled_us"] = round(compiled_us, 2)
        out["speedup_vs_compiled"] = round(compiled_us / us, 2)
    if target is not None:
        out["target"] = target
    return out


def release(device: torch.device) -> None:
    """Free a finished measurement's engine (its KV blocks and state pool: ~28 GB of rings at
    B = 64 on the 9B shape; engines hold reference cycles) before the next one allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record(row: dict, name: str, measure, device: torch.device, save) -> list[list[int]] | None:
    """``row[name] = attempt(measure)`` less its ``outputs`` (returned, None if none), then the
    measurement's memory freed and the report saved."""
    row[name] = attempt(measure)
    outputs = row[name].pop("outputs", None)
    release(device)
    save()
    return outputs


def python_profile_table(fn: Callable[[], object], rows: int = 40) -> str:
    """``fn`` run once under cProfile: the Python functions by own time, then by cumulative time --
    where the host's share of a step goes (the PyTorch profiler shows operators, not the engine)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def profile_table(fn: Callable[[], object], device: torch.device, rows: int = 40) -> str:
    """``fn`` run once under the PyTorch profiler: its operators and kernels (graph replays'
    included) by device time, by host time on the CPU -- where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return profiler.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows,
                                         max_name_column_width=100)
