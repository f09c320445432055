"""``dspark.bench.engine``'s timed runs on the CPU: every batch size gets steady steps to time,
even where admitting the prompts takes longer than the first requests take to finish."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.bench import engine


def test_a_batch_admitted_slower_than_it_finishes_still_has_steady_steps(tmp_path):
    """8 prompts of 600 tokens, 2 new tokens: under the engine's default step budget (2048 tokens)
    the last prompt is admitted after the first requests finished, so no step ran every row (the
    benchmark died on an empty median); the benchmark's budget admits them all in one step."""
    assert engine.main(["--backends", "fused", "--device", "cpu", "--shapes", "tiny", "--batches", "8",
                        "--prompt", "600", "--new", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "backends.json").read_text())["shapes"][0]["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("plain", 8), ("dspark", 8)]
    assert all(r["step_ms"] > 0 and r["tokens_per_step"] == 8 for r in rows)  # one token per row per step


@pytest.fixture(scope="module")
def tiny_pair():
    model = engine.random_target(engine.TINY, vocab=1024, device="cpu", dtype=torch.float32)
    return model, engine.random_drafter(model, engine.TINY)


def test_the_oracle_engine_at_acceptance_one_times_full_rounds(tiny_pair):
    """``run_shape``'s path on a tiny model: the oracle engine at acceptance 1 keeps every draft, so
    each steady round commits the whole block (P + 1 tokens) for every row."""
    from dspark.bench.oracle import OracleEngine
    from dspark.engine import LLMEngine

    model, drafter = tiny_pair
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1023, (64,), generator=generator).tolist() for _ in range(8)]
    plain = engine.engine_run(LLMEngine(model, None, engine.steady_config(8, 64, 17)), prompts, 17)["outputs"]
    oracle = OracleEngine(model, drafter, engine.steady_config(8, 64, 17, drafter), acceptance=1.0)
    run = engine.engine_run(oracle, prompts, 17, [o + [0] * 16 for o in plain])
    assert run["outputs"] == plain  # fp32: the target's own greedy tokens
    assert run["tokens_per_step"] == 8 * (drafter.config.num_draft_tokens + 1)


def test_no_steady_step_is_a_clear_error(tiny_pair):
    """A batch whose requests finish before the last prompt is admitted (the engine's default budget)
    is refused naming what to change, not a bare empty-median error."""
    from dspark.engine import EngineConfig, LLMEngine

    prompts = [[1] * 600 for _ in range(8)]
    plain = LLMEngine(tiny_pair[0], None, EngineConfig(max_batch=8, max_model_len=640, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="no step ran all 8 requests without prompt chunks.*new tokens"):
        engine.engine_run(plain, prompts, 2)
