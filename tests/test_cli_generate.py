"""``dspark generate`` end to end on the CPU with tiny checkpoints in both draft formats, every bad
input a one-line error (exit status 2, no traceback), and the ``dspark`` command itself."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_cases import tiny_qwen3_target, write_tiny_checkpoints, write_tiny_draft
from test_engine import _greedy

import dspark
from dspark.cli import main

PROMPT = [3, 17, 42, 8]
SRC = str(Path(dspark.__file__).parent.parent)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(root holding target / bare / speculators / deepspec, {format: draft directory}, target)."""
    root = tmp_path_factory.mktemp("checkpoints")
    target, drafts = write_tiny_checkpoints(root)
    return root, drafts, target


@pytest.fixture(scope="module")
def greedy(checkpoints):
    return _greedy(checkpoints[2], PROMPT, 24)


def _words(ids):
    return " ".join(f"t{i}" for i in ids)


def _run(capsys, *args):
    """``dspark generate ARGS`` (on the CPU unless ``--device`` is given): (status, stdout, stderr)."""
    status = main(["generate", *args, *([] if "--device" in args else ["--device", "cpu"])])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return status, out.out, out.err


def _pair(checkpoints, fmt="speculators", target="target"):
    root, drafts, _ = checkpoints
    return "--target", str(root / target), "--draft", drafts[fmt]


