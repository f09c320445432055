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
from conftest import DEVICE, INTERPRETER_WARNINGS, gpu, on_backends, requires_triton
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import dspark.kernels as K
from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams
from dspark.engine.drafting import MAX_LOGIT_BIAS_TOKENS, RowSampling
from dspark.training.data import demo_pair, read_prompts

pytestmark = [pytest.mark.usefixtures("one_thread"), INTERPRETER_WARNINGS]

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


# ---------------------------------------------------------------------------- the op: Triton against the reference
# K.request_probabilities is the stage after the bias; the reference is the torch code above (vLLM's),
# the Triton backend cuts rows without sorting them (CPU: under TRITON_INTERPRET=1, V = 4096).

VOCAB = 4096
INF = float("inf")

# (temperature, top_k, top_p, min_p) per row: greedy (T 0, top_k 1), temperature only, top-k (incl.
# >= V, negative), top-p (1.0, tiny, wide on a flat row), min_p, all combined, a top-k past the
# filter's candidates with top-p inside it
ROWS = [(0.0, 0, 1.0, 0.0), (0.9, 1, 0.5, 0.1), (0.7, 0, 1.0, 0.0), (1.0, 50, 1.0, 0.0), (1.0, VOCAB, 0.9, 0.0),
        (1.2, 10**6, 1.0, 0.0), (1.0, -1, 0.8, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1e-6, 0.0), (0.8, 0, 1.0, 0.05),
        (1.3, 40, 0.9, 0.02), (0.6, 0, 0.5, 0.3), (1.0, 2000, 0.95, 0.0), (1.0, 0, 0.5, 0.0)]


def row_settings(rows: list[tuple], device=DEVICE) -> tuple:
    t, k, p, m = zip(*rows)
    return (torch.tensor(t, device=device), torch.tensor(k, dtype=torch.int32, device=device),
            torch.tensor(p, device=device), torch.tensor(m, device=device))


def request_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """N(0, 3^2) logits, a tenth of them masked (-inf: a grammar's, a bias'); the last row flat (its
    nucleus wide: the search's multi-program passes and the row program's continuation)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[torch.rand(rows, vocab, generator=g) < 0.1] = -INF
    logits[-1] = torch.randn(vocab, generator=g) * 0.05
    return logits


def assert_request_rows_equal(got, expected):
    """The same kept entries (these cases leave no boundary to fp32 rounding), kept probabilities to
    fp32 rounding (float64-accurate exps under the interpreter)."""
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, equal_nan=True)


@requires_triton
def test_request_probabilities_match_the_reference():
    logits = request_logits(len(ROWS)).to(DEVICE)
    reference, triton = on_backends(lambda: K.request_probabilities(logits, *row_settings(ROWS)))
    assert_request_rows_equal(triton, reference)
    assert (reference[:2] > 0).sum(-1).tolist() == [1, 1]  # the greedy rows are one-hot
    assert int((reference[8] > 0).sum()) == 1 and int((reference[3] > 0).sum()) == 50


@requires_triton
def test_request_probabilities_are_the_warpers_distributions():
    """Sampled rows (greedy is no warper) against transformers' warpers in vLLM's order, on the Triton
    backend: top-k, top-p, min_p, all three, min_p before top-p, a large top-k with top-p (a flat row)."""
    rows = [ROWS[i] for i in (3, 6, 9, 10, 11, 12)]
    logits = request_logits(len(rows), seed=1)
    with K.use_backend("triton"):
        got = K.request_probabilities(logits.to(DEVICE), *row_settings(rows)).cpu()
    for i, (t, k, p, m) in enumerate(rows):
        expected = transformers_probabilities(logits[i:i + 1], temperature=t, top_k=k if 0 < k < VOCAB else 0,
                                              top_p=p, min_p=m)[0]
        assert torch.equal(got[i] > 0, expected > 0), rows[i]
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-7, msg=str(rows[i]))


@requires_triton
def test_ties_at_the_boundaries_and_masked_rows_match_the_reference(monkeypatch):
    """Ties: top-k keeps every entry equal to the k-th; at the top-p cut the lower index stays first
    (all-equal rows: more tied entries than the search's bucket). Masked rows: one finite entry, and
    none (NaN, as a softmax of nothing; greedy: index 0, as argmax). No multi-program probe passes:
    every cut is the row program's (the other tests take the default passes)."""
    from dspark.kernels.triton import search

    monkeypatch.setattr(search, "SEARCH_PASSES", 0)
    logits = torch.zeros(7, VOCAB)
    logits[0, :6] = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.5, 2.0])  # top-k 2 keeps 3 and every 2
    logits[0, 6:] = -1.0
    logits[3, 1::2] = 1.0  # top-p inside a tie of 2048 entries
    logits[4, :] = -INF
    logits[4, 77] = 5.0
    logits[5:] = -INF
    rows = [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 0.3, 0.0), (1.0, 0, 0.6, 0.0), (1.0, 5, 0.5, 0.1),
            (1.0, 0, 0.9, 0.0), (0.0, 0, 1.0, 0.0)]
    logits = logits.to(DEVICE)
    reference, triton = on_backends(lambda: K.request_probabilities(logits, *row_settings(rows)))
    assert_request_rows_equal(triton, reference)
    assert (reference[0] > 0).nonzero().flatten().tolist() == [0, 2, 3, 5]
    assert (reference[1] > 0).nonzero().flatten().tolist() == list(range(2048))  # 0.5 of 4096 equal entries
    assert int((reference[2] > 0).sum()) == 1229  # ceil(0.3 * 4096), from index 0
    assert (reference[4] > 0).nonzero().flatten().tolist() == [77]
    assert bool(reference[5].isnan().all()) and reference[6].tolist() == [1.0] + [0.0] * (VOCAB - 1)


