"""Every request ends cleanly at every limit, and an engine failure ends only the requests it concerns.

The context limit: prompt + output up to exactly ``max_model_len`` (here the target's
``max_position_embeddings``, so a verify token past it would have no RoPE row), drafts and verify
windows trimmed at the end, finish reason ``"length"``, output identical to plain greedy decoding
-- for every scheduler, alone and batched with requests that keep running.
"""

import copy
import logging
import time

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from test_engine import _greedy

from dspark.engine import llm_engine
from dspark.engine.llm_engine import EngineConfig, LLMEngine, token_logprobs
from dspark.engine.request import Request
from dspark.engine.schedulers import SPSCostTable

LIMIT = 24  # the target's max_position_embeddings: the engine's context limit


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target(max_position_embeddings=LIMIT)


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(tiny_draft_config(target.config), 0, target)


CONFIGS = {
    "off": dict(scheduler="off"),
    "threshold": dict(scheduler="threshold", threshold=0.3),
    "sps": dict(scheduler="sps"),
    "cost": dict(scheduler="cost", cost_table=SPSCostTable((1, 64), (1.0, 2.0))),
    "plain": None,
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_run_to_exactly_the_context_limit(target, draft, name, device):
    """On CUDA: Triton kernels and CUDA graphs, fp32 (a trimmed verify is one more ragged graph)."""
    options = CONFIGS[name]
    model, drafter = (target, draft) if device == "cpu" else (tiny_qwen3_target(max_position_embeddings=LIMIT).cuda(),
                                                               random_draft(tiny_draft_config(target.config), 0, target).cuda())
    engine = LLMEngine(model, None if options is None else drafter, EngineConfig(max_batch=3, **(options or {})))
    assert engine.max_model_len == LIMIT
    prompts = [[5], [3, 17, 42, 8, 61, 5], [9, 1, 4], [44, 2]]
    # prompt + max_new_tokens = the limit, the limit - 1, far past it (the chat default: the rest of
    # the context and more), and one that keeps running beside them
    news = [LIMIT - 1, LIMIT - 1 - 6, 500, 5]
    requests = [Request(p, n, ignore_eos=True) for p, n in zip(prompts, news)]
    results = engine.generate(requests)
    for p, n, r in zip(prompts, news, results):
        want = min(n, LIMIT - len(p))
        assert r.token_ids == _greedy(target, p, want), (p, n)
        assert r.finish_reason == "length" and len(p) + len(r.token_ids) <= LIMIT
    assert len(prompts[0]) + len(results[0].token_ids) == LIMIT
    assert len(prompts[2]) + len(results[2].token_ids) == LIMIT
    assert not engine.has_unfinished() and sorted(engine.scheduler.free_slots) == [0, 1, 2]


def test_the_last_token_of_the_context_is_produced_by_prefill(target, draft):
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2))
    prompt = list(range(1, LIMIT))  # LIMIT - 1 tokens: room for exactly one
    result = engine.generate([Request(prompt, 10)])[0]
    assert result.token_ids == _greedy(target, prompt, 1) and result.finish_reason == "length"


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_targets_log_softmax(target, draft, device):
    prompt, k = [3, 17, 42, 8], 3
    for model in (draft, None):
        on_device = copy.deepcopy(target).to(device)
        engine = LLMEngine(on_device, None if model is None else copy.deepcopy(model).to(device), EngineConfig(max_batch=2))
        ids = engine.add_request(Request(prompt, 6, logprobs=k))
        other = engine.add_request(Request([9, 1], 6))
        got, outputs = [], []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == ids:
                    got += out.new_token_ids
                    outputs += out.logprobs or []
                else:
                    assert out.logprobs is None
        assert [e.token_id for e in outputs] == got == _greedy(target, prompt, 6)
        with torch.no_grad():
            logits = on_device(torch.tensor([prompt + got], device=device)).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).cpu()
        for e, row, token in zip(outputs, logp, got):
            assert e.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert [t for t, _ in e.top] == row.topk(k).indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
        engine.sequences.clear()
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got 21"):
        Request([1], 3, logprobs=21)
    assert token_logprobs(torch.zeros(1, 4), [2], 0)[0].top == []