@pytest.mark.parametrize("fmt, scheduler", [("speculators", "off"), ("deepspec", "sps")])
def test_generate_json_compare_is_identical_to_plain_greedy(checkpoints, greedy, capsys, fmt, scheduler):
    threshold = ["--threshold", "0.1"] if scheduler != "off" else []
    status, out, _ = _run(capsys, *_pair(checkpoints, fmt), "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--max-new-tokens", "12", "--scheduler", scheduler, *threshold, "--compare", "--compare-runs",
                          "3", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["prompt_ids"] == PROMPT and report["generated_ids"] == greedy[:12]
    assert report["identical"] is True and report["baseline"]["generated_ids"] == report["generated_ids"]
    assert report["text"] == " " + _words(greedy[:12])  # decoded after the prompt: spaced as it continues it
    assert report["finish_reason"] == "length"
    stats = report["stats"]
    assert stats["generated_tokens"] == 12 and stats["rounds"] == len(stats["accept_lengths"]) >= 1
    rates = stats["tokens_per_second"] / report["baseline"]["stats"]["tokens_per_second"]
    # the median run's statistics: a ratio of rates, not of times, the middle of the three runs' range
    assert report["speedup"] == pytest.approx(rates, rel=0.02) and report["compare_runs"] == 3
    low, high = report["speedup_range"]
    assert low <= report["speedup"] <= high


def test_compare_warms_up_then_times_several_runs_of_each_side(checkpoints, capsys, monkeypatch):
    """``--compare``: the printed speculative run, one untimed plain run, then ``--compare-runs``
    (default 5) timed runs of each side, alternating; the printed speedup is their median, with the
    range; a bad ``--compare-runs`` is a one-line error."""
    from dspark.cli import generate
    from dspark.engine import LLMEngine

    sides, real = [], LLMEngine.generate_requests

    def counted(engine, requests, **kwargs):
        sides.append("plain" if engine.runner.drafter is None else "draft")
        return real(engine, requests, **kwargs)

    monkeypatch.setattr(LLMEngine, "generate_requests", counted)
    args = [*_pair(checkpoints), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--compare"]
    status, out, _ = _run(capsys, *args, "--compare-runs", "2")
    assert status == 0 and sides == ["draft", "plain"] * 3
    line = next(line for line in out.splitlines() if line.startswith("plain target decoding"))
    assert re.fullmatch(r"plain target decoding: [\d.]+ tokens/s, speedup [\d.]+x \(median of 2; "
                        r"range [\d.]+-[\d.]+\), ratio of tokens/s, outputs identical", line), line
    monkeypatch.setattr(generate, "COMPARE_RUNS", 1)  # the default (5 on the README's command; 1 here: quick)
    sides.clear()
    assert _run(capsys, *args)[0] == 0 and sides == ["draft", "plain"] * 2
    for extra, message in ((["--compare-runs", "0"], "--compare-runs must be >= 1 and goes with --compare, got 0"),
                           (["--compare-runs", "3"], "got 3 without --compare")):
        status, _, err = _run(capsys, *(args[:-1] if extra[1] == "3" else args), *extra)
        assert status == 2 and message in err


def test_generate_prints_the_prompt_then_streams_text_and_statistics(checkpoints, greedy, capsys):
    status, out, _ = _run(capsys, *_pair(checkpoints, "deepspec"), "--prompt", _words(PROMPT), "--max-new-tokens", "10",
                          "--scheduler", "threshold", "--threshold", "0.3", "--compare", "--compare-runs", "1")
    assert status == 0
    assert out.startswith(_words(PROMPT + greedy[:10]) + "\n")
    assert "tau = " in out and "acceptance per position" in out and "tokens/s" in out
    assert "outputs identical" in out and "range" in out and ", ratio of tokens/s" in out


def test_sampled_generation_is_reproducible_per_seed(checkpoints, capsys):
    args = [*_pair(checkpoints, target="bare"), "--prompt-ids", "5,6,7", "--max-new-tokens", "9", "--temperature", "0.8",
            "--top-k", "30", "--top-p", "0.95", "--json"]
    first = json.loads(_run(capsys, *args, "--seed", "11")[1])
    again = json.loads(_run(capsys, *args, "--seed", "11")[1])
    assert first["generated_ids"] == again["generated_ids"] and len(first["generated_ids"]) == 9
    assert first["text"] is None and "identical" not in first
    status, out, _ = _run(capsys, *args[:-1], "--seed", "11")  # streaming ids without a tokenizer
    assert status == 0 and out.split("\n")[0].split() == ["[5", "6", "7]"] + [str(t) for t in first["generated_ids"]]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "t1 t2"], "--prompt: a text prompt needs the target's tokenizer, but"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,500"], "prompt_ids holds token id 500"),
    (["--prompt-ids", "1", "--threshold", "0.5"], "--threshold 0.5 does nothing with --scheduler off"),
    (["--prompt-ids", "1", "--scheduler", "sps", "--threshold", "2"], "--threshold must be in [0, 1]"),
    (["--prompt-ids", "1", "--device", "bogus"], "--device: 'bogus' is not a device: use cpu, cuda or cuda:N"),
    (["--prompt-ids", "1", "--max-new-tokens", "-1"], "max_new_tokens must be in [0, inf], got -1"),
    (["--prompt-ids", "1", "--stop", "x"], "--stop needs the target's tokenizer"),
    (["--prompt-ids", "1,2,3,4,5", "--max-model-len", "5"],
     "the prompt has 5 tokens; the context limit (max_model_len) is 5, which must leave room for at least one new"),
    (["--prompt-ids", "1", "--max-model-len", "5000"], "max_model_len 5000 exceeds the target's max_position_embeddings 1024"),
    (["--prompt-ids", "1", "--logit-bias", "5"], "--logit-bias takes ID=BIAS (a token id and a number), got '5'"),
    (["--prompt-ids", "1", "--logit-bias", "5=200"], "logit_bias[5] must be in [-100.0, 100.0], got 200.0"),
    (["--prompt-ids", "1", "--logit-bias", "500=1"], "logit_bias holds token id 500, outside the target's vocabulary"),
    (["--prompt-ids", "1", "--min-p", "1.5"], "min_p must be in [0.0, 1.0], got 1.5"),
    (["--prompt-ids", "1", "--presence-penalty", "3"], "presence_penalty must be in [-2.0, 2.0], got 3.0"),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], "repetition_penalty must be > 0, got 0.0"),
    (["--prompt-ids", "1", "--max-new-tokens", "8", "--min-tokens", "9"],
     "min_tokens must be at most max_new_tokens (8), got 9"),
    (["--prompt-ids", "1", "--bad-words", "t5"], "--bad-words: bad_words are text and need the target's tokenizer"),
])
def test_bad_options_are_one_line_errors(checkpoints, capsys, args, message):
    status, out, err = _run(capsys, *_pair(checkpoints, target="bare"), *args)
    errors = [line for line in err.splitlines() if line.startswith("dspark generate:")]
    assert status == 2 and len(errors) == 1 and message in errors[0] and out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda(checkpoints, capsys):
    status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-ids", "1", "--device", "cuda")
    assert status == 2 and "--device: 'cuda' asked for, but CUDA is not available on this machine" in err


