"""Acceptance replay (``dspark.bench.replay``): the frontier benchmark's drafter replays recorded
rounds exactly, the target's output stays its own greedy output, and the recorded traces are sound."""

from __future__ import annotations

import pytest
import torch

import dspark.kernels as K
from dspark.bench.engine import random_drafter
from dspark.bench.oracle import OracleEngine
from dspark.bench.replay import ReplayEngine, load_traces, peaked_target
from dspark.bench.serve import random_prompts
from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams
from dspark.engine.rows import LogitsPath

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False, capture=[0, 1])
VOCAB, NEW = 512, 40
P = 7
TRACES = [
    [[7] + [0.95] * 7, [0, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1], [3, 0.9, 0.8, 0.7, 0.2, 0.2, 0.1, 0.1]],
    [[2, 0.6, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1], [5] + [0.8] * 7],
    [[1, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.01]],
]


@pytest.fixture(scope="module")
def models():
    target = peaked_target(TINY, vocab=VOCAB, device="cpu", dtype=torch.float32)
    return target, random_drafter(target, TINY, rank=16)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 12, VOCAB)


def _plain(target, prompts):
    engine = LLMEngine(target, None, EngineConfig(max_batch=4, max_model_len=128))
    return [r.token_ids for r in engine.generate([Request(p, NEW, ignore_eos=True) for p in prompts])]


def _replay(models, prompts, **config):
    target, draft = models
    return ReplayEngine(target, draft, EngineConfig(max_batch=4, max_model_len=128, **config), prompts, TRACES, NEW)


def test_peaked_target_has_a_wide_greedy_margin(models):
    target, _ = models
    ids = torch.tensor(random_prompts(2, 16, VOCAB))
    top = target(input_ids=ids).logits.topk(2, dim=-1).values
    assert float((top[..., 0] - top[..., 1]).min()) > 30.0


def test_replay_accepts_exactly_the_recorded_rounds_and_keeps_the_output(models, prompts):
    engine = _replay(models, prompts)
    results = engine.generate([Request(p, NEW, ignore_eos=True) for p in prompts])
    assert [r.token_ids for r in results] == _plain(models[0], prompts)
    for i, r in enumerate(results):
        trace, produced = TRACES[i % len(TRACES)], 1  # the prefill's token
        for k, (scheduled, accepted) in enumerate(zip(r.stats.scheduled_lengths, r.stats.accept_lengths)):
            # every draft, but never more than the request may still keep (the last rounds)
            assert scheduled == max(1, min(P, NEW - produced - 1))
            assert accepted == min(trace[k % len(trace)][0], scheduled) + 1
            produced += accepted


def test_replay_schedules_on_the_recorded_confidences(models, prompts):
    engine = _replay(models, prompts, scheduler="threshold", threshold=0.5)
    results = engine.generate([Request(p, NEW, ignore_eos=True) for p in prompts])
    assert [r.token_ids for r in results] == _plain(models[0], prompts)
    for i, r in enumerate(results):
        trace, produced = TRACES[i % len(TRACES)], 1  # the first token: the prompt's last logits
        for k in range(r.stats.rounds):  # the step that ends a prompt drafts it: every round is scheduled
            entry = trace[k % len(trace)]
            length = int(K.threshold_proposal_lengths(torch.tensor([entry[1:]]), 0.5)[0])
            length = max(1, min(length, NEW - produced - 1))  # never more than the request can keep
            assert r.stats.scheduled_lengths[k] == length
            assert r.stats.accept_lengths[k] == min(entry[0], length) + 1
            produced += r.stats.accept_lengths[k]


def test_replay_refuses_unknown_prompts_and_bad_traces(models, prompts):
    engine = _replay(models, prompts)
    with pytest.raises(ValueError, match="prepared prompts"):
        engine.add_request(Request([1, 2, 3], 4))
    with pytest.raises(ValueError, match=r"oracle_trace\[0\] must be \[accepted drafts in 0..7"):
        engine.add_request(Request(prompts[0], 4), [1] * 60, [[8] + [0.5] * 7])
    with pytest.raises(ValueError, match=r"oracle_trace\[1\] must be \[accepted drafts"):
        engine.add_request(Request(prompts[0], 4), [1] * 60, [[1] + [0.5] * 7, "ab"])
    with pytest.raises(TypeError, match="oracle_trace must be a non-empty list of rounds, got int"):
        engine.add_request(Request(prompts[0], 4), [1] * 60, 3)
    with pytest.raises(ValueError, match="oracle_trace goes with replay=True"):
        OracleEngine(models[0], models[1], EngineConfig(max_batch=2), acceptance=0.5).add_request(
            Request(prompts[0], 4), [1] * 60, [[1] + [0.5] * 7])
    with pytest.raises(ValueError, match="give acceptance .* or replay=True, one of the two"):
        OracleEngine(models[0], models[1], EngineConfig(max_batch=2), acceptance=0.5, replay=True)
    with pytest.raises(ValueError, match="need greedy sampling"):
        engine.add_request(Request(prompts[0], 4, SamplingParams(1.0, seed=1)))
    assert not engine.scheduler.waiting  # nothing refused was queued


