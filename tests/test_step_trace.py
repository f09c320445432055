"""``bench.step_trace``: a step's device busy time is the union of its kernels within its span, and
``bench.load --trace`` traces the steps it names."""

from __future__ import annotations

import gzip
import json

import pytest

from dspark.bench import load
from dspark.bench.step_trace import kind_summary, step_traces


def _annotation(index: int, ts: float, dur: float) -> dict:
    return {"cat": "user_annotation", "name": f"dspark-step {index}", "ts": ts, "dur": dur}


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_the_device_events_in_each_step_span():
    # step 0 spans 0 .. 1000 us (step 1 starts there); its kernels overlap (100-400, 300-500) and one
    # crosses into step 1 (900-1200: 100 us here, 200 there); step 1 ends with its last device event
    events = [_annotation(0, 0, 800), _annotation(1, 1000, 300),
              _kernel("a", 100, 300), _kernel("b", 300, 200), _kernel("c", 900, 300),
              _kernel("copy", 1250, 150, "gpu_memcpy"), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
              {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 600, "dur": 500},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 100, "dur": 50}]
    rows = step_traces(events, ["plain", "verify+draft"])
    assert [r.kind for r in rows] == ["plain", "verify+draft"]
    assert rows[0].wall_ms == 1.0 and rows[0].busy_ms == 0.5 and rows[0].idle_ms == 0.5
    assert rows[0].kernels == {"a": 0.3, "b": 0.2, "c": 0.1}
    assert rows[0].waited_ms == 0.4 and rows[1].waited_ms == 0.1  # the wait 600 .. 1100 crosses the steps
    assert rows[1].wall_ms == 0.4 and rows[1].busy_ms == 0.35  # 1000 .. 1400: c's 200 us and the copy's 150
    summary = kind_summary(rows)
    assert summary["plain"] == {"steps": 1, "wall_ms": 1.0, "busy_ms": 0.5, "idle_ms": 0.5, "waited_ms": 0.4,
                                "kernels_ms": {"a": 0.3, "b": 0.2, "c": 0.1}}


def test_without_device_events_busy_time_is_unknown():
    rows = step_traces([_annotation(0, 0, 10), _annotation(1, 20, 10)], ["plain", "plain"])
    assert [r.busy_ms for r in rows] == [None, None] and [r.wall_ms for r in rows] == [0.02, 0.01]


def test_load_traces_the_named_steps(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    status = load.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--batches", "2",
                        "--max-tokens", "16", "--prompt-tokens", "12", "--num-prompts", "3",
                        "--configs", "plain,dspark-fixed", "--trace", "dspark-fixed", "--trace-steps", "2,3"])
    assert status == 0
    report = json.loads((tmp_path / "load.json").read_text())
    fixed = {r["config"]: r for r in report["batches"]["2"]}["dspark-fixed"]
    assert sum(s["steps"] for s in fixed["traced_step_kinds"].values()) == 3
    assert set(fixed["traced_step_kinds"]) <= {"verify+draft", "refresh", "plain", "verify"}
    events = json.loads(gzip.open(tmp_path / "trace-dspark-fixed-b2.json.gz").read())["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("dspark-step")]
    assert len(steps) == 3
    # the profiler stopped after the last traced step: nothing of the steps after it is in the trace
    last_end = max(e["ts"] + e["dur"] for e in steps)
    assert all(e["ts"] <= last_end for e in events if e.get("cat") == "cpu_op")
    assert "| step | kind | wall ms" in (tmp_path / "trace-dspark-fixed-b2.md").read_text()
    assert not list(tmp_path.glob("trace-plain-*"))
    assert "Traced steps by kind" in (tmp_path / "load.md").read_text()  # the CPU: no device time
    assert "- 2 dspark-fixed: " in (tmp_path / "load.md").read_text()


def test_trace_arguments_are_checked(tmp_path, capsys):
    for argv, message in ((["--trace", "plain"], "--trace must name labels this run reports"),
                          (["--trace-steps", "5"], "--trace-steps must be FIRST,COUNT")):
        with pytest.raises(SystemExit) as exc:
            load.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--configs", "dspark-fixed",
                       *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