@requires_triton
def test_a_used_workspace_leaves_no_trace():
    """The nucleus search's start interval may hold fewer entries than its bound: only what the gather
    found is read, not the keys an earlier call left in the bucket."""
    workspace = K.Workspace()
    with K.use_backend("triton"):
        K.request_probabilities(torch.full((1, 3), 5.0, device=DEVICE), *row_settings([(1.0, 0, 0.5, 0.0)]),
                                workspace=workspace)
        logits, settings = torch.tensor([[0.0, 1.0, -1.0]], device=DEVICE), row_settings([(1.0, 0, 1e-6, 0.1)])
        got = K.request_probabilities(logits, *settings, workspace=workspace)
    assert got.tolist() == [[0.0, 1.0, 0.0]]


@requires_triton
def test_rows_the_candidates_decide_reach_no_search(monkeypatch):
    """LLM-like rows (16 hot tokens over a Gaussian tail): a top-k within the 128 candidates and a
    nucleus inside them are cut from the candidates, exactly as the reference cuts them; no row is
    left to the value-space search."""
    from dspark.kernels.triton import request

    searching = []
    narrow = request.tsearch.narrow
    monkeypatch.setattr(request.tsearch, "narrow", lambda *a: searching.append(int((a[-2] == 2).sum())) or narrow(*a))
    g = torch.Generator().manual_seed(7)
    rows = [(1.0, 50, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 40, 0.9, 0.02), (0.8, 0, 0.95, 0.05), (1.0, 3, 0.5, 0.0)]
    logits = torch.randn(len(rows), VOCAB, generator=g) * 2
    logits.scatter_add_(1, torch.randint(0, VOCAB, (len(rows), 16), generator=g),
                        torch.rand(len(rows), 16, generator=g) * 4 + 10)
    logits = logits.to(DEVICE)
    reference, triton = on_backends(lambda: K.request_probabilities(logits, *row_settings(rows)))
    assert_request_rows_equal(triton, reference)
    assert searching == [0, 0]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_request_probabilities_apply_batch_settings_to_each_position(backend):
    """``[B, L, V]`` logits (a verify window): row b's settings on each of its L rows."""
    logits = request_logits(6, 64, seed=2).to(DEVICE)
    rows = [ROWS[10], ROWS[11]]
    with K.use_backend(backend):
        got = K.request_probabilities(logits.view(2, 3, 64), *row_settings(rows))
        each = K.request_probabilities(logits, *row_settings([rows[0]] * 3 + [rows[1]] * 3))
    assert torch.equal(got.view(6, 64), each)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_request_probabilities_add_the_bias_first(backend):
    """``logit_bias`` ``[B, V]`` gives what adding it beforehand gives, bit for bit, at every position of
    a verify window (the Triton backend adds it in its first pass); it moves a greedy row's argmax."""
    logits = request_logits(6, 64, seed=5).to(DEVICE).view(3, 2, 64)
    rows = [ROWS[0], ROWS[10], ROWS[11]]
    bias = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)) * 3
    bias[0, 7] = 100.0
    bias = bias.to(DEVICE)
    with K.use_backend(backend):
        fused = K.request_probabilities(logits, *row_settings(rows), logit_bias=bias)
        apart = K.request_probabilities(logits + bias[:, None], *row_settings(rows))
    assert torch.equal(fused, apart)
    assert fused[0, :, 7].tolist() == [1.0, 1.0]