def test_a_failing_prompt_fails_only_its_request(target, draft, monkeypatch, caplog):
    """Fault injection: the target forward raises on one prompt's tokens. The step is retried
    without its chunks, each chunk is tried alone: the failed request ends with "error" naming the
    cause; the one admitted with it and the one already running finish exactly as alone."""
    engine = LLMEngine(target, draft, EngineConfig(max_batch=4))
    real, poison = engine.target.forward, 77

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected fault")
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", forward)
    running = engine.add_request(Request([3, 17, 42], 12))
    outs: dict[int, list] = {running: []}
    for out in engine.step():
        outs[out.request_id] += out.new_token_ids
    bad = engine.add_request(Request([5, poison, 2], 12))
    good = engine.add_request(Request([9, 1], 12))
    outs.update({bad: [], good: []})
    reasons, errors = {}, {}
    with caplog.at_level(logging.WARNING, logger="dspark.engine"):
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id], errors[out.request_id] = out.finish_reason, out.error
    assert reasons[bad] == "error" and errors[bad] == "RuntimeError: injected fault" and outs[bad] == []
    assert "injected fault" in caplog.text and "Traceback" in caplog.text
    assert reasons[good] == reasons[running] == "length"
    assert outs[good] == _greedy(target, [9, 1], 12) and outs[running] == _greedy(target, [3, 17, 42], 12)
    after = engine.generate([Request([9, 1], 5)])[0]  # the engine goes on
    assert after.token_ids == _greedy(target, [9, 1], 5)


@pytest.mark.parametrize("with_draft", [True, False], ids=["dspark", "plain"])
def test_prompts_run_in_chunks_beside_running_rows(target, draft, with_draft):
    """The smallest budget (3 rows' verify tokens): long prompts are admitted over several steps
    while the other rows keep decoding; every output equals plain greedy decoding."""
    verify = (draft.config.block_size if draft.config.sample_from_anchor else draft.config.block_size - 1) + 1
    budget = 3 * (verify if with_draft else 1)
    engine = LLMEngine(target, draft if with_draft else None, EngineConfig(max_batch=3, max_num_batched_tokens=budget))
    prompts = [[5, 6], list(range(1, 15)), [9, 1, 4], list(range(20, 31))]
    first = engine.add_request(Request(prompts[0], 12))
    outs, split = {first: engine.step()[0].new_token_ids}, 0
    ids = [first] + [engine.add_request(Request(p, 12)) for p in prompts[1:]]
    outs.update({i: [] for i in ids[1:]})
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
        split += any(0 < seq.prefilled < seq.prompt_len for seq in engine.scheduler.prefilling)  # a prompt cut between steps
    assert [outs[i] for i in ids] == [_greedy(target, p, min(12, LIMIT - len(p))) for p in prompts]
    assert split >= 1
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least max_batch x verify length"):
        LLMEngine(target, draft if with_draft else None, EngineConfig(max_batch=3, max_num_batched_tokens=2))


def test_the_default_budget_leaves_prompts_room_beside_full_verifies(target, draft, monkeypatch):
    """By default a step's budget is every row's full verify plus ``DEFAULT_PROMPT_ROOM`` prompt
    tokens (and ``DEFAULT_BATCHED_TOKENS`` at least): a prompt joining rows that verify full windows
    runs the room and the free row's window in its first step -- not the free row's window alone,
    which at 256 rows of 8 verify tokens (2048) left refilled rows idle for many steps. Exact output."""
    monkeypatch.setattr(llm_engine, "DEFAULT_BATCHED_TOKENS", 1)
    monkeypatch.setattr(llm_engine, "DEFAULT_PROMPT_ROOM", 6)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler="off"))
    verify = engine.runner.verify_len
    assert engine.max_num_batched_tokens == 3 * verify + 6
    prompts, new = [[5, 6], [9, 1, 4], list(range(1, 19))], (16, 16, 4)
    ids = [engine.add_request(Request(p, n)) for p, n in zip(prompts[:2], new)]
    outs = {i: [] for i in ids}
    for _ in range(2):  # both rows decoding: the next rounds verify full windows
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    late = engine.add_request(Request(prompts[2], new[2]))
    outs[late] = []
    for out in engine.step():
        outs[out.request_id] += out.new_token_ids
    assert verify + 6 < len(prompts[2]) and engine.sequences[late].prefilled == verify + 6
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    assert [outs[i] for i in ids + [late]] == [_greedy(target, p, n) for p, n in zip(prompts, new)]


