"""Where an engine step's wall time goes: device busy against idle, step by step.

``trace_steps(engine, run, first, count, trace_to)`` runs ``run`` (something that steps ``engine``:
``engine.generate(requests)``) with steps ``first .. first + count - 1`` under the PyTorch profiler,
each inside a ``dspark-step`` annotation, writes the Chrome trace (``trace_to``, gzip) and returns
one ``StepTrace`` a step: its kind (``plain`` / ``refresh`` / ``verify`` / ``verify+draft``, ``+prompt``
where it ran prompt chunks too: ``step_kind``, as ``bench.load.SteadyWindow`` names them), its wall
time (from its start to the next step's: the host's work between steps included), the device's busy
time in that span (the union of its kernels and copies, CUDA graph replays' included) and the
kernels that took most of it. A step whose wall exceeds its busy time by much left the device idle
while the host planned, launched or committed; one whose busy time grew ran more device work.

The profiler slows the host: with kernel tracing on, launching a CUDA graph costs about 1 - 3 µs
per node (0.4 - 1.1 ms for the 8B shape's 360-node decode graphs on an H100, where a 360-kernel
graph launches in 6 µs untraced), so a traced step's idle time overstates the untraced one's; its
device busy time is the untraced step's.
"""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

__all__ = ["StepTrace", "kind_summary", "trace_steps", "trace_markdown"]

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_EVENTS = ("cuda_runtime", "cuda_driver")
ANNOTATION = "dspark-step"


@dataclass
class StepTrace:
    """One traced step: ``kind``, ``wall_ms`` (its start to the next step's start), ``busy_ms`` (device
    busy within that span; None without device events: the CPU), ``waited_ms`` (the host blocked in a
    CUDA synchronisation: the rest of the wall is host work) and ``kernels`` (ms by name, largest first:
    every kernel and copy in the span)."""

    index: int
    kind: str
    wall_ms: float
    busy_ms: float | None
    waited_ms: float = 0.0
    kernels: dict[str, float] = field(default_factory=dict)

    @property
    def idle_ms(self) -> float | None:
        return None if self.busy_ms is None else self.wall_ms - self.busy_ms


class Counters(NamedTuple):
    """The engine's counters a step's kind is read from (``LLMEngine.metrics``' names)."""

    draft_tokens: int
    plain_steps: int
    prompt_tokens: int

    @classmethod
    def of(cls, counters) -> "Counters":
        return cls(counters.draft_tokens, counters.plain_steps, counters.prompt_tokens)


def step_drafted(before, after, speculative: bool) -> bool:
    """Whether the step between counters ``before`` and ``after`` ran the draft pass (a DSpark
    runner's step that was not a plain round)."""
    return speculative and after.plain_steps == before.plain_steps


def step_kind(before, after, speculative: bool) -> str:
    """The kind of the step between counters ``before`` and ``after`` (``Counters``' fields): whether
    it verified drafts and whether it ran the draft pass, with ``+prompt`` where it also ran prompt
    chunks (their work is the prompts', not the rounds')."""
    verified, drafted = after.draft_tokens > before.draft_tokens, step_drafted(before, after, speculative)
    kind = {(False, False): "plain", (False, True): "refresh", (True, True): "verify+draft",
            (True, False): "verify"}[verified, drafted]
    return kind + "+prompt" if after.prompt_tokens > before.prompt_tokens else kind


