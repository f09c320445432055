"""``dspark.bench.hybrid`` on the CPU: the tiny Qwen3.5-shaped target end to end (the plumbing the GPU
session's one command relies on), and a failed, hung or crashed measurement reported, not fatal."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
import torch

from dspark.bench import hybrid, isolate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_tiny_shape_runs_every_measurement(tmp_path, capsys):
    """Two rows, prompts of 16 tokens, 17 new (the first from the prompt, then two whole rounds):
    transformers' eager step (in a child process that rebuilds the target), plain decoding (one token per row per step), DSpark rounds with random
    drafts and at acceptance 1 (fp32: the oracle's drafts are the target's own greedy tokens, so every
    steady round commits the whole block), into hybrid.json and the printed table."""
    assert hybrid.main(["--device", "cpu", "--shape", "tiny", "--batches", "2", "--prompt", "16", "--new", "17",
                        "--hf", "eager", "--out", str(tmp_path), "--profile", "2"]) == 0
    report = json.loads((tmp_path / "hybrid.json").read_text())
    assert "Self CPU" in (tmp_path / "profile-dspark_random-b2.txt").read_text()  # the rounds once more, profiled
    assert (report["shape"], report["dtype"], report["floor_ms"]) == ("tiny", "float32", None)
    (row,) = report["rows"]
    assert not [k for k, v in row.items() if isinstance(v, dict) and "error" in v], row
    assert row["batch"] == 2 and "hf_compiled" not in row and row["hf_eager"]["step_ms"] > 0
    assert row["plain"]["tokens_per_step"] == 2 and row["dspark_random"]["tokens_per_step"] >= 2
    assert row["dspark_a1"]["tokens_per_step"] == 2 * (report["drafts_per_round"] + 1)  # P drafts + the bonus token
    for key in ("plain", "dspark_random", "dspark_a1"):
        r = row[key]
        assert r["ms_per_token"] == round(r["step_ms"] / r["tokens_per_step"], 4) and "outputs" not in r
    table = capsys.readouterr().out
    assert "| B | HF compiled ms/step |" in table and f"| 2 | – | {row['hf_eager']['step_ms']} |" in table


def test_a_failed_measurement_is_recorded_and_shown():
    """A measurement that raises becomes its error in the row (the others still run) and a line under
    the table."""
    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    failed = hybrid.attempt(out_of_memory)
    assert failed == {"error": "RuntimeError: CUDA out of memory"}
    ok = dict(step_ms=2.0, tokens_per_step=1.0, ms_per_token=2.0)
    report = dict(shape="tiny", dtype="float32", device="cpu", prompt=16, new=8, floor_ms=None, parameter_bytes=10,
                  rows=[dict(batch=1, hf_compiled=failed, plain=ok, dspark_random=ok)])
    text = hybrid.markdown(report)
    assert "| 1 | error | – | 2.0 | 2.0 | 2.0 | 2.0 | – | – | – |" in text
    assert "- B = 1 hf_compiled: RuntimeError: CUDA out of memory" in text


def never_finishes(model, batch: int, prompt: int) -> dict:
    """A baseline that hangs, as ``torch.compile`` did at B = 64 on the 9B shape (module level: the
    spawned child imports it from this module)."""
    time.sleep(600)
    return {}


def test_a_baseline_past_its_timeout_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    """The compiled baseline hangs: its child is killed after --hf-timeout seconds, the row records
    the timeout, dspark's three measurements are all there, and no child outlives the run."""
    monkeypatch.setitem(hybrid.HF_BASELINES, "hf_compiled", never_finishes)
    start = time.perf_counter()
    assert hybrid.main(["--device", "cpu", "--shape", "tiny", "--batches", "2", "--prompt", "16", "--new", "17",
                        "--hf", "compiled", "--hf-timeout", "1", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - start < 120  # not the 600 s sleep
    assert multiprocessing.active_children() == []
    report = json.loads((tmp_path / "hybrid.json").read_text())
    (row,) = report["rows"]
    assert row["hf_compiled"] == {"error": "timed out after 1 s"} and report["hf_timeout_s"] == 1
    assert "hf_eager" not in row
    for key in ("plain", "dspark_random", "dspark_a1"):
        assert "error" not in row[key] and row[key]["step_ms"] > 0, row


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "nan"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout, capsys):
    with pytest.raises(SystemExit):
        hybrid.main(["--device", "cpu", "--shape", "tiny", "--hf-timeout", timeout])
    assert f"--hf-timeout takes a positive, finite number of seconds, got {timeout}" in capsys.readouterr().err


def test_a_profile_of_a_batch_the_run_has_not_is_refused(capsys):
    with pytest.raises(SystemExit):
        hybrid.main(["--device", "cpu", "--shape", "tiny", "--batches", "2", "--profile", "4"])
    assert "--profile must name batch sizes of --batches [2], got [4]" in capsys.readouterr().err


def test_a_child_that_dies_before_replying_is_recorded():
    """A child killed outright (a segfault in a compiler, the kernel's OOM killer) sends nothing:
    its exit code is the error, and the parent goes on."""
    assert isolate.in_child(os._exit, 3, timeout=120) == {"error": "child process exited with code 3 before replying"}


def test_a_rebuilt_target_has_the_same_weights():
    """The baselines' children rebuild the target from its recipe: the seed, not the RNG's state,
    decides the weights."""
    recipe = hybrid.TargetRecipe("tiny", "cpu", torch.float32, seed=0, threads=1)
    first = recipe.build().state_dict()
    torch.rand(5)
    second = recipe.build().state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
