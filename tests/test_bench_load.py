"""``python -m dspark.bench.load`` on the CPU (toy shape, fp32): the cost table is profiled, every
configuration runs its requests twice, and the report says whether every configuration gave every
request the same tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dspark.bench import load


def test_load_bench_runs_every_configuration_with_the_same_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    status = load.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--batches", "2,3",
                        "--max-tokens", "16", "--prompt-tokens", "12", "--num-prompts", "3"])
    report = json.loads((tmp_path / "load.json").read_text())
    assert status == 0 and report["outputs_identical"] is True
    assert (tmp_path / "cost_table.json").is_file() and (tmp_path / "load.md").is_file()
    table = json.loads((tmp_path / "cost_table.json").read_text())  # up to 3 rows of 8 (P + 1) verify tokens
    assert table["decode_rows"] == [1, 2, 3] and table["tokens_per_row"] == 8 and table["draft_rows"]
    for batch in ("2", "3"):
        rows = {r["config"]: r for r in report["batches"][batch]}
        assert set(rows) == set(load.LOAD_CONFIGS)
        for r in rows.values():
            lengths = load.output_lengths(16, 0.5, 2 * int(batch))
            assert r["failed"] == 0 and r["tokens"] == sum(lengths) and r["tokens_per_s"] > 0
            # no graphs on the CPU: nothing captured, the same throughput either way
            assert r["capture_seconds"] == 0 and r["tokens_per_s_captured_first"] == r["tokens_per_s"]
            assert r["config"] == "plain" or 0 < r["rows_per_step"] <= int(batch)
            assert r["held_rounds"] == 0 or r["config"] == "dspark-scheduled"
            assert r["steady_steps"] > 0 and r["steady_tokens_per_s"] > 0
            assert r["table_step_ms"] > 0 and r["tokens_per_forward"] >= (1 if r["config"] == "plain" else 2)
        assert rows["plain"]["tau"] is None and rows["dspark-fixed"]["tau"] > 1


def test_the_mixed_workload_runs_greedy_and_mixed_settings(tmp_path, monkeypatch):
    """``--workload mixed``: each configuration under greedy and under the mixed settings; the
    greedy requests of every run (request i with i mod 4 = 0 in a mixed run) get the same tokens."""
    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    status = load.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--batches", "2",
                        "--max-tokens", "12", "--prompt-tokens", "12", "--num-prompts", "3", "--workload", "mixed",
                        "--configs", "plain,dspark-random-vocabulary", "--profile", "dspark-random-vocabulary-mixed"])
    report = json.loads((tmp_path / "load.json").read_text())
    assert status == 0 and report["outputs_identical"] is True
    # the profiled configuration's requests ran a third time under the PyTorch profiler
    assert "Self CPU" in (tmp_path / "profile-dspark-random-vocabulary-mixed-b2.txt").read_text()
    assert sorted(p.name for p in tmp_path.glob("profile-*")) == ["profile-dspark-random-vocabulary-mixed-b2-python.txt",
                                                                   "profile-dspark-random-vocabulary-mixed-b2.txt"]
    assert "llm_engine.py" in (tmp_path / "profile-dspark-random-vocabulary-mixed-b2-python.txt").read_text()
    assert [r["config"] for r in report["batches"]["2"]] == [
        "plain", "plain-mixed", "dspark-random-vocabulary", "dspark-random-vocabulary-mixed"]
    assert "mixed / greedy" in (tmp_path / "load.md").read_text()


def test_output_lengths_spread_evenly_below_max_tokens():
    lengths = load.output_lengths(256, 0.5, 512)
    assert min(lengths) >= 128 and max(lengths) == 256 and len(set(lengths)) > 100
    assert sum(n < 192 for n in lengths) in range(240, 273)  # half below the middle
    assert load.output_lengths(16, 0.0, 3) == [16, 16, 16]


def test_engine_settings_are_the_served_configurations():
    assert load.engine_settings("dspark-fixed", "t.json") == {"scheduler": "off"}
    assert load.engine_settings("dspark-scheduled-online", "t.json") == {
        "scheduler": "cost", "cost_table": "t.json", "schedule_signal": "online"}
    assert load.engine_settings("dspark-random-vocabulary", "t.json", "mixed") == {"scheduler": "off",
                                                                                   "draft_candidates": 0}


@pytest.mark.parametrize("argv, message", [(["--batches", "0"], "--batches must be"),
                                           (["--configs", "fast"], "--configs must name"),
                                           (["--shape", "huge"], "--shape must be one of"),
                                           (["--length-spread", "1"], "--length-spread must be in [0, 1)"),
                                           (["--shape", "tiny", "--configs", "plain", "--profile", "plain-mixed"],
                                            "--profile must name labels this run reports (plain)"),
                                           (["--shape", "tiny", "--cost-table", "missing.json"],
                                            "--cost-table must be a cost table file"),
                                           (["--shape", "tiny", "--host-ms", "3"], "--host-ms must be DRAFTING,PLAIN"),
                                           (["--shape", "tiny", "--host-ms", "3,-1"], "--host-ms must be DRAFTING,PLAIN")])
def test_bad_arguments_name_the_flag(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit):
        load.main(["--out", str(tmp_path), "--device", "cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("priced", [False, True])
def test_the_steady_window_is_the_steps_while_requests_wait(priced):
    """``SteadyWindow``: the tokens of the steps after the first that ended once as many requests
    as rows had produced tokens, up to the last step with requests waiting, over the engine's step
    time between them less the capture steps' time; by kind, with the host's share and, given a cost
    table, the step's price (its rows' tokens and prompt tokens in one forward, the draft pass)."""
    from dspark.engine.schedulers import SPSCostTable

    metrics = SimpleNamespace(steps=0, step_time=0.0, capture_step_time=0.0, plain_steps=0, draft_tokens=0,
                              prompt_tokens=0, host_time=0.0, row_tokens=0, rounds=0)
    scheduler = SimpleNamespace(waiting=[1], prefilling=[], running=[1, 2], max_batch=2)
    engine = SimpleNamespace(metrics=metrics, scheduler=scheduler, runner=SimpleNamespace(drafter=object()))
    table = SPSCostTable((1, 101), (1.0, 2.0), draft_rows=(1, 2), draft_time_ms=(0.3, 0.5)) if priced else None
    window = load.SteadyWindow(engine, table)
    # 1 s a step (0.25 s of it the host's); request 1's first tokens come in step 2; step 4 captured a
    # graph for 0.5 s of it; steps 3 and 5 run the next prompts; the queue empties after step 5
    for step in range(1, 7):
        metrics.steps, metrics.step_time, metrics.host_time = step, float(step), step / 4
        metrics.prompt_tokens = 12 * (step >= 3) + 12 * (step >= 5)
        metrics.capture_step_time = 0.5 if step >= 4 else 0.0
        # steps 1-2 plain rounds; from step 3 each verifies 3 drafts a row (2 rows) and drafts the next round
        metrics.plain_steps, metrics.draft_tokens = min(step, 2), 3 * max(0, step - 2)
        metrics.row_tokens, metrics.rounds = 2 * min(step, 2) + 8 * max(0, step - 2), 2 * step
        scheduler.waiting = [1] if step <= 5 else []
        for request in (0, 1) if step > 1 else (0,):  # 5 tokens a request a step
            window.observe(SimpleNamespace(request_id=request, new_token_ids=[0] * 5))
    # the ramp ends in step 2 (request 1's first tokens): steps 4, 5 after step 3; by kind, step 5
    # (step 4 captured a graph): 8 row tokens and 12 prompt tokens in a forward, a 2-row draft pass
    kind = {"steps": 1, "ms": 1000.0, "host_ms": 250.0, "tokens": 10.0}
    if priced:
        kind["table_ms"] = round(1.0 + 19 / 100 + 0.5, 3)
    assert window.report() == {"steady_steps": 2, "steady_tokens_per_s": round(20 / 1.5, 1),
                               "steady_step_kinds": {"verify+draft+prompt": kind}}
    assert load.SteadyWindow(engine).report() == {"steady_steps": 0, "steady_tokens_per_s": None}


def test_isolated_jobs_run_each_configuration_in_a_process_of_its_own(tmp_path, monkeypatch):
    """``--isolate`` (the default on a GPU): the profile and every configuration in a fresh process,
    with the same report."""
    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    status = load.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--batches", "2",
                        "--configs", "plain,dspark-scheduled", "--max-tokens", "12", "--prompt-tokens", "12",
                        "--num-prompts", "2", "--isolate"])
    report = json.loads((tmp_path / "load.json").read_text())
    assert status == 0 and report["outputs_identical"] is True and (tmp_path / "cost_table.json").is_file()
    assert [r["config"] for r in report["batches"]["2"]] == ["plain", "dspark-scheduled"]
    assert all(r["failed"] == 0 and r["tokens"] == sum(load.output_lengths(12, 0.5, 4)) for r in report["batches"]["2"])


def test_a_given_cost_table_is_used_instead_of_profiling_one(tmp_path, monkeypatch):
    """``--cost-table``: the scheduler runs on that table (a GPU run's, on the CPU replay), none is
    profiled -- a table that makes drafting never pay gives plain rounds only after the first."""
    from dspark.engine.schedulers import SPSCostTable

    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    table = tmp_path / "never.json"
    SPSCostTable((1, 4096), (1.0, 4096.0), draft_rows=(1,), draft_time_ms=(50.0,)).write_json(table)
    out = tmp_path / "out"
    status = load.main(["--out", str(out), "--device", "cpu", "--shape", "tiny", "--batches", "2", "--configs",
                        "plain,dspark-scheduled", "--max-tokens", "16", "--prompt-tokens", "12", "--num-prompts", "2",
                        "--cost-table", str(table)])
    report = json.loads((out / "load.json").read_text())
    assert status == 0 and not (out / "cost_table.json").exists()
    scheduled = report["batches"]["2"][1]
    assert scheduled["config"] == "dspark-scheduled" and scheduled["plain_steps"] >= scheduled["steps"] - 2


@pytest.mark.parametrize("host_ms, drafts", [(None, True), ("1000,0", False)])
def test_given_host_times_price_the_cpu_replays_rounds(tmp_path, monkeypatch, host_ms, drafts):
    """``--host-ms DRAFTING,PLAIN``: the CPU replay's cost scheduler prices the rounds' host time at
    those milliseconds (it measures none on the CPU) -- on a flat table drafting pays, unless a
    drafting round's host time is priced at a second."""
    from dspark.engine.schedulers import SPSCostTable

    monkeypatch.delenv("DSPARK_REPLAY", raising=False)
    table = tmp_path / "flat.json"
    SPSCostTable((1, 4096), (1.0, 1.0), draft_rows=(1,), draft_time_ms=(0.01,)).write_json(table)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--device", "cpu", "--shape", "tiny", "--batches", "2", "--configs", "dspark-scheduled",
            "--max-tokens", "16", "--prompt-tokens", "12", "--num-prompts", "2", "--cost-table", str(table)]
    assert load.main(argv + (["--host-ms", host_ms] if host_ms else [])) == 0
    scheduled = json.loads((out / "load.json").read_text())["batches"]["2"][0]
    assert scheduled["priced_host_ms"] == ([1000.0, 0.0] if host_ms else [0.0, 0.0])
    assert (scheduled["plain_steps"] == 0) == drafts and (scheduled["plain_steps"] >= scheduled["steps"] - 2) != drafts