def test_greedy_with_sampling_filters_warns(checkpoints, capsys):
    status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-ids", "1", "--max-new-tokens", "2", "--top-k", "5")
    assert status == 0 and "warning: --top-k / --top-p / --min-p do nothing with greedy decoding" in err


def test_logit_bias_and_min_p_reach_the_request(checkpoints, greedy, capsys, tmp_path):
    """``--logit-bias ID=BIAS``: greedy decoding is transformers' with the same bias (a banned
    token gone); ``--min-p`` and a .jsonl line's ``logit_bias`` / ``min_p`` reach the request too."""
    from transformers.generation.logits_process import LogitsProcessorList, SequenceBiasLogitsProcessor

    banned = greedy[2]
    bias = LogitsProcessorList([SequenceBiasLogitsProcessor({(banned,): -100.0})])
    with torch.no_grad():
        expected = checkpoints[2].generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                           eos_token_id=None, pad_token_id=0, logits_processor=bias)[0, len(PROMPT):]
    args = [*_pair(checkpoints), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--json"]
    status, out, _ = _run(capsys, *args, "--logit-bias", f"{banned}=-100")
    assert status == 0 and json.loads(out)["generated_ids"] == expected.tolist() != greedy[:8]
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt_ids": PROMPT, "logit_bias": {str(banned): -100}}) + "\n")
    status, out, _ = _run(capsys, *_pair(checkpoints), "--prompt-file", str(requests), "--max-new-tokens", "8",
                          "--json")
    assert status == 0 and json.loads(out)["generated_ids"] == expected.tolist()
    sampled = [*args, "--temperature", "1.0", "--seed", "3"]
    runs = [json.loads(_run(capsys, *sampled, "--min-p", str(m))[1])["generated_ids"] for m in (0.0, 0.0, 0.9)]
    assert runs[0] == runs[1] != runs[2]


def test_penalties_and_bad_words_reach_the_request(checkpoints, greedy, capsys, tmp_path):
    """``--presence-penalty`` / ``--frequency-penalty`` / ``--repetition-penalty`` / ``--bad-words`` and a
    .jsonl line's keys: greedy decoding is transformers' with the same processors; ``--min-tokens``
    keeps a ``--stop`` string from ending the first tokens."""
    from test_penalties import transformers_greedy

    from dspark.engine import SamplingParams

    sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5,
                              bad_words=((greedy[3],),))
    expected = transformers_greedy(checkpoints[2], PROMPT, sampling, new_tokens=8)
    args = [*_pair(checkpoints), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--json"]
    status, out, _ = _run(capsys, *args, "--presence-penalty", "1", "--frequency-penalty", "0.5",
                          "--repetition-penalty", "1.5", "--bad-words", f"t{greedy[3]}")
    assert status == 0 and json.loads(out)["generated_ids"] == expected != greedy[:8]
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt_ids": PROMPT, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                    "repetition_penalty": 1.5, "bad_words": [f"t{greedy[3]}"]}) + "\n")
    status, out, _ = _run(capsys, *_pair(checkpoints), "--prompt-file", str(requests), "--max-new-tokens", "8",
                          "--json")
    assert status == 0 and json.loads(out)["generated_ids"] == expected
    status, out, _ = _run(capsys, *args, "--stop", f"t{greedy[1]}", "--min-tokens", "4")
    assert status == 0 and json.loads(out)["generated_ids"][:4] == greedy[:4]


def test_broken_target_checkpoints_are_named(checkpoints, capsys, tmp_path):
    """A missing path, a file, a truncated file, a missing tensor, a pickle-only target."""
    from safetensors.torch import load_file, save_file

    root, drafts, _ = checkpoints
    draft = ["--draft", drafts["speculators"], "--prompt-ids", "1", "--max-new-tokens", "2"]
    status, _, err = _run(capsys, "--target", str(tmp_path / "nowhere"), *draft)
    assert status == 2 and "target directory" in err and "nowhere' does not exist" in err
    status, _, err = _run(capsys, "--target", str(root / "target" / "config.json"), *draft)
    assert status == 2 and "is a file; give its checkpoint directory" in err

    broken = shutil.copytree(root / "target", tmp_path / "broken")
    weights = broken / "model.safetensors"
    tensors = load_file(str(weights))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    status, _, err = _run(capsys, "--target", str(broken), *draft)
    assert status == 2 and "model.safetensors' is truncated" in err

    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    status, _, err = _run(capsys, "--target", str(broken), *draft)
    assert status == 2 and "has no tensor 'model.layers.2.self_attn.q_proj.weight'" in err

    weights.unlink()
    torch.save(load_file(str(root / "target" / "model.safetensors")), broken / "pytorch_model.bin")
    status, _, err = _run(capsys, "--target", str(broken), *draft)
    assert status == 2 and "refusing to unpickle ['pytorch_model.bin']" in err and "--allow-pickle" in err
    status, out, _ = _run(capsys, "--target", str(broken), *draft, "--allow-pickle", "--json")
    assert status == 0 and len(json.loads(out)["generated_ids"]) == 2

    draft_copy = shutil.copytree(drafts["speculators"], tmp_path / "draft")
    (draft_copy / "model.safetensors").write_bytes((draft_copy / "model.safetensors").read_bytes()[:-64])
    status, _, err = _run(capsys, "--target", str(root / "target"), "--draft", str(draft_copy), "--prompt-ids", "1")
    assert status == 2 and "load_draft:" in err and "is truncated" in err


def test_context_limit_ends_the_output(checkpoints, greedy, capsys):
    status, out, _ = _run(capsys, *_pair(checkpoints), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                          "20", "--max-model-len", "10", "--json")
    report = json.loads(out)
    assert status == 0 and report["generated_ids"] == greedy[:6] and report["finish_reason"] == "length"


def test_prompt_file_text_stdin_and_jsonl(checkpoints, greedy, capsys, monkeypatch, tmp_path):
    pair = _pair(checkpoints)
    text = tmp_path / "prompt.txt"
    text.write_text(_words(PROMPT))
    status, out, _ = _run(capsys, *pair, "--prompt-file", str(text), "--max-new-tokens", "5", "--json")
    assert status == 0 and json.loads(out)["generated_ids"] == greedy[:5]

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_words(PROMPT).encode())))
    status, out, _ = _run(capsys, *pair, "--prompt-file", "-", "--max-new-tokens", "4")
    assert status == 0 and out.startswith(_words(PROMPT + greedy[:4]) + "\n")

    requests = tmp_path / "requests.jsonl"
    lines = [{"prompt": _words(PROMPT)}, {"prompt_ids": PROMPT[:2], "max_new_tokens": 3}, {},
             {"prompt_ids": PROMPT, "temperature": 0.9, "top_k": 20, "seed": 4}]
    requests.write_text("\n".join("" if not r else json.dumps(r) for r in lines) + "\n")
    status, out, _ = _run(capsys, *pair, "--prompt-file", str(requests), "--max-new-tokens", "6", "--json")
    reports = [json.loads(line) for line in out.splitlines()]
    assert status == 0 and len(reports) == 3  # the blank line is skipped; one object per request, in order
    assert reports[0]["generated_ids"] == greedy[:6] and reports[0]["prompt_ids"] == PROMPT
    assert reports[1]["generated_ids"] == _greedy(checkpoints[2], PROMPT[:2], 3)
    assert len(reports[2]["generated_ids"]) == 6 and "identical" not in reports[2]
    status, out, _ = _run(capsys, *pair, "--prompt-file", str(requests), "--max-new-tokens", "6")
    assert status == 0 and out.count("--- request ") == 3 and "finish reason length" in out


