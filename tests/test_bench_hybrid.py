"""``dspark.bench.hybrid`` on the CPU: the tiny Qwen3.5-shaped target end to end (the plumbing the GPU
session's one command relies on), and a failed measurement reported, not fatal."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.bench import hybrid

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_tiny_shape_runs_every_measurement(tmp_path, capsys):
    """Two rows, prompts of 16 tokens, 17 new (the first from the prompt, then two whole rounds):
    transformers' eager step, plain decoding (one token per row per step), DSpark rounds with random
    drafts and at acceptance 1 (fp32: the oracle's drafts are the target's own greedy tokens, so every
    steady round commits the whole block), into hybrid.json and the printed table."""
    assert hybrid.main(["--device", "cpu", "--shape", "tiny", "--batches", "2", "--prompt", "16", "--new", "17",
                        "--hf", "eager", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "hybrid.json").read_text())
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


def test_the_baselines_refuse_a_model_an_engine_wrapped():
    """An engine's ``HFTarget`` routes the gated DeltaNet mixers through dspark: transformers'
    baseline on that model would time dspark's routing, so it is refused naming why."""
    from dspark.model.hf_target import HFTarget

    model = hybrid.random_target(hybrid.SHAPES["tiny"], device="cpu", dtype=torch.float32)
    hybrid.pristine(model)
    HFTarget(model)
    with pytest.raises(ValueError, match="needs the model unwrapped, but 3 mixers are routed"):
        hybrid.pristine(model)
