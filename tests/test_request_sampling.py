"""A request's sampling as vLLM's sampler and transformers' warpers define it (``RowSampling``):
logit_bias, temperature, min_p, top-k (ties kept) and the standard top-p (the boundary token kept
whole), in vLLM's order. The oracle is transformers' own processors, run on the same logits; the
kernels' mass-clipped top-p (``K.logits_to_probabilities``, kept for kernel callers) is what the
requests no longer get. Through the engine: greedy with a logit bias equals transformers'
``generate()`` with a ``SequenceBiasLogitsProcessor`` on the demo pair, with and without the drafter
(the sampled engine against the warpers: test_lossless_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import dspark.kernels as K
from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams
from dspark.engine.drafting import MAX_LOGIT_BIAS_TOKENS, RowSampling
from dspark.training.data import demo_pair, read_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ISSUE_LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])


def transformers_warpers(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=None) -> LogitsProcessorList:
    """transformers' processors in vLLM's sampler order: bias, temperature, min_p, top-k, top-p."""
    procs = []
    if logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(i,): b for i, b in logit_bias.items()}))
    procs.append(TemperatureLogitsWarper(temperature))
    if min_p > 0:
        procs.append(MinPLogitsWarper(min_p))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(procs)


def transformers_probabilities(logits: torch.Tensor, **settings) -> torch.Tensor:
    """The warpers' distribution of each row of f32 logits ``[R, V]``."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return transformers_warpers(**settings)(ids, logits.clone()).softmax(-1)


def batch_rows(settings: list[dict], vocab: int) -> RowSampling:
    """One ``RowSampling`` of a row per settings dict (temperature 1 unless given)."""
    rows = [SamplingParams(**{"temperature": 1.0, **s}).rows(1, "cpu", vocab) for s in settings]
    bias = torch.cat([torch.zeros(1, vocab) if r.logit_bias is None else r.logit_bias for r in rows])
    return RowSampling(*(torch.cat([getattr(r, f) for r in rows]) for f in ("temperature", "top_k", "top_p", "min_p")),
                       bias)


def ours(logits: torch.Tensor, **settings) -> torch.Tensor:
    rows = SamplingParams(**{"temperature": 1.0, **settings}).rows(logits.shape[0], logits.device, logits.shape[-1])
    return rows.probabilities(logits)


@pytest.mark.parametrize("top_p, kernel_tv", [(0.5, 0.22), (0.7, 0.15), (0.9, 0.02)])
def test_top_p_keeps_the_boundary_token_whole(top_p, kernel_tv):
    """Issue 38's case: a request's top-p is transformers' ``TopPLogitsWarper``; the kernels'
    mass-clipped nucleus is not (TV 0.22 / 0.15 / 0.02 from it)."""
    expected = transformers_probabilities(ISSUE_LOGITS, top_p=top_p)
    torch.testing.assert_close(ours(ISSUE_LOGITS, top_p=top_p), expected, rtol=1e-6, atol=1e-7)
    clipped = K.logits_to_probabilities(ISSUE_LOGITS, 1.0, 0, top_p)
    assert abs(0.5 * float((clipped - expected).abs().sum()) - kernel_tv) < 0.006


SETTINGS = [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2),
            dict(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05), dict(temperature=0.6, min_p=0.3, top_p=0.5),
            dict(temperature=1.0, top_k=3, logit_bias={7: 4.0, 0: -100.0, 31: 2.5}),
            dict(temperature=0.9, top_p=0.7, min_p=0.1, logit_bias={1: -3.0, 63: 6.0})]


def test_mixed_rows_each_follow_their_own_warpers():
    """One batch of rows with every setting: each row is transformers' distribution for its own
    settings (min_p before top-p: the order changes what top-p sees)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(SETTINGS), 64, generator=g) * 3
    got = batch_rows(SETTINGS, 64).probabilities(logits)
    for i, settings in enumerate(SETTINGS):
        expected = transformers_probabilities(logits[i:i + 1], **settings)[0]
        assert torch.equal(got[i] > 0, expected > 0), settings
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-7, msg=str(settings))


def test_min_p_runs_before_top_p_as_vllm():
    """(0.4, 0.3, 0.2, 0.1), min_p 0.6 keeps {0.4, 0.3}; top-p 0.5 over those keeps the first only
    (vLLM). transformers' default order (top-p, then min_p) would keep both."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    torch.testing.assert_close(ours(logits, min_p=0.6, top_p=0.5), torch.tensor([[1.0, 0, 0, 0]]))


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    expected = transformers_probabilities(logits, top_k=2)
    assert int((expected > 0).sum()) == 3
    torch.testing.assert_close(ours(logits, top_k=2), expected)


def test_greedy_is_the_argmax_of_the_biased_logits():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [1.0, 5.0, 5.0, 2.0]])
    for settings, index in ((dict(temperature=0.0), 1), (dict(temperature=0.0, logit_bias={3: 3.5}), 3),
                            (dict(temperature=0.9, top_k=1, logit_bias={0: 10.0}), 0)):
        expected = torch.zeros(2, 4)
        expected[:, index] = 1
        assert torch.equal(ours(logits, **settings), expected), settings