def test_shipped_traces_are_the_demo_pairs_rounds():
    data = load_traces()
    assert data["num_drafts"] == P and len(data["traces"]) == 26
    rounds = [e for t in data["traces"] for e in t]
    assert all(len(e) == P + 1 and 0 <= e[0] <= P and all(0 <= c <= 1 for c in e[1:]) for e in rounds)
    assert data["tau"] == pytest.approx(1 + sum(e[0] for e in rounds) / len(rounds), abs=1e-4)
    # the calibrated confidence head predicts acceptance: first position, mean confidence vs rate within 0.1
    assert abs(sum(e[1] for e in rounds) / len(rounds) - sum(e[0] > 0 for e in rounds) / len(rounds)) < 0.1


def test_recorded_traces_leave_out_a_prompt_answered_in_its_first_round(tmp_path):
    """A prompt whose first token is end-of-text has no full round: it is left out with its file
    (an empty trace made the frontier refuse the whole file)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark.bench.replay import record_traces
    from dspark.training import data

    pair = data.demo_pair()
    for name in ("target", "draft"):
        (tmp_path / name).symlink_to(getattr(pair, name))
    records = {r["file"]: r for r in data.read_prompts(str(pair.prompts))}
    # a bare final line break: where this target's training files end (docs/demo-pair.md)
    ending = dict(records["asyncio/subprocess.py"], text=records["asyncio/subprocess.py"]["text"] + "\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps(ending) + "\n" + json.dumps(records["hmac.py"]) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    ids = tokenizer(ending["text"], return_tensors="pt").input_ids
    assert int(target(ids).logits[0, -1].argmax()) == tokenizer.eos_token_id  # the case under test
    out = record_traces(16, pair_dir=tmp_path)
    assert out["files"] == ["hmac.py"] and len(out["traces"]) == 1 and out["traces"][0]
    (tmp_path / "traces.json").write_text(json.dumps(out))
    assert load_traces(tmp_path / "traces.json")["rounds"] == len(out["traces"][0])


@pytest.mark.gpu
@pytest.mark.gpu
def test_replay_in_cuda_graphs_captured_up_front(prompts):
    """bf16 on the GPU: Triton kernels, graphs captured by ``capture_graphs`` before any request."""
    target = peaked_target(TINY, vocab=VOCAB, device="cuda", dtype=torch.bfloat16)
    draft = random_drafter(target, TINY, rank=64)
    config = EngineConfig(max_batch=4, max_model_len=128, scheduler="threshold", threshold=0.5)
    engine = ReplayEngine(target, draft, config, prompts, TRACES, NEW)
    def mixed(runner):  # steps with prompt chunks: greedy and penalised rows, but no rows' only greedy
        return sum(2 if b else 1 for b, _, _ in runner.mixed_shapes())

    # every logits path: verify at every length, draft; the steps with prompt chunks
    paths = len(LogitsPath)
    assert engine.capture_graphs() == paths * len(engine.runner.buckets) * (P + 2) + mixed(engine.runner)
    captured = set(engine.runner.graphs)
    results = engine.generate([Request(p, NEW, ignore_eos=True) for p in prompts])
    # every step, prompt chunks included, replayed a graph captured up front
    assert set(engine.runner.graphs) == captured and not engine.runner.uncapturable
    plain = LLMEngine(target, None, EngineConfig(max_batch=4, max_model_len=128))
    assert plain.capture_graphs() == paths * len(plain.runner.buckets) + mixed(plain.runner)
    expected = [r.token_ids for r in plain.generate([Request(p, NEW, ignore_eos=True) for p in prompts])]
    assert [r.token_ids for r in results] == expected
    for i, r in enumerate(results):
        trace, produced = TRACES[i % len(TRACES)], 1
        for k in range(r.stats.rounds):
            entry = trace[k % len(trace)]
            length = int(K.threshold_proposal_lengths(torch.tensor([entry[1:]]), 0.5)[0])
            length = max(1, min(length, NEW - produced - 1))
            assert (r.stats.scheduled_lengths[k], r.stats.accept_lengths[k]) == (length, min(entry[0], length) + 1)
            produced += r.stats.accept_lengths[k]


def test_frontier_summary_checks_the_targets_and_the_outputs(tmp_path):
    """``bench.frontier`` side by side: ratios, targets and the cross-configuration output check."""
    import json

    from dspark.bench.frontier import markdown, summarize

    def level(c, total, per_request):
        stats = {"mean": per_request, "p50": per_request, "p99": per_request}
        return {"concurrency": c, "total_tokens_per_s": total, "steady_tokens_per_s": 1.1 * total,
                "per_request_tokens_per_s": stats, "ttft_s": stats, "itl_s": {**stats, "p99": 0.01 * c},
                "tau": 2.0, "failed": 0, "mismatched": 0, "requests": 4, "engine_host_ms": 0.6,
                "engine_host_phase_ms": {"plan": 0.1, "launch": 0.2, "commit": 0.3}, "engine_host_overlapped_ms": 0.25}

    runs = {"plain": [(1, 100, 100), (64, 1000, 20)], "dspark-fixed": [(1, 200, 160), (64, 1000, 20)],
            "dspark-scheduled": [(1, 210, 170), (64, 1400, 25)]}
    for label, levels in runs.items():
        outputs = {"0": [1, 2, 3], "1": [4, 5] if label != "dspark-fixed" else [4, 6]}
        (tmp_path / f"{label}.json").write_text(json.dumps({"label": label, "outputs": outputs,
                                                            "levels": [level(*x) for x in levels]}))
    result = summarize(tmp_path, list(runs))
    targets = result["targets"]
    assert targets["scheduled / plain, / fixed (total_tokens_per_s)"] == {1: {"plain": 2.1, "dspark-fixed": 1.05},
                                                                         64: {"plain": 1.4, "dspark-fixed": 1.4}}
    for rate in ("total_tokens_per_s", "steady_tokens_per_s"):
        assert targets[f"scheduled >= 1.4x plain at 64 ({rate})"] and targets[f"scheduled >= 1.25x fixed at 64 ({rate})"]
        assert targets[f"scheduled >= 0.97x max(plain, fixed) at every concurrency ({rate})"]
    assert targets["scheduled p99 ITL / plain at 64"] == 1.0 and targets["scheduled p99 ITL <= 1.2x plain at 64"]
    assert targets["dspark-fixed per request / plain at 1"] == 1.6 and targets["dspark-fixed >= 1.5x plain per request at 1"]
    assert result["outputs_identical_across_configs"] is False  # prompt 1 differs under dspark-fixed
    assert "| 0.60 (0.10 / 0.20 / 0.30; 0.25) |" in markdown(result, "test")  # host ms by phase; behind a draft


@pytest.mark.parametrize("flags, message", [
    (["--shape", "nope"], "--shape must be one of"), (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--traces", "/nonexistent.json"], "--traces: traces '/nonexistent.json': not a readable JSON"),
    (["--concurrency", "1,x"], "--concurrency must be comma-separated"), (["--configs", "fast"], "--configs must name"),
    (["--prompt-tokens", "128", "--prompt-tokens-max", "64"], "--prompt-tokens-max must be >= --prompt-tokens"),
])
def test_frontier_flags_are_checked_before_anything_runs(tmp_path, capsys, flags, message):
    from dspark.bench.frontier import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_mixed_settings_workload_mixes_every_batch_and_repeats_each_prompt():
    """``bench.serve --mixed-settings``: prompt i always gets the i-th setting and seed i (so its
    sampled tokens repeat: request-stable), and consecutive prompts cover greedy and the three
    sampled settings; ``--random-prompts-max`` draws seeded lengths in the range."""
    from dspark.bench import serve

    args, _ = serve.parse_args(["--out", "x", "--mixed-settings", "--random-prompts", "8", "--random-prompts-max", "20",
                                "--vocab", "50", "--num-prompts", "16"])
    bodies = [serve.request_body([1], args, 4, i) for i in range(8)]
    assert [b["temperature"] for b in bodies[:4]] == [0.0, 0.7, 1.0, 1.0] and "seed" not in bodies[0]
    assert [b.get("seed") for b in bodies[4:]] == [None, 5, 6, 7] and bodies[5]["top_p"] == 0.9
    assert serve.request_body([1], args, 4, 6) == bodies[6]
    prompts = serve.make_prompts(args)
    assert prompts == serve.make_prompts(args) and all(8 <= len(p) <= 20 for p in prompts)
    assert len({len(p) for p in prompts}) > 1 and all(0 <= t < 50 for p in prompts for t in p)
    with pytest.raises(SystemExit):
        serve.parse_args(["--out", "x", "--mixed-settings", "--temperature", "0.5"])


def test_the_mixed_workload_summary_pairs_each_config_with_its_mixed_run(tmp_path):
    """``--workload mixed --summarize-only``: each config whose greedy and mixed runs are in the
    folder, side by side per concurrency (runs of separate invocations combine); ``--configs``
    names mixed-workload configs."""
    import json

    from dspark.bench.frontier import main

    def run(rates):
        return {"levels": [{"concurrency": c, "total_tokens_per_s": r, "engine_step_ms": 5.0, "failed": 0}
                           for c, r in rates.items()]}

    for name, rates in {"plain": {1: 100.0, 8: 800.0}, "plain-mixed": {1: 95.0, 8: 600.0}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run(rates)))
    assert main(["--out", str(tmp_path), "--workload", "mixed", "--summarize-only", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "mixed.json").read_text())
    assert [(r["config"], r["concurrency"], r["ratio"]) for r in result["levels"]] == [("plain", 1, 0.95),
                                                                                      ("plain", 8, 0.75)]
    assert result["mixed within 10 % of single at every concurrency"] is False
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--workload", "mixed", "--configs", "dspark-fixed"])
