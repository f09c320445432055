"""``python -m dspark.bench.host``: the engine's host time per step on a fake device."""

import pytest

from dspark.bench import host
from dspark.engine.schedulers import SPSCostTable


def test_the_host_benchmark_times_each_scheduler_on_a_fake_device(tmp_path, capsys):
    table = tmp_path / "cost.json"
    SPSCostTable((1, 8, 64), (1.0, 1.2, 3.0), draft_rows=(1, 4), draft_time_ms=(0.2, 0.4)).write_json(table)
    assert host.main(["--rows", "1,3", "--cost-table", str(table), "--steps", "3", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["rows", "plain", "off", "cost", "cost-online"]
    for line, rows in zip(lines[1:], (1, 3)):
        values = line.split()
        assert int(values[0]) == rows and all(float(v) > 0 for v in values[1:5])
    with pytest.raises(ValueError, match="past the context"):
        host.host_time("off", 1, steps=10_000, repeats=1)


def test_the_host_benchmark_times_the_cost_schedulers_planning_alone(tmp_path, capsys):
    table = tmp_path / "cost.json"
    SPSCostTable((1, 8, 64), (1.0, 1.2, 3.0)).write_json(table)
    assert host.main(["--plan", "--rows", "2", "--cost-table", str(table), "--repeats", "1"]) == 0
    values = capsys.readouterr().out.splitlines()[1].split()
    assert values[0] == "2" and all(float(v) > 0 for v in values[1:5])
    with pytest.raises(SystemExit):
        host.main(["--plan"])