def test_request_probabilities_bad_input_names_the_argument():
    logits = torch.randn(2, 16)
    t, k, p, m = row_settings(ROWS[:2], "cpu")
    with pytest.raises(TypeError, match="request_probabilities: top_k must have dtype"):
        K.request_probabilities(logits, t, k.float(), p, m)
    with pytest.raises(ValueError, match=r"request_probabilities: min_p must have shape \[2\], got \[1\]"):
        K.request_probabilities(logits, t, k, p, m[:1])
    with pytest.raises(TypeError, match="request_probabilities: logits must have dtype"):
        K.request_probabilities(logits.double(), t, k, p, m)
    with pytest.raises(ValueError, match=r"request_probabilities: logit_bias must have shape \[2, 16\], got \[1, 16\]"):
        K.request_probabilities(logits, t, k, p, m, logit_bias=torch.zeros(1, 16))


def kept_set_differences_are_rounding(logits, rows, got, expected, margin=1e-5):
    """Rows whose kept sets differ; every differing entry must sit on a boundary fp32 rounding decides:
    ``exp(x - max)`` within ``10 * margin`` (relative: a few ulps of x) of min_p, or the normalised mass
    ranked at or below it (float64) within ``margin`` of ``1 - top_p``."""
    differ = ((got > 0) != (expected > 0)).nonzero().tolist()
    for r, i in differ:
        t, k, p, m = rows[r]
        x = (logits[r] / t).double()
        w = torch.exp(x - x.max())
        kept = w >= m
        if 1 < k < len(x):
            kept &= x >= x[kept].topk(k).values[-1] if int(kept.sum()) >= k else kept
        mass = torch.where(kept, w, 0.0)
        below = (x < x[i]) | ((x == x[i]) & (torch.arange(len(x)) >= i))
        tail = float(mass[below].sum() / mass.sum())
        near_min_p = m > 0 and abs(float(w[i]) / m - 1) < 10 * margin
        assert near_min_p or abs(tail - (1 - p)) < margin, (r, i, rows[r], tail)
    return {r for r, _ in differ}


@requires_triton
@gpu
def test_real_size_request_probabilities_match_the_reference():
    """512 rows (64 requests x 8 verify positions) of 151 936 entries, every kind of setting mixed."""
    vocab = 151936
    rows = [ROWS[i % len(ROWS)] for i in range(512)]
    logits = request_logits(len(rows), vocab, seed=3)
    rows = [(t, vocab if k == VOCAB else k, p, m) for t, k, p, m in rows]
    reference, triton = on_backends(lambda: K.request_probabilities(logits.cuda(), *row_settings(rows)))
    reference, triton = reference.cpu(), triton.cpu()
    differ = kept_set_differences_are_rounding(logits, rows, triton, reference)
    assert len(differ) <= 5
    same = [r for r in range(len(rows)) if r not in differ]
    torch.testing.assert_close(triton[same], reference[same], rtol=1e-4, atol=1e-8)


@requires_triton
@gpu
def test_request_probabilities_replay_as_a_cuda_graph():
    rows = ROWS * 4
    logits = request_logits(len(rows), 151936, seed=4).cuda()
    settings = row_settings(rows)
    workspace = K.Workspace()
    with K.use_backend("triton"):
        eager = K.request_probabilities(logits, *settings, workspace=workspace)  # compiles, sizes the workspace
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = K.request_probabilities(logits, *settings, workspace=workspace)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


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
