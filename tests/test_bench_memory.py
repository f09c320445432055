"""``python -m dspark.bench.memory``: its arguments, and the report it writes when a capture runs out
of memory (CPU: the CUDA memory queries and the engine are fakes; the measurement itself needs a GPU)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dspark.bench import memory

GIB = 2**30


class FakeDevice:
    """What the allocator reports: each capture reserves 1 GiB more in the graphs' pool, its warm-up
    peaks 2 GiB above what is allocated."""

    def __init__(self, monkeypatch):
        self.reserved = self.allocated = self.peak = 0
        for name, fake in (("memory_reserved", lambda device: self.reserved),
                           ("memory_allocated", lambda device: self.allocated),
                           ("max_memory_allocated", lambda device: self.peak),
                           ("reset_peak_memory_stats", lambda device: None),
                           ("mem_get_info", lambda device: (40 * GIB - self.reserved, 80 * GIB)),
                           ("memory_snapshot", lambda: [{"device": 0, "total_size": self.reserved,
                                                         "segment_pool_id": (0, 1)},
                                                        {"device": 0, "total_size": 5 * GIB,
                                                         "segment_pool_id": (0, 0)}])):
            monkeypatch.setattr(torch.cuda, name, fake)

    def capture(self) -> None:
        self.peak = self.allocated + 2 * GIB
        self.reserved += GIB


class FakeRunner:
    device = torch.device("cuda", 0)
    use_graphs = True

    def __init__(self, device: FakeDevice):
        self.graphs, self.uncapturable, self.memory = {}, set(), device

    def _replay(self, key, fn):
        if key not in self.graphs:
            self.memory.capture()
            self.graphs[key] = fn
        fn()


class FakeEngine:
    """``capture_graphs`` captures ``graphs`` verify graphs, then raises ``error`` (if any)."""

    def __init__(self, device: FakeDevice, graphs: int, error: Exception | None = None):
        self.runner, self.graphs, self.error = FakeRunner(device), graphs, error

    def capture_graphs(self) -> int:
        for b in range(self.graphs, 0, -1):
            self.runner._replay(("verify", b, 8 * b), lambda: None)
        if self.error is not None:
            raise self.error
        return len(self.runner.graphs)


def estimate(pool_gib: float) -> dict:
    return {"estimate_gib": {"graph_pool": pool_gib, "warm_up": 2.0, "total": pool_gib + 2.0}}


def test_a_capture_out_of_memory_still_writes_what_was_recorded(tmp_path, monkeypatch):
    """The graphs captured before the one that ran out of memory are in memory.json, with the pool
    so far (its segments) and the error; the error still ends the run."""
    device = FakeDevice(monkeypatch)
    engine = FakeEngine(device, 3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 668.00 MiB"))
    with pytest.raises(torch.OutOfMemoryError, match="668.00 MiB"):
        memory.write_report(engine, tmp_path / "run", estimate(2.5))
    report = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert report["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 668.00 MiB"
    assert report["graphs_recorded"] == 3 and "graphs" not in report
    assert [g["key"] for g in report["growth"]] == [["verify", "3", "24"], ["verify", "2", "16"], ["verify", "1", "8"]]
    assert all(g["reserved_growth_gib"] == 1.0 and g["warm_up_peak_gib"] == 2.0 for g in report["growth"])
    assert report["graph_pool_gib"] == 3.0 and report["captures_took_gib"] == 3.0
    assert report["largest_warm_up_peak_gib"] == 2.0 and report["estimate_holds"] is False  # 3 GiB > 2.5


def test_a_run_that_captures_everything_reports_the_pool_against_the_estimate(tmp_path, monkeypatch):
    device = FakeDevice(monkeypatch)
    report = memory.write_report(FakeEngine(device, 2), tmp_path, estimate(2.5))
    assert json.loads((tmp_path / "memory.json").read_text()) == report
    assert report["graphs"] == 2 and report["graph_pool_gib"] == 2.0 and report["estimate_holds"] is True
    assert "error" not in report


def test_memory_json_holds_each_graph_as_soon_as_it_is_captured(tmp_path, monkeypatch):
    """A run its time limit kills mid-capture keeps what it measured: memory.json is rewritten after
    every new graph (read here from inside the captures, before the run ends)."""
    device = FakeDevice(monkeypatch)
    engine, on_disk = FakeEngine(device, 3), []
    replay = engine.runner._replay

    def reading(key, fn):
        if (tmp_path / "memory.json").exists():
            on_disk.append([g["key"] for g in json.loads((tmp_path / "memory.json").read_text())["growth"]])
        replay(key, fn)

    engine.runner._replay = reading
    memory.write_report(engine, tmp_path, estimate(2.5))
    assert on_disk == [[["verify", "3", "24"]], [["verify", "3", "24"], ["verify", "2", "16"]]]


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "0"], r"--gpu-memory-utilization must be in \(0, 1\], got 0.0"),
    (["--gpu-memory-utilization", "1.5"], r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"),
    (["--gpu-memory-utilization", "half"], r"argument --gpu-memory-utilization: invalid float value: 'half'"),
    (["--batch", "0"], r"--batch must be >= 1 and --max-model-len >= 16, got 0 and 512"),
    (["--shape", "qwen3-1b"], r"--shape must be one of \['qwen3-0.6b', 'qwen3-8b', '70b'\], got 'qwen3-1b'"),
])
def test_bad_arguments_name_the_argument(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "memory.json").exists()