@pytest.mark.parametrize("content, message", [
    (b'{"prompt_ids": [1]}\n{"prompt_ids": [1]\n', "requests.jsonl:2 is not valid JSON"),
    (b'{"prompt_ids": [1], "temprature": 1}\n', "requests.jsonl:1: unknown key(s) ['temprature']"),
    (b'{"prompt": "t1", "prompt_ids": [1]}\n', "requests.jsonl:1: a request needs exactly one of 'prompt'"),
    (b'\n{"prompt_ids": [1], "top_k": "5"}\n', "requests.jsonl:2: 'top_k' must be an integer, got '5'"),
    (b'{"prompt_ids": [1]}\n{"prompt_ids": [1], "top_p": 2.0}\n', "requests.jsonl:2: SamplingParams: top_p must be in"),
    (b'{"prompt_ids": [1], "logit_bias": {"a": 1}}\n', "requests.jsonl:1: 'logit_bias' must be an object of token ids"),
    (b'{"prompt_ids": [1], "min_p": "0.1"}\n', "requests.jsonl:1: 'min_p' must be a number, got '0.1'"),
    (b'{"prompt_ids": [1], "min_tokens": 1.5}\n', "requests.jsonl:1: 'min_tokens' must be an integer, got 1.5"),
    (b'{"prompt_ids": [1], "bad_words": "t5"}\n', "requests.jsonl:1: bad_words must be a list of strings, got 't5'"),
    (b'{"prompt_ids": [1]}\n\n{"prompt": "t1 \xff"}\n', "requests.jsonl:3 is not UTF-8 text (byte 0xff)"),
    (b'{"prompt_ids": [1, 99]}\n', "requests.jsonl:1: add_request: prompt_ids holds token id 99"),
    (b'["t1"]\n', "requests.jsonl:1: a request must be a JSON object, got list"),
    (b"\n\n", "requests.jsonl holds no request"),
])
def test_bad_prompt_file_lines_name_the_file_and_line(checkpoints, capsys, tmp_path, content, message):
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(content)
    status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-file", str(requests))
    assert status == 2 and message in err