def test_the_steps_that_capture_a_graph_are_timed_apart(target, draft, monkeypatch):
    """``EngineMetrics.capture_step_time``: the seconds of the steps during which the runner captured
    a graph (a capture while serving stalls its step; a benchmark reports throughput without them)."""
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2))
    real, calls = engine.runner.launch_round, []

    def launch_round(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # as a capture would: the runner counts one, the step takes longer
            engine.runner.captures += 1
            time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch_round", launch_round)
    engine.generate([Request([3, 17], 10), Request([9, 1], 10)])
    m = engine.metrics
    assert len(calls) > 3 and 0.2 <= m.capture_step_time < m.step_time


def test_a_failing_round_fails_its_rows_and_the_engine_goes_on(target, draft, monkeypatch):
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2))
    real, calls = engine.runner.launch_round, []

    def launch_round(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected round fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch_round", launch_round)
    first = engine.generate([Request([3, 17], 10), Request([9, 1], 10)])
    assert [r.finish_reason for r in first] == ["error", "error"]
    assert first[0].error == "RuntimeError: injected round fault"
    assert engine.metrics.errors == 2 and sorted(engine.scheduler.free_slots) == [0, 1]
    again = engine.generate([Request([3, 17], 10), Request([9, 1], 10)])
    assert [r.token_ids for r in again] == [_greedy(target, [3, 17], 10), _greedy(target, [9, 1], 10)]


@pytest.mark.parametrize("scheduler", ["off", "threshold"])
def test_one_request_at_a_time_runs_to_exactly_the_context_limit(target, draft, scheduler):
    """``SpeculativeDecoder`` (the reference engine: max batch 1, no CUDA graphs) at the same limit."""
    from dspark.engine import SpeculativeDecoder

    decoder = SpeculativeDecoder.from_models(target, draft, scheduler=scheduler, threshold=0.3)
    for prompt, new in (([5], LIMIT - 1), ([9, 1, 4], LIMIT - 4), ([44, 2], 500)):
        result = decoder.generate(torch.tensor(prompt), max_new_tokens=new, eos_token_id=[])
        assert result.token_ids == _greedy(target, prompt, min(new, LIMIT - len(prompt)))
        assert result.finish_reason == "length"


@pytest.mark.parametrize("with_draft", [True, False], ids=["dspark", "plain"])
def test_one_seed_gives_the_same_tokens_alone_and_in_a_batch(target, draft, with_draft):
    """One random stream: every draw is request-stable (seed, position, purpose), so a sampled
    request's tokens are the same run alone on the reference engine (max batch 1, no CUDA graphs) as
    beside other requests in a batch (here up to the context limit, the last rounds trimmed)."""
    from dspark.engine import SamplingParams

    draft = draft if with_draft else None
    batched = LLMEngine(target, draft, EngineConfig(max_batch=3))
    alone = LLMEngine(target, draft, EngineConfig(max_batch=1, cuda_graphs=False))
    other = Request([9, 1], 30, SamplingParams(temperature=1.0, seed=1), ignore_eos=True)
    for seed, sampling in enumerate([SamplingParams(temperature=1.0, seed=5), SamplingParams(0.8, top_k=20, seed=2**63 + 9),
                                     SamplingParams(0.9, top_p=0.9, seed=77)]):
        request = Request([3, 17, 42][: seed + 1], 30, sampling, ignore_eos=True)
        together = batched.generate([other, request])[1].token_ids
        assert alone.generate([request])[0].token_ids == together and len(together) == LIMIT - seed - 1
