"""Calibration: ECE and AUC against brute force, STS on synthetic miscalibrated confidences, the
greedy rounds against the engine, storage of the temperatures, and ``dspark calibrate``."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from test_training import tiny_pair

from dspark.cli import calibrate as calibrate_cli
from dspark.engine import SpeculativeDecoder
from dspark.engine.drafting import Drafter
from dspark.model import load_draft
from dspark.training.calibration import (CALIBRATION_FILE, Rounds, _rounds_at, calibration_report,
                                         collect_rounds, expected_calibration_error, fit_sts,
                                         load_calibration, roc_auc, save_calibration)
from dspark.training.trainer import greedy_continuation, target_states


def test_expected_calibration_error_by_hand():
    predicted = torch.tensor([0.05, 0.1, 0.45, 0.55, 0.9, 0.95])
    outcome = torch.tensor([0, 1, 0, 1, 1, 1])
    # 2 bins: [0, .5) holds .05 .1 .45 (mean .2, outcome 1/3), [.5, 1] holds .55 .9 .95 (mean .8, outcome 1)
    expected = 3 / 6 * abs(0.2 - 1 / 3) + 3 / 6 * abs(0.8 - 1.0)
    assert expected_calibration_error(predicted, outcome, bins=2) == pytest.approx(expected)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]), bins=15) == 0.0
    with pytest.raises(ValueError, match="expected_calibration_error: bins"):
        expected_calibration_error(predicted, outcome, bins=0)
    with pytest.raises(ValueError, match="equal size"):
        expected_calibration_error(predicted, outcome[:3])


def test_roc_auc_against_pairwise_count():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=g).float() / 5  # many ties
    labels = torch.rand(60, generator=g) < scores * 0.8 + 0.1
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None]).float() + 0.5 * (pos[:, None] == neg[None]).float()
    assert roc_auc(scores, labels) == pytest.approx(float(pairs.mean()))
    assert roc_auc(scores, torch.ones(60, dtype=torch.bool)) is None


def _synthetic_rounds(n, temperatures, seed):
    """Rounds whose true conditional acceptance at position k is sigmoid(logit_k / T_k): raw
    confidences are over-confident by T_k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, len(temperatures), generator=g) * 2.5 + 1.5
    accept = torch.rand(n, len(temperatures), generator=g) < torch.sigmoid(logits / torch.tensor(temperatures))
    return Rounds(logits, accept.cumprod(dim=1).bool())


def test_sts_recovers_temperatures_and_lowers_ece():
    true = [2.0, 3.0, 1.5, 2.5]
    fitted = fit_sts(_synthetic_rounds(20000, true, seed=1))
    assert fitted == pytest.approx(true, rel=0.25)
    report = calibration_report(_synthetic_rounds(20000, true, seed=2), fitted)
    for row in report:
        assert row["ece_after"] < 0.02 < row["ece_before"]
        assert row["auc_after"] == pytest.approx(row["auc_before"], abs=0.02)  # order-preserving per position
    assert report[0]["auc_after"] == pytest.approx(report[0]["auc_before"])  # position 1: exactly monotone


def test_rounds_statistics():
    accepted = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    rounds = Rounds(torch.zeros(4, 3), accepted)
    assert rounds.tau == pytest.approx(1 + (2 + 1 + 0 + 3) / 4)
    assert rounds.acceptance_per_position == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert torch.allclose(rounds.survival()[0], torch.tensor([0.5, 0.25, 0.125]))
    with pytest.raises(ValueError, match="no confidences"):
        Rounds(None, accepted).survival()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"), draft_steps=40)


