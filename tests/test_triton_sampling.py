"""Triton kernels of the sampled path vs the PyTorch reference (uniforms, probabilities, samplers, the
fused Markov sampler, probabilistic accept).

On the CPU these run under ``TRITON_INTERPRET=1`` with small shapes (V = 1000 and 4099, multiples of
no tile; V = 16 for the statistics); on a GPU the same tests run compiled, plus ``gpu`` tests at
V = 151936 and a CUDA-graph replay of a sampled round.

Tolerances and the boundary rule:
* uniforms bit for bit; accept lengths and every non-sampled id exactly;
* probabilities ``atol = 2e-6`` (fp32 normalisers in the kernels, float64 in the reference); the
  Markov GEMM sums R products in another order, so real-size rows (R = 256, |z| ~ 25) get
  ``rtol = 1e-4``;
* sampled tokens: a Triton draw is checked against NVIDIA's walk (the reference's, bit-exact) ON THE
  SAME probabilities. The kernels' inverse-CDF walk is a parallel (pairwise) prefix sum, NVIDIA's a
  sequential fp32 sum, so the tokens may differ exactly where the two cannot agree: the threshold lies
  within ``BOUNDARY`` = 1e-6 of a running sum, or the exact (float64) and the sequential fp32 running
  sums fall on different sides of it (at V = 151936 the sequential sum strays by ~1e-5). The fused
  sampler computes its chunk masses from softmax partials (GPU ``exp`` is approximate): 3e-6 there.
  A differing token must still have positive mass.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, gpu, requires_triton
from statistics_cases import assert_distribution, assert_rate, draws_for, forced_prefix_case, uniforms

import dspark.kernels as K
import sampling_cases as cases
from dspark.kernels.reference import sampling as R
from dspark.kernels.triton import accept as TA
from dspark.kernels.triton import sampling as TS

# The interpreter evaluates masked lanes too (-inf - -inf, 0 / 0): numpy warns, the lanes are discarded.
pytestmark = [requires_triton, pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")]

I32 = torch.int32
ATOL = 2e-6


def on_backends(run):
    """``run()`` under the reference and then the Triton backend: ``(reference, triton)`` results."""
    results = []
    for name in ("reference", "triton"):
        with K.use_backend(name):
            results.append(run())
    return results


def f32(values):
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


def i32(values):
    return torch.tensor(values, dtype=I32, device=DEVICE)


BOUNDARY, FUSED_BOUNDARY = 1e-6, 3e-6


def legit_mismatch(weights, u, scaled, window):
    """bool ``[N]``: rows where an accurate walk may pick another token than NVIDIA's sequential fp32
    walk over ``weights`` ``[N, V]`` at ``u`` ``[N]`` (``scaled`` ``[N]``: threshold ``u * total``, the
    residual draw): a running sum within ``window`` (relative to the total when scaled) of the
    threshold, or exact and sequential running sums on different sides of it."""
    w = R._positive(weights.float().cpu())
    sequential = R._sequential_prefix(w).double()
    exact = w.double().cumsum(-1)
    u, scaled = R.clamp_uniform(u.float().cpu()), scaled.cpu()
    t_exact = torch.where(scaled, u.double() * exact[:, -1], u.double())[:, None]
    t_sequential = torch.where(scaled, u * sequential[:, -1].float(), u).double()[:, None]  # fl32(t * S)
    unit = torch.where(scaled, exact[:, -1], torch.ones_like(exact[:, -1]))[:, None] * window
    near = ((exact - t_exact).abs() <= unit) | ((sequential - t_sequential).abs() <= unit)
    return (near | ((exact > t_exact) != (sequential > t_sequential))).any(-1)


def assert_tokens_agree(expected, actual, weights, u, scaled=None, window=BOUNDARY):
    """Tokens drawn from ``weights`` [N, V] at ``u`` [N]: equal to NVIDIA's walk (``expected``) except on
    rows where ``legit_mismatch`` allows it, and then still a token with positive weight."""
    differ = (expected != actual).cpu()
    if not bool(differ.any()):
        return
    scaled = torch.zeros_like(differ) if scaled is None else scaled.cpu()
    rows = weights.cpu()[differ]
    allowed = legit_mismatch(rows, u.cpu()[differ], scaled[differ], window)
    assert bool(allowed.all()), f"tokens differ where NVIDIA's walk is unambiguous: rows {differ.nonzero().tolist()}"
    mass = rows.gather(1, actual.cpu()[differ].long().clamp(0, weights.shape[1] - 1)[:, None])
    assert bool((mass > 0).all()), "a token without mass was drawn"


# ------------------------------------------------------------------------------ fill_uniforms


@pytest.mark.parametrize("seed, offset", [(1234, 56), (cases.RUNTIME_SEED, 0), ((1 << 64) - 1, (1 << 64) - 1),
                                          (1 << 63, 12345), (7, 1 << 62)])
def test_fill_uniforms_bit_exact(seed, offset):
    reference, triton = on_backends(lambda: K.fill_uniforms(3001, seed, offset, device=DEVICE))
    assert torch.equal(reference, triton)


def test_fill_uniforms_spec_vectors():  # NVIDIA test 4 + kernels.md 3.10
    with K.use_backend("triton"):
        first, again = K.fill_uniforms(16, 1234, 56, DEVICE), K.fill_uniforms(16, 1234, 56, DEVICE)
        runtime = K.fill_uniforms(4, cases.RUNTIME_SEED, 0, DEVICE)
        assert K.fill_uniforms(0, 1, 2, DEVICE).shape == (0,)
    assert torch.equal(first, again) and bool(((first >= 0) & (first < 1)).all())
    assert (first[:4].double() * 2**24).long().tolist() == [0xB347FF, 0x6F9C3F, 0x4778E0, 0xDD968C]
    torch.testing.assert_close(runtime.double().cpu(), torch.tensor([0.28777933, 0.12491786, 0.29045409, 0.52624941],
                                                                    dtype=torch.float64), atol=5e-9, rtol=0)


# ------------------------------------------------------------------------------ logits_to_probabilities


@pytest.mark.parametrize("logits, temperature, top_k, top_p, expected", [
    ([3, 2, 1, 0], 1.0, 2, 1.0, [0.7310586, 0.2689414, 0, 0]),  # NVIDIA test 1
    ([-1, 0.5, 4, 3], 0.0, 0, 0.5, [0, 0, 1, 0]),  # NVIDIA test 3
    ([3, 2, 1, 0, -1], 1.0, 3, 0.9, [0.7391566, 0.2608434, 0, 0, 0]),
    ([-0.6931472, -1.2039728, -1.89712, -2.9957323], 1.0, 0, 0.75, [0.6666667, 0.3333333, 0, 0]),
    ([3, 2, 1, 0, -1], 0.5, 0, 1.0, [0.864704, 0.117025, 0.015838, 0.002143, 0.000290]),
])
def test_logits_to_probabilities_spec_vectors(logits, temperature, top_k, top_p, expected):
    with K.use_backend("triton"):
        probs = K.logits_to_probabilities(f32([logits]), temperature, top_k, top_p)
    torch.testing.assert_close(probs, f32([expected]), atol=1e-5, rtol=0)


FILTERS = [(1.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 5, 1.0), (0.8, 50, 0.9), (1.0, 0, 0.9), (0.0, 0, 1.0),
           (1.0, 200, 1.0), (0.8, 200, 0.9)]


@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_logits_to_probabilities_matches_reference(vocab, temperature, top_k, top_p):
    logits = cases.random_logits(3, vocab, neg_inf_fraction=0.05, seed=vocab + top_k, device=DEVICE)
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("passes", [0, 1, TS.SEARCH_PASSES])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.3), (300, 0.95), (2000, 1.0)])
def test_wide_nucleus_and_large_top_k_are_searched_exactly(top_k, top_p, passes, monkeypatch):
    """Flat rows put the cut far beyond the 128 candidates: the value-space search decides it, from
    any point where the multi-program passes hand over to the one-program-per-row finish."""
    monkeypatch.setattr(TS, "SEARCH_PASSES", passes)
    logits = cases.random_logits(3, 4099, scale=0.3, seed=top_k, device=DEVICE)
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, 1.0, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.9), (1.0, 5, 1.0), (1.0, 300, 0.9), (0.0, 0, 1.0),
                                                       (1.0, 0, 0.3), (1.0, 0, 1.0)])
def test_ties_and_degenerate_rows_match_reference(temperature, top_k, top_p):
    """Ties rank by index (more tied entries than the search's bucket: all-equal rows); rows without a
    finite normaliser (all -inf, a NaN, +inf) are uniform; -inf entries get no mass."""
    vocab = 4099
    logits = torch.zeros(6, vocab)
    logits[1, ::2] = 1.0
    logits[2] = float("-inf")
    logits[3, 7] = float("nan")
    logits[4, 5] = float("inf")
    logits[5, 100:] = float("-inf")
    logits = logits.to(DEVICE)
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)
    assert float(triton[5, 100:].abs().sum()) == 0.0


# ------------------------------------------------------------------------------ dense and sparse draws


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_sample_probability_rows_matches_reference(batch, vocab):
    probs = cases.random_distributions((batch,), vocab, seed=batch * vocab, device=DEVICE)
    u = torch.rand(batch, 4, generator=cases.generator(batch)).to(DEVICE)
    u[0, 3] = 0.99999994  # beyond the fp32 total of some rows: the last positive index

    def run():
        ids = torch.full((batch, 4), -1, dtype=I32, device=DEVICE)
        for step in range(4):
            K.sample_probability_rows(probs, u, ids, step)
        return ids

    reference, triton = on_backends(run)
    for step in range(4):
        assert_tokens_agree(reference[:, step], triton[:, step], probs, u[:, step])


def test_sample_probability_rows_edge_rows():
    """One-hot at the last entry (tail of the last tile), an all-zero row, NaN and negative entries
    (skipped), mass below one with a uniform beyond it, NaN and out-of-range uniforms."""
    vocab = 1000
    probs = torch.zeros(6, vocab)
    probs[0, vocab - 1] = 1.0
    probs[2, :4] = torch.tensor([float("nan"), -0.5, 0.25, 0.75])
    probs[3, [10, 500, 900]] = 0.3  # total 0.9
    probs[4, 3] = probs[5, 4] = 1.0
    probs = probs.to(DEVICE)
    u = f32([[0.99999994], [0.5], [0.2], [0.95], [float("nan")], [-3.0]])

    def run():
        ids = torch.full((6, 1), -1, dtype=I32, device=DEVICE)
        K.sample_probability_rows(probs, u, ids, 0)
        return ids[:, 0]

    reference, triton = on_backends(run)
    assert triton.tolist() == reference.tolist() == [vocab - 1, 0, 2, 900, 3, 4]


def test_sparse_top_k_sample_stores_distribution():  # NVIDIA test 9
    width = 2
    tokens, probs, ids = torch.zeros(1, width, dtype=I32), torch.zeros(1, width, 2), torch.zeros(1, width, 2, dtype=I32)
    tokens, probs, ids = tokens.to(DEVICE), probs.to(DEVICE), ids.to(DEVICE)
    u = f32([[0.0, 0.99]])
    with K.use_backend("triton"):
        for step, (values, indices) in enumerate([([2, 1], [1, 2]), ([3, 1], [2, 3])]):
            K.sample_top_k_rows_and_store(f32([values]), i32([indices]), u, tokens, probs, ids, step, 1.0)
    assert tokens.tolist() == [[1, 3]] and ids.flatten().tolist() == [1, 2, 2, 3]
    torch.testing.assert_close(probs.flatten(), f32([0.7310586, 0.2689414, 0.8807971, 0.1192029]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [5, 50, 200, 1500])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_top_k_rows_match_reference(k, temperature):
    case = cases.top_k_step_inputs(8, 3, k, 4099, seed=k, device=DEVICE)
    case["top_k_values"][1] = float("-inf")  # degenerate: 1/K

    def run():
        buffers = {name: case[name].clone() for name in ("draft_token_ids", "draft_top_k_probabilities",
                                                         "draft_top_k_indices")}
        K.sample_top_k_rows_and_store(case["top_k_values"], case["top_k_indices"], case["proposal_uniforms"],
                                      step=1, temperature=temperature, **buffers)
        return K.normalize_top_k_rows(case["top_k_values"], temperature), buffers

    (ref_norm, reference), (tri_norm, triton) = on_backends(run)
    torch.testing.assert_close(tri_norm, ref_norm, atol=ATOL, rtol=0)
    torch.testing.assert_close(triton["draft_top_k_probabilities"], reference["draft_top_k_probabilities"],
                               atol=ATOL, rtol=0)
    assert torch.equal(triton["draft_top_k_indices"], reference["draft_top_k_indices"])
    probs, ids = triton["draft_top_k_probabilities"][:, 1], case["top_k_indices"]
    expected = R.sample_from_sparse_probs(probs.cpu(), ids.cpu(), case["proposal_uniforms"][:, 1].cpu())
    tokens = triton["draft_token_ids"][:, 1].cpu()
    positions = (ids.cpu() == tokens[:, None]).int().argmax(1)  # ids are distinct
    expected_positions = (ids.cpu() == expected[:, None]).int().argmax(1)
    assert_tokens_agree(expected_positions, positions, probs, case["proposal_uniforms"][:, 1])


def test_store_draft_step_probabilities_copies_the_row():
    scratch = torch.rand(3, 4099, generator=cases.generator(1)).to(DEVICE)

    def run():
        probs = torch.zeros(3, 4, 4099, device=DEVICE)
        K.store_draft_step_probabilities(scratch, probs, 2)
        return probs

    reference, triton = on_backends(run)
    assert torch.equal(reference, triton)


# ------------------------------------------------------------------------------ fused Markov sampler


def test_vanilla_markov_sample_nvidia_vector_5():
    case = {"backbone_logits": f32([[0, 2, 1, -1], [0, 0, 3, 1]]),
            "markov_w1": torch.zeros(4, 1, dtype=torch.float16, device=DEVICE),
            "markov_w2": torch.zeros(4, 1, dtype=torch.float16, device=DEVICE), "first_prev_tokens": i32([0]),
            "proposal_uniforms": f32([[0.0, 0.99]])}
    with K.use_backend("triton"):
        tokens, probs = K.vanilla_markov_sample(**case, temperature=1.0, top_k=2)
        plain_tokens, plain_probs = K.vanilla_markov_sample(**case, temperature=1.0)  # the unfiltered path
    assert tokens.tolist() == [[1, 3]]
    torch.testing.assert_close(probs, f32([[[0, 0.7310586, 0.2689414, 0], [0, 0, 0.8807971, 0.1192029]]]),
                               atol=1e-6, rtol=0)
    with K.use_backend("reference"):
        expected_tokens, expected_probs = K.vanilla_markov_sample(**case, temperature=1.0)
    assert torch.equal(plain_tokens, expected_tokens)
    torch.testing.assert_close(plain_probs, expected_probs, atol=1e-6, rtol=0)


MARKOV_CASES = [  # batch, width, vocab, rank, dtype, temperature, top_k, top_p, stride, offset
    (3, 4, 1000, 16, torch.float16, 0.8, 0, 1.0, 0, 0),
    (1, 7, 4099, 64, torch.bfloat16, 1.0, 0, 0.9, 8, 1),
    (8, 1, 1000, 8, torch.float16, 0.0, 0, 1.0, 0, 0),
    (3, 4, 4099, 256, torch.float16, 0.8, 50, 0.9, 5, 1),
    (8, 4, 1000, 16, torch.bfloat16, 1.0, 5, 1.0, 0, 0),
    (3, 7, 1000, 8, torch.float16, 1.0, 200, 1.0, 0, 0),
]


def check_markov_round(batch, width, vocab, rank, dtype, temperature, top_k, top_p, stride, offset, seed=0,
                       rtol=1e-5):
    """Triton's round: each step's probabilities vs the reference step re-run on Triton's own earlier
    tokens (so a legal boundary choice does not change what later steps see), each token vs NVIDIA's
    walk over the probabilities Triton stored."""
    case = cases.markov_sample_inputs(batch, width, vocab, rank, dtype=dtype, logits_stride=stride,
                                      logits_offset=offset, seed=seed, device=DEVICE)
    filters = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    with K.use_backend("triton"):
        tokens, probs = K.vanilla_markov_sample(**case, **filters)
    uniforms_ = case.pop("proposal_uniforms")
    for step in range(width):
        ref_tokens, ref_probs = tokens.clone(), torch.zeros_like(probs)
        with K.use_backend("reference"):
            K.markov_sample_step(**case, proposal_uniforms=uniforms_, draft_token_ids=ref_tokens,
                                 draft_probabilities=ref_probs, step=step, **filters)
        torch.testing.assert_close(probs[:, step], ref_probs[:, step], atol=ATOL, rtol=rtol)
        expected = R.sample_from_probs(probs[:, step], uniforms_[:, step])
        assert_tokens_agree(expected, tokens[:, step], probs[:, step], uniforms_[:, step], window=FUSED_BOUNDARY)


@pytest.mark.parametrize("case", MARKOV_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_markov_sampler_matches_reference(case):
    check_markov_round(*case)


def test_markov_sample_step_fills_only_its_step():
    case = cases.markov_sample_inputs(3, 4, 1000, 16, seed=3, device=DEVICE)
    uniforms_ = case.pop("proposal_uniforms")
    tokens = torch.full((3, 4), -5, dtype=I32, device=DEVICE)
    tokens[:, 0] = i32([1, 2, 3])
    probs = torch.full((3, 4, 1000), -1.0, device=DEVICE)
    with K.use_backend("triton"):
        K.markov_sample_step(**case, proposal_uniforms=uniforms_, draft_token_ids=tokens, draft_probabilities=probs,
                             step=1, temperature=0.8, top_k=50, top_p=0.9)
    assert bool((tokens[:, 2:] == -5).all()) and tokens[:, 0].tolist() == [1, 2, 3]
    assert bool((probs[:, [0, 2, 3]] == -1).all()) and bool((tokens[:, 1] >= 0).all())
    torch.testing.assert_close(probs[:, 1].sum(-1), torch.ones(3, device=DEVICE), atol=1e-5, rtol=0)


def test_bad_token_ids_are_clamped_not_read_out_of_range():
    """On the GPU ids are not validated (no host sync): the backends clamp them before addressing."""
    vocab = 1000
    case = cases.markov_sample_inputs(2, 2, vocab, 16, seed=4, device=DEVICE)
    bad, clamped = i32([vocab + 7, -2]), i32([vocab - 1, 0])
    runs = []
    for first in (bad, clamped):
        tokens = torch.zeros(2, 2, dtype=I32, device=DEVICE)
        probs = torch.zeros(2, 2, vocab, device=DEVICE)
        TS.markov_sample_step(case["backbone_logits"].reshape(-1, vocab), case["markov_w1"], case["markov_w2"], first,
                              case["proposal_uniforms"], tokens, probs, 0, 1.0, 0, 1.0, 2, 0)
        runs.append((tokens, probs))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    target = cases.random_distributions((2, 2), vocab, seed=5, device=DEVICE)
    draft = cases.random_distributions((2, 1), vocab, seed=6, device=DEVICE)
    accepted, length = TA.probabilistic_accept(target, draft, i32([[vocab + 3], [-9]]), i32([1, 1]),
                                               torch.zeros(2, 3, device=DEVICE), 1)
    assert length.tolist() in ([1, 1], [2, 1], [1, 2], [2, 2])
    assert bool(((accepted[:, -1] >= 0) & (accepted[:, -1] < vocab)).all())


# ------------------------------------------------------------------------------ probabilistic accept


@pytest.mark.parametrize("target, draft, tokens, u, p_v, lengths, expected", [
    ([[.1, .8, .05, .05], [.5, .2, .1, .2], [.25] * 4], [[.2, .4, .2, .2], [.2, .3, .5, 0]], [1, 2],
     [0.5, 0.9, 0.0, 0.7, 0.0], 2, [2], ([1, 3, 0], 2)),  # NVIDIA test 7
    ([[.1, .8, .05, .05], [.1, .2, .6, .1], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.2, .2, .2, .4]], [1, 2],
     [.9, .9, 0, 0, .75], 2, [2], ([1, 2, 3], 3)),  # NVIDIA test 8
    ([[.1, .8, .05, .05], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.25] * 4], [1, 2], [0.9, 0, 0, 0, 0.75], 1, [1],
     ([1, 3], 2)),  # NVIDIA test 13
    ([[.7, .3, 0, 0], [.6, .4, 0, 0]], [[.2, .8, 0, 0]], [2], [0.0, 0.5, 0.5], 1, [1], ([0, 0], 1)),  # NVIDIA 16
    ([[.5, .5, 0], [0, 0, 1]], [[1, 0, 0]], [1], [0.99999994, 0, 0.3], 1, [1], ([1, 2], 2)),  # q = 0: accept
    ([[.5, .5, 0], [1, 0, 0]], [[.5, .5, 0]], [2], [0.0, 0.6, 0.0], 1, [1], ([1, 0], 1)),  # p == q: draw p
    ([[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 0, 1]], [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, [0],
     ([1, 2, 0], 2)),  # proposal length 0 walks one draft
    ([[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 0, 1]], [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, [9],
     ([1, 2, 0], 3)),  # a length beyond P_v walks P_v
])
def test_probabilistic_accept_vectors(target, draft, tokens, u, p_v, lengths, expected):
    with K.use_backend("triton"):
        accepted, length = K.probabilistic_accept(f32([target]), f32([draft]), i32([tokens]), i32(lengths), f32([u]),
                                                  p_v)
    assert (accepted[0].tolist(), int(length[0])) == expected


def drawn_rows(case, lengths):
    """Per batch row, the walk that drew the last emitted token: ``(weights [B, V], u [B], scaled [B])``
    -- the residual ``max(p - q, 0)`` with threshold ``u * total`` after a rejection (plain p when that
    has no mass), else the bonus row of the target."""
    target, draft = case["target_probabilities"].cpu(), case["draft_probabilities"].cpu()
    u, stride = case["accept_uniforms"].cpu(), case["draft_token_ids"].shape[1]
    weights, thresholds, scaled = [], [], []
    for b, n in enumerate((lengths.cpu() - 1).tolist()):
        row_p = max(1, min(case["verify_proposal_len"], int(case["proposal_lengths"][b])))
        if n < row_p:
            residual = (target[b, n] - draft[b, n]).clamp_min(0)
            has_mass = bool(R._sequential_prefix(R._positive(residual[None]))[0, -1] > 1e-20)
            weights.append(residual if has_mass else target[b, n])
            thresholds.append(u[b, stride + n])
            scaled.append(has_mass)
        else:
            weights.append(target[b, row_p])
            thresholds.append(u[b, 2 * stride])
            scaled.append(False)
    return torch.stack(weights), torch.stack(thresholds), torch.tensor(scaled)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("stride, p_v, vocab", [(1, 1, 1000), (4, 4, 4099), (7, 5, 1000), (4, 2, 4099)])
def test_probabilistic_accept_matches_reference(batch, stride, p_v, vocab):
    case = cases.accept_inputs(batch, stride, p_v, vocab, seed=batch * 31 + stride, device=DEVICE)
    (ref_ids, ref_len), (tri_ids, tri_len) = on_backends(lambda: K.probabilistic_accept(**case))
    assert torch.equal(ref_len, tri_len)
    last = (tri_len - 1).long()[:, None]
    keep = torch.arange(p_v + 1, device=DEVICE)[None, :] != last
    assert torch.equal(ref_ids[keep], tri_ids[keep])  # the accepted prefix and the zeroed tail
    assert_tokens_agree(ref_ids.gather(1, last)[:, 0], tri_ids.gather(1, last)[:, 0], *drawn_rows(case, tri_len))


# ------------------------------------------------------------------------------ losslessness (testing.md §5)


def verify_once(target, draft, rows, seed):
    """``rows`` independent rounds in ONE call: drafts drawn from ``draft`` [P, V], verified against
    ``target`` [P+1, V] on the Triton backend; returns (accepted, accept_length)."""
    width = draft.shape[0]
    tokens = torch.multinomial(draft, rows, replacement=True, generator=cases.generator(seed)).t()
    u = uniforms(rows, 2 * width + 1, offset=seed * (2 * width + 1)).to(DEVICE)  # built on the CPU
    with K.use_backend("triton"):
        return K.probabilistic_accept(
            target.to(DEVICE).expand(rows, -1, -1), draft.to(DEVICE).expand(rows, -1, -1),
            tokens.to(I32).contiguous().to(DEVICE), torch.full((rows,), width, dtype=I32, device=DEVICE), u, width)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 3])
def test_every_emitted_position_follows_the_target(width):
    vocab = 16
    rows = draws_for(vocab)  # 2^17 >= 1e5 draws, one call per position
    for position in range(width + 1):
        seed = 100 * width + position
        target, draft = forced_prefix_case(width, position, vocab, seed)
        accepted, lengths = verify_once(target, draft, rows, seed)
        assert bool((lengths > position).all()), "an always-acceptable draft was rejected"
        assert_distribution(accepted[:, position].cpu(), target[position], f"P={width}, position {position}")
        if position < width:
            closed_form = float(torch.minimum(target[position], draft[position]).double().sum())
            assert_rate((lengths > position + 1).cpu(), closed_form, f"P={width}, acceptance at {position}")


@pytest.mark.slow
def test_dense_draws_follow_their_rows():
    vocab = 16
    rows = draws_for(vocab)
    probs = cases.random_distributions((1,), vocab, zero_fraction=0.35, seed=9)
    u = uniforms(rows, 1, offset=77).to(DEVICE)
    tokens = torch.zeros(rows, 1, dtype=I32, device=DEVICE)
    with K.use_backend("triton"):
        K.sample_probability_rows(probs.to(DEVICE).expand(rows, -1), u, tokens, 0)
    assert_distribution(tokens[:, 0].cpu(), probs[0], "sample_probability_rows")


# ------------------------------------------------------------------------------ GPU: real shapes


@gpu
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 0, 1.0), (0.8, 50, 0.9), (1.0, 0, 0.9), (0.0, 0, 1.0)])
def test_real_size_markov_round_matches_reference(temperature, top_k, top_p):
    check_markov_round(8, 7, 151936, 256, torch.float16, temperature, top_k, top_p, 8, 1, seed=1, rtol=1e-4)


@gpu
@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_real_size_probabilities_match_reference(temperature, top_k, top_p):
    logits = cases.random_logits(16, 151936, scale=2.0, seed=top_k, device=DEVICE)
    logits[8:] *= 0.1  # flat rows: wide nucleus
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


@gpu
def test_real_size_accept_and_draws_match_reference():
    case = cases.accept_inputs(16, 7, 7, 151936, device=DEVICE)
    (ref_ids, ref_len), (tri_ids, tri_len) = on_backends(lambda: K.probabilistic_accept(**case))
    assert torch.equal(ref_len, tri_len)
    last = (tri_len - 1).long()[:, None]
    assert_tokens_agree(ref_ids.gather(1, last)[:, 0], tri_ids.gather(1, last)[:, 0], *drawn_rows(case, tri_len))


@gpu
def test_real_vocab_accept_is_lossless():
    """1e5 verification rounds at V = 151936 (support scattered over the vocabulary, tail tile included)."""
    vocab, rows, calls = 151936, 10_000, 10
    support = torch.tensor([0, 17, 4095, 4096, 70_001, 99_999, 123_456, 151_000, 151_935])
    g = cases.generator(12)
    target, draft = torch.zeros(2, vocab), torch.zeros(1, vocab)
    target[:, support] = torch.rand(2, len(support), generator=g) + 0.1
    target[0, support[1]] = 0.0
    draft[0, support[:-1]] = torch.rand(len(support) - 1, generator=g) + 0.1
    draft[0, 5] = 0.3  # draft mass outside the target's support
    target, draft = target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)
    results = [verify_once(target, draft, rows, seed=50 + i) for i in range(calls)]
    accepted = torch.cat([a for a, _ in results]).cpu()
    lengths = torch.cat([n for _, n in results]).cpu()
    assert_distribution(accepted[:, 0], target[0], "first emitted token")
    assert_rate(lengths > 1, float(torch.minimum(target[0], draft[0]).double().sum()), "acceptance")


@gpu
@pytest.mark.parametrize("top_k, top_p", [(50, 0.9), (0, 0.9)])
def test_sampled_round_replays_as_a_cuda_graph(top_k, top_p):
    """Top-k (candidates decide every row) and top-p alone on wide nuclei (the multi-program search)."""
    batch, width, vocab = 8, 7, 151936
    case = cases.markov_sample_inputs(batch, width, vocab, 256, seed=2, device=DEVICE)
    uniforms_ = case.pop("proposal_uniforms")
    tokens = torch.zeros(batch, width, dtype=I32, device=DEVICE)
    probs = torch.zeros(batch, width, vocab, device=DEVICE)

    def round_():
        for step in range(width):
            K.markov_sample_step(**case, proposal_uniforms=uniforms_, draft_token_ids=tokens,
                                 draft_probabilities=probs, step=step, temperature=0.8, top_k=top_k, top_p=top_p)

    with K.use_backend("triton"):
        round_()  # compiles and sizes the workspace
        eager_tokens, eager_probs = tokens.clone(), probs.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            round_()
    tokens.zero_()
    probs.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tokens, eager_tokens) and torch.equal(probs, eager_probs)
