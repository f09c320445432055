"""``dspark generate`` end to end on the CPU with tiny checkpoints in both draft formats."""

import json

import pytest
import torch
from model_cases import tiny_qwen3_target, write_tiny_draft

from dspark.cli import main

PROMPT = [3, 17, 42, 8]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target directory with a word-level tokenizer "t0".."t95", {format: draft directory}, target)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("checkpoints")
    target = tiny_qwen3_target()
    target.save_pretrained(root / "target")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(target.config.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(root / "target")
    target.save_pretrained(root / "bare")  # no tokenizer
    drafts = {fmt: str(write_tiny_draft(target, root / fmt, format=fmt)) for fmt in ("speculators", "deepspec")}
    return root, drafts, target


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _run(capsys, *args):
    status = main(["generate", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("fmt, scheduler", [("speculators", "off"), ("deepspec", "sps")])
def test_generate_json_compare_is_identical_to_plain_greedy(checkpoints, capsys, fmt, scheduler):
    root, drafts, target = checkpoints
    status, out, _ = _run(capsys, "--target", str(root / "target"), "--draft", drafts[fmt], "--prompt-ids",
                          ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--scheduler", scheduler,
                          "--threshold", "0.1", "--compare", "--json", "--device", "cpu")
    assert status == 0
    report = json.loads(out)
    assert report["prompt_ids"] == PROMPT
    assert report["generated_ids"] == _greedy(target, PROMPT, 12)
    assert report["identical"] is True and report["baseline"]["generated_ids"] == report["generated_ids"]
    assert report["text"] == " ".join(f"t{i}" for i in report["generated_ids"])
    stats = report["stats"]
    assert stats["generated_tokens"] == 12 and stats["rounds"] == len(stats["accept_lengths"]) >= 1
    assert report["speedup"] > 0


def test_generate_streams_text_and_prints_statistics(checkpoints, capsys):
    root, drafts, target = checkpoints
    prompt = " ".join(f"t{i}" for i in PROMPT)
    status, out, _ = _run(capsys, "--target", str(root / "target"), "--draft", drafts["deepspec"], "--prompt", prompt,
                          "--max-new-tokens", "10", "--scheduler", "threshold", "--threshold", "0.3", "--compare")
    assert status == 0
    text = " ".join(f"t{i}" for i in _greedy(target, PROMPT, 10))
    assert out.startswith(text + "\n")
    assert "tau = " in out and "acceptance per position" in out and "tokens/s" in out
    assert "outputs identical" in out


def test_sampled_generation_is_reproducible_per_seed(checkpoints, capsys):
    root, drafts, _ = checkpoints
    args = ["--target", str(root / "bare"), "--draft", drafts["speculators"], "--prompt-ids", "5,6,7",
            "--max-new-tokens", "9", "--temperature", "0.8", "--top-k", "30", "--top-p", "0.95", "--json"]
    first = json.loads(_run(capsys, *args, "--seed", "11")[1])
    again = json.loads(_run(capsys, *args, "--seed", "11")[1])
    assert first["generated_ids"] == again["generated_ids"] and len(first["generated_ids"]) == 9
    assert first["text"] is None and "identical" not in first
    status, out, _ = _run(capsys, *args[:-1], "--seed", "11")  # streaming ids without a tokenizer
    assert status == 0 and out.split("\n")[0].split() == [str(t) for t in first["generated_ids"]]


def test_generate_reports_bad_input(checkpoints, capsys):
    root, drafts, _ = checkpoints
    status, _, err = _run(capsys, "--target", str(root / "bare"), "--draft", drafts["speculators"], "--prompt", "t1 t2")
    assert status == 2 and "--prompt needs a tokenizer" in err
    status, _, err = _run(capsys, "--target", str(root / "bare"), "--draft", drafts["speculators"], "--prompt-ids", "1,x")
    assert status == 2 and "--prompt-ids must be comma-separated integers" in err
    status, _, err = _run(capsys, "--target", str(root / "bare"), "--draft", drafts["speculators"], "--prompt-ids", "1,500")
    assert status == 2 and "prompt_ids holds token id 500" in err
    status, _, err = _run(capsys, "--target", str(root / "bare"), "--draft", str(root / "nowhere"), "--prompt-ids", "1")
    assert status == 2 and "dspark generate:" in err


def test_no_checkpoint_arguments_use_the_demo_pair(checkpoints, capsys, monkeypatch, tmp_path):
    from dspark.training import data

    root, drafts, _ = checkpoints
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"file": "x.py", "text": "t1 t2 t3"}) + "\n")
    pair = data.DemoPair(root / "target", drafts["speculators"], tmp_path / "prompts.jsonl")
    monkeypatch.setattr(data, "demo_pair", lambda: pair)
    status, out, _ = _run(capsys, "--max-new-tokens", "6", "--json")
    report = json.loads(out)
    assert status == 0 and report["prompt_ids"] == [1, 2, 3] and len(report["generated_ids"]) == 6


def test_missing_demo_pair_or_half_a_pair_is_a_clear_error(checkpoints, capsys, monkeypatch, tmp_path):
    from dspark.training import data

    root, drafts, _ = checkpoints
    real_demo_pair = data.demo_pair
    monkeypatch.setattr(data, "demo_pair", lambda: real_demo_pair(tmp_path / "empty"))
    status, _, err = _run(capsys, "--prompt-ids", "1")
    assert status == 2 and "demo pair" in err and "build_demo_pair.sh" in err
    status, _, err = _run(capsys, "--target", str(root / "target"), "--prompt-ids", "1")
    assert status == 2 and "--target and --draft must be given together" in err
    status, _, err = _run(capsys, "--target", str(root / "target"), "--draft", drafts["speculators"])
    assert status == 2 and "give a prompt" in err


def test_mismatch_status_is_an_error_only_in_full_precision(capsys):
    from dspark.cli._runtime import mismatch_status

    assert mismatch_status(torch.float32, "d", "eval") == 1
    assert "differ from plain decoding for d" in capsys.readouterr().err
    assert mismatch_status(torch.bfloat16, "d", "eval") == 0
    assert "--dtype float32" in capsys.readouterr().err


def test_readme_main_command_runs_the_shipped_pair(capsys):
    """``dspark generate --compare`` with no checkpoints: the shipped demo pair, its default held-out
    prompt, lossless against plain decoding (float32 on the CPU)."""
    from transformers import AutoTokenizer

    from dspark.cli.generate import DEMO_PROMPT_FILE
    from dspark.training import data

    pair = data.demo_pair()
    record = next(r for r in data.read_prompts(str(pair.prompts)) if r["file"] == DEMO_PROMPT_FILE)
    status, out, _ = _run(capsys, "--compare", "--max-new-tokens", "24", "--device", "cpu", "--json")
    report = json.loads(out)
    assert status == 0 and report["identical"] and len(report["generated_ids"]) == 24
    assert report["prompt_ids"] == AutoTokenizer.from_pretrained(pair.target).encode(record["text"])
    assert report["stats"]["mean_accepted_length"] > 1.5  # the drafts are accepted beyond the bonus token