def _load(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = pair
    return (AutoModelForCausalLM.from_pretrained(target_dir).eval(), AutoTokenizer.from_pretrained(target_dir),
            load_draft(draft_dir))


@pytest.mark.parametrize("prompt", ["class Point:\n    def", "for i in", "x = 3\ny ="])
def test_greedy_rounds_match_the_engine(pair, prompt):
    """At the anchors the engine visits, the simulated rounds accept exactly what the engine did
    (these prompts give rounds of 1, 2 and 5 tokens)."""
    target, tokenizer, draft = _load(pair)
    prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    result = SpeculativeDecoder.from_models(target, draft).generate(prompt, max_new_tokens=60, eos_token_id=[])
    sequence = torch.tensor([prompt + result.token_ids])
    assert torch.equal(greedy_continuation(target, sequence[:, :len(prompt)], 60), sequence)
    context, final = target_states(target, sequence, draft.config.capture_layer_ids)
    truth = target.get_output_embeddings()(final).argmax(-1)
    anchors, engine, position, p = [], [], len(prompt), draft.config.num_draft_tokens
    for n, verified in zip(result.stats.accept_lengths, result.stats.scheduled_lengths):
        if verified == p and position + p <= sequence.shape[1]:  # the last rounds verify only what fits
            anchors.append(position)
            engine.append(n)
        position += n
    rounds = _rounds_at(draft, sequence, context, truth, torch.tensor([anchors]))
    simulated = (1 + rounds.accepted.sum(1)).tolist()
    assert len(simulated) >= 8 and simulated == engine


def test_collect_rounds_shapes(pair):
    target, tokenizer, draft = _load(pair)
    prompts = torch.tensor([tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]] * 3)
    rounds = collect_rounds(target, draft, prompts, new_tokens=20, batch_size=2, anchor_chunk=5)
    p = draft.config.num_draft_tokens
    assert rounds.accepted.shape == (3 * (20 - p + 1), p) and rounds.confidence_logits.shape == rounds.accepted.shape
    with pytest.raises(ValueError, match="collect_rounds: new_tokens"):
        collect_rounds(target, draft, prompts, new_tokens=p)


def test_saved_temperatures_reach_the_engine(tmp_path):
    target_dir, draft_dir = tiny_pair(tmp_path, target_steps=1, draft_steps=1)
    file = save_calibration(draft_dir, [0.5, 1.0, 2.0, 4.0], [{"position": 1}])
    assert file.name == CALIBRATION_FILE
    assert json.loads(file.read_text())["sts_temperatures"] == [0.5, 1.0, 2.0, 4.0]
    assert load_calibration(draft_dir) == [0.5, 1.0, 2.0, 4.0]
    draft = load_draft(draft_dir)
    assert draft.config.sts_temperatures == [0.5, 1.0, 2.0, 4.0]
    assert Drafter(draft, scheduler="threshold").sts_temperatures.tolist() == [0.5, 1.0, 2.0, 4.0]
    sglang = tmp_path / "sglang.json"
    sglang.write_text('{"temperatures": [1.5]}')
    assert load_calibration(sglang) == [1.5]
    with pytest.raises(ValueError, match="save_calibration: temperatures"):
        save_calibration(draft_dir, [0.0])
    with pytest.raises(ValueError, match="no config.json"):
        save_calibration(tmp_path, [1.0])


def test_calibrate_command(pair, tmp_path, capsys):
    target_dir, draft_dir = pair
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    corpus = tmp_path / "held_out.py"
    corpus.write_text("def norm(self):\n    return self.x + self.y\n" * 20)
    args = parser.parse_args(["--target", str(target_dir), "--draft", str(draft_dir), "--data", str(corpus),
                              "--num-prompts", "6", "--prompt-tokens", "8", "--new-tokens", "16", "--device", "cpu",
                              "--json", str(tmp_path / "report.json")])
    assert calibrate_cli.run(args) == 0
    out = capsys.readouterr()
    assert "ECE before" in out.out and "mean ECE" in out.out
    assert "dspark calibrate [####################] 100% batch 2/2" in out.err  # 3 + 3 prompts, batches of 16
    temperatures = load_draft(draft_dir).config.sts_temperatures
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sts_temperatures"] == temperatures and len(temperatures) == 4
    assert all(math.isfinite(r["ece_after"]) for r in report["report"])
    args.num_prompts = 1
    assert calibrate_cli.run(args) == 2
    assert "--num-prompts must be >= 2" in capsys.readouterr().err