def trace_steps(engine, run: Callable[[], object], first: int, count: int, trace_to: Path) -> list[StepTrace]:
    """``run()`` with ``engine``'s steps ``first .. first + count - 1`` (counted from this call) profiled;
    the Chrome trace into ``trace_to`` (gzip); one ``StepTrace`` per traced step that ran. The
    profiler stops once the last traced step's device work is done: its span ends there."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = engine.runner.device.type == "cuda"
    profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    calls, kinds, state = itertools.count(), [], {"started": False, "stopped": False}
    step = engine.step

    def stop() -> None:  # right after the last traced step: the steps after it are not in the trace
        if cuda:
            torch.cuda.synchronize(engine.runner.device)
        profiler.stop()
        state["stopped"] = True

    def traced():
        n = next(calls)
        if not first <= n < first + count:
            return step()
        if n == first:
            profiler.start()
            state["started"] = True
        before = Counters.of(engine.metrics)
        with record_function(f"{ANNOTATION} {n - first}"):
            outputs = step()
        kinds.append(step_kind(before, engine.metrics, engine.runner.drafter is not None))
        if n == first + count - 1:
            stop()
        return outputs

    engine.step = traced
    try:
        run()
    finally:
        del engine.step  # the class's method again
        if state["started"] and not state["stopped"]:  # the run ended before the last traced step
            stop()
    if not state["started"]:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())["traceEvents"]
        with raw.open("rb") as src, gzip.open(trace_to, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return step_traces(events, kinds)


def step_traces(events: list[dict], kinds: list[str]) -> list[StepTrace]:
    """``StepTrace`` rows from a Chrome trace's events (``kinds``: each annotated step's kind, in order)."""
    steps = sorted((e for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith(ANNOTATION)),
                   key=lambda e: e["ts"])
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                    if e.get("cat") in DEVICE_EVENTS)
    waits = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("cat") in RUNTIME_EVENTS and "Synchronize" in e.get("name", "")]
    ends = [e["ts"] for e in steps[1:]] + [max([steps[-1]["ts"] + steps[-1]["dur"]] + [end for _, end, _ in device])] \
        if steps else []
    rows = []
    for i, (annotation, end) in enumerate(zip(steps, ends)):
        start = annotation["ts"]
        busy, kernels, reach = 0.0, Counter(), start
        for lo, hi, name in device:
            lo, hi = max(lo, start), min(hi, end)
            if hi <= lo:
                continue
            kernels[name] += hi - lo
            busy += max(0.0, hi - max(lo, reach))  # the union: overlapping events count once
            reach = max(reach, hi)
        waited = sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in waits)
        rows.append(StepTrace(i, kinds[i] if i < len(kinds) else "?", (end - start) / 1e3,
                              busy / 1e3 if device else None, waited / 1e3,
                              {name: round(us / 1e3, 3) for name, us in kernels.most_common()}))
    return rows


def kind_summary(rows: list[StepTrace]) -> dict[str, dict]:
    """Per step kind: steps, mean wall / busy / idle ms, and the kernels' mean ms a step (largest 8)."""
    summary = {}
    for kind in sorted({r.kind for r in rows}):
        of = [r for r in rows if r.kind == kind]
        kernels = Counter()
        for r in of:
            kernels.update(r.kernels)
        busy = None if of[0].busy_ms is None else round(sum(r.busy_ms for r in of) / len(of), 3)
        wall = round(sum(r.wall_ms for r in of) / len(of), 3)
        summary[kind] = {"steps": len(of), "wall_ms": wall, "busy_ms": busy,
                         "idle_ms": None if busy is None else round(wall - busy, 3),
                         "waited_ms": round(sum(r.waited_ms for r in of) / len(of), 3),
                         "kernels_ms": {k: round(v / len(of), 3) for k, v in kernels.most_common(8)}}
    return summary


def trace_markdown(title: str, rows: list[StepTrace]) -> str:
    """The traced steps as a table, then the summary by kind."""
    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"### {title}", "",
             "| step | kind | wall ms | device busy ms | idle ms | host waited ms | largest kernels (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{name[:40]} {t:.3f}" for name, t in list(r.kernels.items())[:3])
        lines.append(f"| {r.index} | {r.kind} | {r.wall_ms:.3f} | {ms(r.busy_ms)} | {ms(r.idle_ms)} | "
                     f"{r.waited_ms:.3f} | {top} |")
    lines += ["", "| kind | steps | wall ms | device busy ms | idle ms | host waited ms |", "|---|---|---|---|---|---|"]
    for kind, s in kind_summary(rows).items():
        lines.append(f"| {kind} | {s['steps']} | {s['wall_ms']:.3f} | {ms(s['busy_ms'])} | {ms(s['idle_ms'])} | "
                     f"{s['waited_ms']:.3f} |")
    lines += ["", "Kernels by kind (mean ms a step):", ""]
    for kind, s in kind_summary(rows).items():
        lines.append(f"- {kind}: " + "; ".join(f"{name[:70]} {t:.3f}" for name, t in s["kernels_ms"].items()))
    return "\n".join(lines)