def test_missing_or_undecodable_prompt_files(checkpoints, capsys, tmp_path):
    status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-file", str(tmp_path / "missing.txt"))
    assert status == 2 and "--prompt-file" in err and "missing.txt not found" in err
    (tmp_path / "latin1.txt").write_bytes(b"t1\nt2 caf\xe9\n")
    status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-file", str(tmp_path / "latin1.txt"))
    assert status == 2 and "latin1.txt:2 is not UTF-8 text" in err
    (tmp_path / "text.txt").write_text("t1 t2")
    status, _, err = _run(capsys, *_pair(checkpoints, target="bare"), "--prompt-file", str(tmp_path / "text.txt"))
    assert status == 2 and "text.txt: a text prompt needs the target's tokenizer" in err


def test_stop_strings_and_ignore_eos(checkpoints, greedy, capsys, tmp_path):
    from transformers import GenerationConfig

    root, drafts, _ = checkpoints
    stop = f"t{greedy[5]} t"
    continuation = " " + _words(greedy)
    shortest = next(k for k in range(1, len(greedy) + 1) if stop in " " + _words(greedy[:k]))
    status, out, _ = _run(capsys, *_pair(checkpoints), "--prompt-ids", ",".join(map(str, PROMPT)), "--stop", stop,
                          "--stop", "never", "--max-new-tokens", "20", "--compare", "--compare-runs", "1", "--json")
    report = json.loads(out)
    assert status == 0 and report["finish_reason"] == "stop" and report["identical"]
    assert report["text"] == continuation[:continuation.find(stop)] and report["generated_ids"] == greedy[:shortest]

    k = next(i for i in range(2, 20) if greedy[i] not in greedy[:i])
    with_eos = shutil.copytree(root / "target", tmp_path / "eos")
    GenerationConfig(eos_token_id=greedy[k]).save_pretrained(with_eos)
    args = ["--target", str(with_eos), "--draft", drafts["speculators"], "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "20", "--json"]
    report = json.loads(_run(capsys, *args)[1])
    assert report["generated_ids"] == greedy[:k + 1] and report["finish_reason"] == "stop"
    report = json.loads(_run(capsys, *args, "--ignore-eos")[1])
    assert report["generated_ids"] == greedy[:20] and report["finish_reason"] == "length"


def test_zero_drafting_rounds_print_no_tau_or_speedup(checkpoints, capsys):
    args = [*_pair(checkpoints), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--compare", "--compare-runs", "1"]
    report = json.loads(_run(capsys, *args, "--json")[1])
    assert report["stats"]["rounds"] == 0 and report["stats"]["mean_accepted_length"] is None
    assert report["speedup"] is None
    status, out, _ = _run(capsys, *args)
    assert status == 0 and "no drafting round, so no tau" in out and "speedup -" in out and "tau =" not in out


def test_quiet_silences_the_loading_bars(checkpoints, capsys):
    from transformers.utils import logging

    args = [*_pair(checkpoints), "--prompt-ids", "1", "--max-new-tokens", "2"]
    try:
        assert _run(capsys, *args, "--quiet")[0] == 0
        assert not logging.is_progress_bar_enabled() and logging.get_verbosity() == logging.ERROR
    finally:
        logging.enable_progress_bar()
        logging.set_verbosity_warning()


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
    assert status == 2 and "--target needs --draft" in err and "or --no-draft for plain decoding" in err
    status, _, err = _run(capsys, "--draft", drafts["speculators"], "--prompt-ids", "1")
    assert status == 2 and "--draft needs --target" in err
    status, _, err = _run(capsys, "--target", str(root / "target"), "--draft", drafts["speculators"])
    assert status == 2 and "give a prompt" in err


def test_a_draft_alone_runs_with_the_verifier_its_config_names(capsys, tmp_path):
    """``--draft D`` without ``--target``: a copy of the demo draft whose config names the demo
    target's directory runs as the pair given in full; one naming a missing model is a one-line
    error naming the draft, the verifier and where it looked."""
    from dspark.training.data import demo_pair

    pair = demo_pair()
    draft = shutil.copytree(pair.draft, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    args = ("--prompt-ids", "5,6,7,8", "--max-new-tokens", "8", "--json")
    for verifier in (str(pair.target), "no-such/model"):
        config["speculators_config"]["verifier"]["name_or_path"] = verifier
        (draft / "config.json").write_text(json.dumps(config))
        status, out, err = _run(capsys, "--draft", str(draft), *args)
        if verifier == str(pair.target):
            _, expected, _ = _run(capsys, "--target", str(pair.target), "--draft", str(pair.draft), *args)
            assert status == 0 and json.loads(out)["generated_ids"] == json.loads(expected)["generated_ids"]
            assert _run(capsys, "--draft", str(draft))[2].endswith("give a prompt: --prompt TEXT, --prompt-ids "
                                                                   "1,2,3 or --prompt-file FILE\n")  # not the demo's
        else:
            assert status == 2 and err.count("\n") == 1
            assert f"--draft {draft} names its verifier 'no-such/model'" in err
            assert f"looked in {draft / 'no-such/model'}" in err and "nor a Hugging Face Hub model in the local cache" in err


def test_readme_main_command_runs_the_shipped_pair(capsys):
    """``dspark generate --compare`` with no checkpoints: the shipped demo pair, its default held-out
    prompt, lossless against plain decoding (float32 on the CPU)."""
    from transformers import AutoTokenizer

    from dspark.cli.generate import DEMO_PROMPT_FILE
    from dspark.training import data

    pair = data.demo_pair()
    record = next(r for r in data.read_prompts(str(pair.prompts)) if r["file"] == DEMO_PROMPT_FILE)
    status, out, _ = _run(capsys, "--compare", "--compare-runs", "1", "--max-new-tokens", "24", "--json")
    report = json.loads(out)
    assert status == 0 and report["identical"] and len(report["generated_ids"]) == 24
    assert report["prompt_ids"] == AutoTokenizer.from_pretrained(pair.target).encode(record["text"])
    assert report["stats"]["mean_accepted_length"] > 1.5  # the drafts are accepted beyond the bonus token


def test_mismatch_status_is_an_error_only_in_full_precision(capsys):
    from dspark.cli._runtime import mismatch_status

    assert mismatch_status(torch.float32, "d", "eval") == 1
    assert "differ from plain decoding for d" in capsys.readouterr().err
    assert mismatch_status(torch.bfloat16, "d", "eval") == 0
    assert "--dtype float32" in capsys.readouterr().err


def test_version_help_and_bench_passthrough(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dspark {dspark.__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "(default: 128)" in help_text and "(default: off)" in help_text and "--prompt-file FILE" in help_text
    import dspark.bench.__main__ as bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "--out", "x.json", "--family", "greedy", "--quick"]) == 0
    assert seen == [["--out", "x.json", "--family", "greedy", "--quick"]]
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--target", "t", "--draft", "d", "--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def _env():
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_python_m_dspark_version():
    done = subprocess.run([sys.executable, "-m", "dspark", "--version"], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"dspark {dspark.__version__}"


def test_ctrl_c_prints_partial_statistics_and_exits_130(tmp_path):
    """SIGINT mid-generation (a long context, no EOS): the statistics so far, exit status 130, no traceback."""
    target = tiny_qwen3_target(max_position_embeddings=1 << 20)
    target.save_pretrained(tmp_path / "target")
    draft = write_tiny_draft(target, tmp_path / "draft", format="speculators")
    command = [sys.executable, "-m", "dspark", "generate", "--target", str(tmp_path / "target"), "--draft", str(draft),
               "--prompt-ids", "1,2,3", "--max-new-tokens", "1000000", "--ignore-eos", "--device", "cpu", "--quiet"]
    # a shell's background job inherits SIGINT ignored (then Python installs no handler): restore it
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.read(12)  # "[1 2 3] " and the first generated ids: generation is running
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    err = err.decode()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "interrupted; statistics so far" in err and "tokens/s" in err


def test_stop_escapes_are_processed_as_llama_cpp_does(checkpoints, greedy, capsys):
    """``--stop "\\x74N"`` (a shell passes the backslash) is the stop string ``tN``: an escaped
    stop ends the output exactly where the plain one does."""
    ids = ",".join(map(str, PROMPT))
    plain = json.loads(_run(capsys, *_pair(checkpoints), "--prompt-ids", ids, "--stop", f"t{greedy[5]}",
                            "--max-new-tokens", "20", "--json")[1])
    escaped = json.loads(_run(capsys, *_pair(checkpoints), "--prompt-ids", ids, "--stop", f"\\x74{greedy[5]}",
                              "--max-new-tokens", "20", "--json")[1])
    assert plain["finish_reason"] == escaped["finish_reason"] == "stop"
    assert escaped["generated_ids"] == plain["generated_ids"] and escaped["text"] == plain["text"]
    literal = json.loads(_run(capsys, *_pair(checkpoints), "--prompt-ids", ids, "--stop", "\\n",
                              "--max-new-tokens", "6", "--json")[1])
    assert literal["finish_reason"] == "length"  # a newline, which the word tokenizer never produces
    with pytest.raises(SystemExit):
        main(["generate", "--stop", "\\xZZ"])
    assert "argument --stop: \\x must be followed by 2 hex digits, got '\\\\xZZ'" in capsys.readouterr().err


def test_no_draft_decodes_with_the_target_alone(checkpoints, greedy, capsys):
    root = checkpoints[0]
    ids = ",".join(map(str, PROMPT))
    status, out, _ = _run(capsys, "--target", str(root / "target"), "--no-draft", "--prompt-ids", ids,
                          "--max-new-tokens", "10", "--json")
    report = json.loads(out)
    assert status == 0 and report["generated_ids"] == greedy[:10]
    assert report["stats"]["acceptance_per_position"] == [] and report["stats"]["mean_scheduled_length"] == 0  # no drafts
    for extra, message in [(["--compare"], "--compare runs plain decoding beside speculative decoding"),
                           (["--draft", str(root / "speculators")], "--no-draft and --draft exclude each other")]:
        status, _, err = _run(capsys, "--target", str(root / "target"), "--no-draft", "--prompt-ids", ids, *extra)
        assert status == 2 and message in err


def test_cost_scheduler_with_a_cost_table(checkpoints, greedy, capsys, tmp_path):
    """``--scheduler cost --cost-table`` runs on the batched engine (greedy output unchanged); every
    misuse is a one-line error naming the option."""
    from dspark.engine import SPSCostTable

    table = tmp_path / "cost.json"
    SPSCostTable((1, 8, 64), (1.0, 1.2, 3.0)).write_json(table)
    ids = ",".join(map(str, PROMPT))
    status, out, _ = _run(capsys, *_pair(checkpoints), "--prompt-ids", ids, "--max-new-tokens", "12",
                          "--scheduler", "cost", "--cost-table", str(table), "--engine", "batched", "--json")
    assert status == 0 and json.loads(out)["generated_ids"] == greedy[:12]
    for extra, message in [
        (["--scheduler", "cost", "--engine", "batched"], "--scheduler cost needs --cost-table FILE"),
        (["--scheduler", "cost", "--cost-table", str(tmp_path / "none.json"), "--engine", "batched"],
         f"--cost-table {tmp_path / 'none.json'} not found"),
        (["--cost-table", str(table)], f"--cost-table {table} is read only by --scheduler cost, got --scheduler off"),
    ]:
        status, _, err = _run(capsys, *_pair(checkpoints), "--prompt-ids", ids, *extra)
        assert status == 2 and message in err, err


def test_a_bad_config_json_names_the_file_and_line(checkpoints, capsys, tmp_path):
    root, drafts, _ = checkpoints
    draft = shutil.copytree(drafts["speculators"], tmp_path / "draft")
    (draft / "config.json").write_text('{"speculators_model_type": "dspark",\n}\n')
    status, _, err = _run(capsys, "--target", str(root / "target"), "--draft", str(draft), "--prompt-ids", "1")
    assert status == 2 and err.strip() == (f"dspark generate: {str(draft / 'config.json')!r} is not valid JSON: "
                                           f"Expecting property name enclosed in double quotes (line 2, column 1)")
    target = shutil.copytree(root / "target", tmp_path / "target")
    (target / "config.json").write_text("[1, 2]")
    status, _, err = _run(capsys, "--target", str(target), "--draft", drafts["speculators"], "--prompt-ids", "1")
    assert status == 2 and f"{str(target / 'config.json')!r} must hold a JSON object, got list" in err


def test_help_imports_neither_torch_nor_transformers():
    """``dspark --help`` and ``dspark <command> --help`` build their parsers only: the heavy
    packages are imported inside ``run``."""
    code = ("import sys, runpy; sys.argv = ['dspark', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('dspark', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'huggingface_hub') if m in sys.modules)\n"
            "print('HEAVY', heavy)")
    for argv in ([], ["--help"], ["--version"], ["generate", "--help"], ["train", "--help"], ["eval", "--help"],
                 ["calibrate", "--help"], ["profile", "--help"], ["demo", "--help"], ["serve", "--help"]):
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=_env(),
                              timeout=120)
        assert done.stdout.strip().splitlines()[-1] == "HEAVY []", (argv, done.stdout[-300:], done.stderr[-300:])
