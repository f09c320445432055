"""The engine with sampled drafting over candidate sets (``EngineConfig.draft_candidates``): outputs
still follow the target's distribution (testing.md §5, through the whole engine), a sampled request
gives the same tokens alone and batched, and greedy requests are unchanged.

The candidate drafter runs for a vanilla Markov head in half precision: the drafts here are bf16.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRETER_WARNINGS, gpu
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from statistics_cases import check_transitions
from test_lossless_sampling import ENGINE_ROWS, ENGINE_TOKENS, WARPED, WARPED_VOCAB, bigram_target, nudged
from test_request_sampling import transformers_probabilities

import dspark.kernels as K
from dspark.cli import _runtime
from dspark.engine import SamplingParams, config
from dspark.engine.drafting import Drafter
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request

pytestmark = [pytest.mark.usefixtures("reference_backend"), INTERPRETER_WARNINGS]
CANDIDATES, SUCCESSORS = 3, 1  # of WARPED_VOCAB = 6 tokens: q is zero on two or more of them


def half_draft(target, seed: int = 0):
    return random_draft(tiny_draft_config(target.config, layer_types=["full_attention"]), seed, target).to(
        torch.bfloat16)


@pytest.fixture(scope="module")
def warped_pair(one_thread):
    """A bigram target, a bf16 random draft, and the target's chain under ``WARPED`` (transformers'
    warpers: logit_bias, temperature, min_p, top-k, top-p)."""
    target, logits = bigram_target(WARPED_VOCAB)
    return target, half_draft(target), transformers_probabilities(logits, **WARPED)


def warped_sequences(pair, monkeypatch, spoil_q: bool = False) -> torch.Tensor:
    """``ENGINE_ROWS`` seeded requests of ``ENGINE_TOKENS`` tokens with candidate drafting (its calls
    counted: the path must run); ``spoil_q``: the verifier gets the drafts' q off by 5 %."""
    target, draft = pair[:2]
    calls = []
    sample = K.markov_candidate_sample
    monkeypatch.setattr(K, "markov_candidate_sample", lambda *a, **kw: calls.append(1) or sample(*a, **kw))
    if spoil_q:
        accept = K.probabilistic_accept
        monkeypatch.setattr(K, "probabilistic_accept", lambda p, q, *a, **kw: accept(p, nudged(q), *a, **kw))
    engine = LLMEngine(target, draft, EngineConfig(max_batch=ENGINE_ROWS, draft_candidates=CANDIDATES,
                                                   draft_successors=SUCCESSORS))
    prompts = [s % WARPED_VOCAB for s in range(ENGINE_ROWS)]
    results = engine.generate([Request([p], ENGINE_TOKENS, SamplingParams(**WARPED, seed=s), stop_ids=[],
                                       ignore_eos=True) for s, p in enumerate(prompts)])
    assert calls, "the candidate drafter never ran"
    return torch.tensor([[p] + r.token_ids for p, r in zip(prompts, results)])


@pytest.mark.slow
def test_outputs_follow_the_target_with_candidate_drafting(warped_pair, monkeypatch):
    """Every transition of 65 536 follows the target's warped chain, although the drafts come from
    at most 4 of 6 tokens (3 backbone candidates, 1 successor) with the request's filters applied
    over those only."""
    problem = check_transitions(warped_sequences(warped_pair, monkeypatch), warped_pair[2])
    assert problem is None, problem


@pytest.mark.slow
def test_the_check_catches_a_verifier_given_another_q(warped_pair, monkeypatch):
    """The check has teeth: q off by 5 % from the one the drafts came from fails it."""
    assert check_transitions(warped_sequences(warped_pair, monkeypatch, spoil_q=True), warped_pair[2]) is not None


def test_the_cli_defaults_are_the_engine_defaults():
    assert (_runtime.DEFAULT_DRAFT_CANDIDATES, _runtime.DEFAULT_DRAFT_SUCCESSORS) == (
        config.DEFAULT_DRAFT_CANDIDATES, config.DEFAULT_DRAFT_SUCCESSORS)


# ------------------------------------------------------------------------------ greedy and request stability

NEW_TOKENS = 24
PROMPT = [5, 17, 2, 40]


@pytest.fixture(scope="module")
def pair(one_thread):
    target = tiny_qwen3_target(vocab_size=96)
    return target, half_draft(target, seed=1)


def generate(pair, candidates: int, sampling: list[SamplingParams]):
    engine = LLMEngine(*pair, EngineConfig(max_batch=len(sampling), draft_candidates=candidates,
                                           draft_successors=4 if candidates else 0))
    return engine.generate([Request(PROMPT, NEW_TOKENS, s, ignore_eos=True) for s in sampling])


