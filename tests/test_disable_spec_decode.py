"""A request's opt-out of speculative decoding (``Request.disable_spec_decode``, the server's
``disable_spec_decode`` body field): plain decoding inside a DSpark batch, on the same graphs --
every round verifies none of its drafts, greedy output is plain decoding's, sampled tokens follow
the target's distribution -- and the rows beside it keep their outputs."""

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from test_engine import _fit, _forward, _greedy

import dspark.kernels as K
from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams
from dspark.engine.schedulers import SPSCostTable

PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
NEW = 12
OPTED_OUT = (1, 2)  # rows that opt out; the others draft


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.fixture(scope="module")
def greedy(target):
    return [_greedy(target, p, NEW) for p in PROMPTS]


def _engine(target, scheduler="off", oracle=False, **fields):
    """A DSpark engine on a random draft, or (``oracle``) one whose drafts are the greedy continuation:
    every draft a row verifies is accepted, so a row that verified one shows it."""
    from dspark.bench.oracle import OracleEngine

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    config = EngineConfig(max_batch=4, scheduler=scheduler, threshold=0.1, cost_table=SPSCostTable((1, 64), (1.0, 1.0)),
                          **fields)
    return OracleEngine(target, draft, config, acceptance=1.0) if oracle else LLMEngine(target, draft, config)


@pytest.mark.parametrize("scheduler, signal", [("off", "confidence"), ("threshold", "confidence"),
                                               ("cost", "confidence"), ("cost", "online")])
def test_opted_out_rows_verify_no_draft_and_stay_exact(target, greedy, scheduler, signal):
    """Drafts that the target accepts (the greedy continuation): the drafting rows accept them, the
    opted-out rows verify none in any round (one token a round), and
    every greedy output is plain decoding's; requests join as prompt chunks in steps with running
    rows (mixed steps) too."""
    engine = _engine(target, scheduler, oracle=True, schedule_signal=signal)
    requests = [Request(p, NEW, disable_spec_decode=i in OPTED_OUT) for i, p in enumerate(PROMPTS)]
    ids = [engine.add_request(r, g + [0] * 8) for r, g in zip(requests, greedy)]
    while engine.has_unfinished():
        engine.step()
    results = [engine.sequences[i] for i in ids]
    assert [r.output_ids for r in results] == greedy
    for i, r in enumerate(results):
        if i in OPTED_OUT:
            assert set(r.stats.scheduled_lengths) == {0} and set(r.stats.accept_lengths) == {1}, i
        else:
            assert max(r.stats.accept_lengths) > 2, i


def test_every_row_opted_out_under_the_cost_scheduler_decodes_plainly(target, greedy):
    """No row drafts: the cost scheduler runs plain rounds (no draft pass) -- exact all the same."""
    engine = _engine(target, "cost")
    results = engine.generate([Request(p, NEW, disable_spec_decode=True) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    assert engine.metrics.plain_steps > 0


def test_an_opted_out_row_does_not_change_the_rows_beside_it(target):
    """A sampled and a greedy drafting request give the same tokens, round for round, beside opted-out
    rows (greedy and sampled) as alone: the opt-out changes nothing but its own row."""
    engine = _engine(target, "threshold")
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    alone = engine.generate([Request(PROMPTS[2], NEW, hot), Request(PROMPTS[0], NEW)])
    mixed = engine.generate([Request(PROMPTS[2], NEW, hot), Request(PROMPTS[1], NEW, hot, disable_spec_decode=True),
                             Request(PROMPTS[0], NEW), Request(PROMPTS[3], NEW, disable_spec_decode=True)])
    for a, m in zip(alone, (mixed[0], mixed[2])):
        assert m.token_ids == a.token_ids and m.stats.scheduled_lengths == a.stats.scheduled_lengths
    assert set(mixed[1].stats.scheduled_lengths) == {0} and len(mixed[1].token_ids) == NEW


@pytest.mark.slow
def test_opted_out_sampled_tokens_follow_the_target_distribution():
    """V = 4, temperature 1, top-k 2: an opted-out sampled row's first two tokens (each request its
    own seed, batches of opted-out rows and drafting rows mixed) follow the exact target
    distribution (chi-square p > 1e-3, TV < 0.05 over 1000 requests)."""
    runs, vocab, top_k, prompt = 1000, 4, 2, [1, 3, 2, 0, 2]
    target = tiny_qwen3_target(vocab_size=vocab)
    draft = random_draft(tiny_draft_config(target.config, block_size=2), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=256))
    requests = [Request(prompt, 2, SamplingParams(temperature=1.0, top_k=top_k, seed=s), stop_ids=[],
                        disable_spec_decode=s % 4 != 0) for s in range(runs * 4 // 3)]
    results = engine.generate(requests)
    out = torch.tensor([r.token_ids for r, q in zip(results, requests) if q.disable_spec_decode])
    assert all(set(r.stats.scheduled_lengths) == {0} for r, q in zip(results, requests) if q.disable_spec_decode)

    def probs(sequences):
        logits = torch.stack([_forward(target, s)[0][-1] for s in sequences])
        return K.logits_to_probabilities(logits, 1.0, top_k)

    first = probs([prompt])[0]
    second = (first[:, None] * probs([prompt + [a] for a in range(vocab)])).sum(0)
    for position, exact in ((0, first), (1, second)):
        p_value, tv = _fit(out[:, position], exact)
        assert p_value > 1e-3 and tv < 0.05, (position, p_value, tv)


def test_tree_mode_refuses_an_opted_out_request(target):
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2, draft_top_k=2))
    with pytest.raises(ValueError, match="disable_spec_decode is not supported in tree mode") as info:
        engine.add_request(Request(PROMPTS[0], 4, disable_spec_decode=True))
    assert info.value.param == "disable_spec_decode"
    with pytest.raises(TypeError, match="disable_spec_decode must be a bool, got int"):
        Request(PROMPTS[0], 4, disable_spec_decode=1)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler, signal", [("off", "confidence"), ("cost", "online")])
def test_opted_out_rows_on_cuda_graphs(target, greedy, scheduler, signal):
    """On CUDA after the start-up capture: opted-out rows (greedy and sampled) beside drafting rows
    replay the captured graphs -- no capture while decoding -- verify no draft, and every greedy
    output is plain decoding's."""
    cuda_target = tiny_qwen3_target().cuda()
    draft = random_draft(tiny_draft_config(target.config), 0, target).cuda()
    engine = LLMEngine(cuda_target, draft, EngineConfig(max_batch=4, scheduler=scheduler, schedule_signal=signal,
                                                        cost_table=SPSCostTable((1, 64), (1.0, 8.0))))
    engine.capture_graphs()
    captured = engine.runner.captures
    hot = SamplingParams(temperature=0.8, top_k=20, seed=5)
    requests = [Request(p, NEW, disable_spec_decode=i in OPTED_OUT) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests + [Request(PROMPTS[0], NEW, hot, disable_spec_decode=True)])
    assert [r.token_ids for r in results[:4]] == greedy and len(results[4].token_ids) == NEW
    assert all(set(results[i].stats.scheduled_lengths) == {0} for i in (*OPTED_OUT, 4))
    assert engine.runner.captures == captured, "an opted-out row met a graph shape capture_graphs left out"
