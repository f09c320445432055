"""Evaluation: merged statistics, the report against the engine's own statistics, ``dspark eval``,
and the shipped demo pair's τ floor (CPU, held-out prompts)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from test_training import tiny_pair

from dspark.cli import eval as eval_cli
from dspark.engine import GenerationStats, SpeculativeDecoder
from dspark.evaluation import evaluate, format_table, merge_stats
from dspark.model import load_draft
from dspark.training import data


def test_merge_stats():
    a = GenerationStats(num_drafts=3, prompt_tokens=4, prefill_tokens=1, total_time=1.0, draft_time=0.25)
    a.record_round(3, 4, 4)
    a.record_round(3, 1, 1)
    b = GenerationStats(num_drafts=3, prompt_tokens=5, prefill_tokens=1, total_time=2.0, draft_time=0.5)
    b.record_round(3, 2, 2)
    merged = merge_stats([a, b])
    assert merged.accept_lengths == [4, 1, 2] and merged.scheduled_lengths == [3, 3, 3]
    assert merged.generated_tokens == 9 and merged.prompt_tokens == 9
    assert merged.total_time == 3.0 and merged.draft_time == 0.75
    assert merged.mean_accepted_length == pytest.approx(7 / 3)
    assert merged.acceptance_per_position == pytest.approx([2 / 3, 1 / 2, 1.0])
    with pytest.raises(ValueError, match="merge_stats: stats must hold"):
        merge_stats([])
    with pytest.raises(ValueError, match="share num_drafts"):
        merge_stats([a, GenerationStats(num_drafts=2)])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"), draft_steps=40)


def _load(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = pair
    return AutoModelForCausalLM.from_pretrained(target_dir).eval(), AutoTokenizer.from_pretrained(target_dir), \
        load_draft(draft_dir)


def test_report_agrees_with_the_engine(pair):
    target, tokenizer, draft = _load(pair)
    texts = ("class Point:\n    def", "for i in", "x =")
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in texts]
    report = evaluate(target, {"dspark": draft}, prompts, max_new_tokens=40)
    decoder = SpeculativeDecoder.from_models(target, draft)
    engine = merge_stats([decoder.generate(p, max_new_tokens=40).stats for p in prompts])
    row = report["drafts"][0]
    assert row["tau"] == pytest.approx(engine.mean_accepted_length)
    assert row["acceptance_per_position"] == engine.acceptance_per_position
    assert row["rounds"] == engine.rounds and row["tokens"] == engine.generated_tokens == report["plain"]["tokens"]
    assert row["identical"] == 3
    assert row["speedup"] == pytest.approx(row["tokens_per_second"] / report["plain"]["tokens_per_second"])
    assert [r["rounds"] for r in row["per_prompt"]] == [len(s) for s in (decoder.generate(p, max_new_tokens=40).stats.accept_lengths for p in prompts)]
    assert all(r["identical"] for r in row["per_prompt"])
    assert row["tau"] > 1.5  # the trained draft is accepted beyond the bonus token
    table = format_table(report)
    assert "dspark" in table and f"{row['tau']:.2f}" in table and "3/3" in table


def test_sampled_speedup_is_a_ratio_of_rates_and_zero_rounds_have_none(pair):
    from dspark.engine import SamplingParams

    target, tokenizer, draft = _load(pair)
    prompts = [tokenizer("for i in", add_special_tokens=False)["input_ids"]]
    report = evaluate(target, {"d": draft}, prompts, max_new_tokens=12, sampling=SamplingParams(1.0, seed=3))
    row = report["drafts"][0]
    assert row["speedup"] == pytest.approx(row["tokens_per_second"] / report["plain"]["tokens_per_second"])
    assert row["per_prompt"][0]["speedup"] == pytest.approx(row["speedup"])
    report = evaluate(target, {"d": draft}, prompts, max_new_tokens=1)
    row = report["drafts"][0]
    assert row["rounds"] == 0 and row["tau"] is None and row["speedup"] is None
    assert format_table(report).splitlines()[4].split()[1:5] == ["-", "0", f"{row['tokens_per_second']:.1f}", "-"]


def test_evaluate_rejects_bad_input(pair):
    target, _, draft = _load(pair)
    with pytest.raises(ValueError, match="evaluate: drafts"):
        evaluate(target, {}, [[1, 2]])
    with pytest.raises(ValueError, match="evaluate: prompts"):
        evaluate(target, {"d": draft}, [[]])


def test_eval_command(pair, tmp_path, capsys):
    target_dir, draft_dir = pair
    copy = shutil.copytree(draft_dir, tmp_path / "copy")
    prompts = data.write_prompts(tmp_path / "prompts.jsonl", [{"text": "def add(a, b):\n"}, {"turns": ["for i in"]}])
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["--target", str(target_dir), "--draft", str(draft_dir), str(copy),
                              "--prompts", str(prompts), "--max-new-tokens", "16", "--device", "cpu",
                              "--json", str(tmp_path / "eval.json")])
    assert eval_cli.run(args) == 0
    out = capsys.readouterr()
    assert "acceptance per position" in out.out and "dspark eval [" in out.err and "prompt 2/2" in out.err
    args.quiet = True
    assert eval_cli.run(args) == 0
    assert "dspark eval [" not in capsys.readouterr().err
    args.per_prompt = True
    assert eval_cli.run(args) == 0
    assert "prompt 1" in capsys.readouterr().out
    args.per_prompt = False
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["prompts"] == 2 and len(report["drafts"]) == 2
    assert report["drafts"][0]["tau"] == report["drafts"][1]["tau"]  # the same weights twice
    args.draft = [str(draft_dir), str(draft_dir)]
    assert eval_cli.run(args) == 2
    assert "names a directory twice" in capsys.readouterr().err
    args.draft = [str(draft_dir)]
    args.prompts = str(tmp_path / "missing.jsonl")
    assert eval_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "dspark eval: read_prompts: prompt file" in err and "missing.jsonl' not found" in err
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    args.prompts = str(tmp_path / "latin1.jsonl")
    assert eval_cli.run(args) == 2
    assert "latin1.jsonl:2 is not UTF-8 text" in capsys.readouterr().err
    args.prompts, args.num_prompts = str(prompts), -1
    assert eval_cli.run(args) == 2
    assert "--num-prompts must be >= 0 (0 = all), got -1" in capsys.readouterr().err


def test_shipped_demo_pair_keeps_its_acceptance():
    """The shipped pair on CPU, greedy, the configuration ``build_demo_pair.sh`` measured into
    ``eval_ci.json``: τ must stay within 10 % of that measurement and outputs must be lossless. The
    pair ships with the package (``src/dspark/data/demo``): a missing one fails here, not skips."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = data.demo_pair()
    measured = json.loads((pair.prompts.parent / "eval_ci.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    records = data.read_prompts(str(pair.prompts))[: measured["prompts"]]
    prompts = [data.prompt_token_ids(tokenizer, r) for r in records]
    report = evaluate(target, {"demo": load_draft(pair.draft, dtype=torch.float32)}, prompts,
                      max_new_tokens=measured["max_new_tokens"])
    row = report["drafts"][0]
    assert row["identical"] == len(prompts)
    assert row["tau"] >= 0.9 * measured["drafts"][0]["tau"]