def test_a_greedy_batch_drafts_as_without_candidates(pair):
    """Plain greedy rows only: the fused greedy round, untouched -- same tokens, same rounds."""
    greedy = [SamplingParams(), SamplingParams(seed=2)]
    for with_c, without in zip(generate(pair, 8, greedy), generate(pair, 0, greedy)):
        assert with_c.token_ids == without.token_ids
        assert with_c.stats.accept_lengths == without.stats.accept_lengths


def test_mixed_batch_greedy_is_plain_decoding_and_sampled_rows_are_request_stable(pair, monkeypatch):
    """Beside sampled rows greedy requests still emit the target's argmax (plain decoding; with a
    bias, the output of the full-vocabulary drafter), though they draft over candidates there, and a
    sampled request gives the same tokens alone and batched."""
    calls = []
    propose = Drafter._candidate_round
    monkeypatch.setattr(Drafter, "_candidate_round", lambda self, *a: calls.append(1) or propose(self, *a))
    hot = SamplingParams(0.8, top_k=20, top_p=0.9, min_p=0.02, seed=7)
    plain = LLMEngine(pair[0], None, EngineConfig(max_batch=1)).generate(
        [Request(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)])[0].token_ids
    biased = SamplingParams(logit_bias={plain[2]: -100.0, 11: 3.0})
    biased_full_vocabulary = generate(pair, 0, [biased])[0].token_ids
    alone = generate(pair, 8, [hot])[0].token_ids
    mixed = generate(pair, 8, [SamplingParams(), hot, biased, SamplingParams(1.0, seed=3)])
    assert calls
    assert mixed[0].token_ids == plain
    assert mixed[1].token_ids == alone
    assert mixed[2].token_ids == biased_full_vocabulary != plain


@pytest.mark.parametrize("candidates", [8, 0])
def test_sampled_drafts_are_written_into_the_given_buffer(pair, candidates):
    """``probabilities_out`` (the runner's row buffer) ends up holding exactly the distributions a
    new tensor would, whatever it held before, over candidate sets and over the vocabulary."""
    draft = pair[1]
    drafter = Drafter(draft, draft_candidates=candidates, draft_successors=4 if candidates else 0)
    b, n = 2, drafter.block_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b * n, pair[0].config.vocab_size, generator=g)
    hidden = torch.randn(b * n, draft.config.hidden_size, generator=g).to(draft.dtype)
    sampling = SamplingParams(0.8, top_k=20, top_p=0.9).rows(b, "cpu")
    uniforms = torch.rand(b, drafter.num_draft_tokens, generator=g)
    anchors = torch.tensor([3, 7], dtype=torch.int32)
    fresh = drafter.propose_rows(hidden, logits, anchors, sampling, uniforms)
    out = torch.full_like(fresh.probabilities, 7.0)
    given = drafter.propose_rows(hidden, logits, anchors, sampling, uniforms, probabilities_out=out)
    assert given.probabilities is out and torch.equal(out, fresh.probabilities)
    assert torch.equal(given.token_ids, fresh.token_ids)


@gpu
def test_cuda_graphs_replay_candidate_drafting():
    """On CUDA with every graph captured up front and a bf16 draft: greedy beside sampled rows is
    plain decoding, a sampled request gives the same tokens alone and batched, no step captures.
    On the Triton kernels (this module's other tests force the reference)."""
    with K.use_backend("triton"):
        _candidate_drafting_replays_graphs()


def _candidate_drafting_replays_graphs():
    target = tiny_qwen3_target(vocab_size=96)
    draft = half_draft(target, seed=1).cuda()
    target = target.cuda()
    config = EngineConfig(max_batch=3, device="cuda", draft_candidates=8, draft_successors=4)
    plain = LLMEngine(target, None, EngineConfig(max_batch=1, device="cuda")).generate(
        [Request(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)])[0].token_ids
    engine = LLMEngine(target, draft, config)
    engine.capture_graphs()
    captured = engine.runner.captures
    hot = SamplingParams(0.8, top_k=20, top_p=0.9, seed=7)
    alone = engine.generate([Request(PROMPT, NEW_TOKENS, hot, ignore_eos=True)])[0].token_ids
    mixed = engine.generate([Request(PROMPT, NEW_TOKENS, s, ignore_eos=True)
                             for s in (SamplingParams(), hot, SamplingParams(1.0, seed=3))])
    assert mixed[0].token_ids == plain and mixed[1].token_ids == alone
    assert engine.runner.captures == captured and not engine.runner.uncapturable