def test_verify_rows_take_their_batch_rows_settings():
    """``[B, L, V]`` logits (a verify window): row b's settings and bias on each of its L rows."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 32, generator=g) * 2
    settings = [dict(temperature=0.8, top_p=0.6, logit_bias={4: 3.0}), dict(temperature=1.2, min_p=0.1, top_k=9)]
    got = batch_rows(settings, 32).probabilities(logits)
    for b, s in enumerate(settings):
        torch.testing.assert_close(got[b], transformers_probabilities(logits[b], **s), rtol=1e-5, atol=1e-7)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams: min_p must be in \[0.0, 1.0\], got 1.5"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100.0, 100.0\], got 101.0"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(TypeError, match="logit_bias token id must be an int, got str"):
        SamplingParams(logit_bias={"3": 1.0})
    with pytest.raises(ValueError, match="logit_bias token id must be in"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="names token id 3 twice"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)])
    with pytest.raises(ValueError, match=f"at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {MAX_LOGIT_BIAS_TOKENS + 1}"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)})
    assert SamplingParams(logit_bias={5: 1, 2: -2.5}).logit_bias == ((2, -2.5), (5, 1.0))


# ---------------------------------------------------------------------------- through the engine

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def demo():
    """(demo pair, transformers' float32 target, a prompt's ids, transformers' plain greedy output)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    model = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()
    prompt = tokenizer(read_prompts(str(pair.prompts))[0]["text"][:120])["input_ids"]
    return pair, model, prompt, transformers_greedy(model, prompt)


def transformers_greedy(model, prompt, processors=None) -> list[int]:
    """transformers' greedy ``generate()`` with ``processors``: the oracle nobody here wrote."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0, logits_processor=processors)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("drafter", [True, False], ids=["speculative", "plain"])
def test_greedy_with_logit_bias_equals_transformers(demo, drafter):
    """A banned token, a pushed one and small nudges: the output is transformers' greedy decoding
    with the same bias, token for token, next to a plain greedy and a sampled request in the same
    batch (whose output is the same in another batch)."""
    pair, model, prompt, plain = demo
    bias = {plain[3]: -100.0, plain[8]: -5.0, 7: 3.0, 100: 8.0}
    expected = transformers_greedy(model, prompt, LogitsProcessorList([SequenceBiasLogitsProcessor(
        {(i,): b for i, b in bias.items()})]))
    assert expected != plain
    engine = LLMEngine(str(pair.target), str(pair.draft) if drafter else None,
                       EngineConfig(max_batch=4, max_model_len=256))
    sampled = Request(prompt, NEW_TOKENS, SamplingParams(0.8, top_p=0.7, min_p=0.1, seed=3, logit_bias={9: 2.0}),
                      ignore_eos=True)
    out = engine.generate([Request(prompt, NEW_TOKENS, SamplingParams(logit_bias=bias), ignore_eos=True),
                           Request(prompt, NEW_TOKENS, SamplingParams(), ignore_eos=True), sampled])
    assert out[0].token_ids == expected
    assert out[1].token_ids == plain
    # the rows are reused: a request seated where a biased one ran carries no trace of its bias
    again = engine.generate([Request(prompt, NEW_TOKENS, SamplingParams(), ignore_eos=True), sampled])
    assert again[0].token_ids == plain and again[1].token_ids == out[2].token_ids


def test_logit_bias_ids_outside_the_vocabulary_are_refused(demo):
    pair = demo[0]
    engine = LLMEngine(str(pair.target), None, EngineConfig(max_batch=1, max_model_len=64))
    with pytest.raises(ValueError, match=r"add_request: logit_bias holds token id 2048, outside the target's "
                                         r"vocabulary \[0, 2048\)"):
        engine.add_request(Request([1, 2], 4, SamplingParams(logit_bias={2048: 1.0})))


@gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_cuda_graphs_replay_any_mix_of_biases_and_filters(demo, tree):
    """On CUDA with every graph captured up front: greedy with a bias is transformers' (float32), a
    plain greedy request beside it stays plain greedy, a sampled request with a bias, min_p and top_p
    gives the same tokens alone and in the mixed batch, and no step captures a graph."""
    pair, model, prompt, plain = demo
    bias = {plain[3]: -100.0, plain[8]: -5.0, 7: 3.0, 100: 8.0}
    expected = transformers_greedy(model, prompt, LogitsProcessorList([SequenceBiasLogitsProcessor(
        {(i,): b for i, b in bias.items()})]))
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(
        max_batch=4, max_model_len=256, device="cuda", dtype=torch.float32, draft_top_k=2 if tree else 1))
    engine.capture_graphs()
    captured = engine.runner.captures
    hot = SamplingParams(0.8, top_k=50, top_p=0.7, min_p=0.05, seed=3, logit_bias={9: 2.0, plain[1]: -1.0})
    alone = engine.generate([Request(prompt, NEW_TOKENS, hot, ignore_eos=True)])[0].token_ids
    out = engine.generate([Request(prompt, NEW_TOKENS, SamplingParams(logit_bias=bias), ignore_eos=True),
                           Request(prompt, NEW_TOKENS, SamplingParams(), ignore_eos=True),
                           Request(prompt, NEW_TOKENS, hot, ignore_eos=True)])
    assert out[0].token_ids == expected
    assert out[1].token_ids == plain
    assert out[2].token_ids == alone
    assert engine.runner.captures == captured and not engine.runner.uncapturable
