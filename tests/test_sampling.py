"""Sampling family: uniforms, probabilities (temperature, top-k, top-p), inverse-CDF draws, stores,
sparse top-k rows and the sampled Markov steps (fp16/bf16 and FP8 W2).

Reference tests against NVIDIA's vectors (kernels.md §6), spec-derived values and literal oracles
(``sampling_cases``), edge cases and argument validation; then the Triton backend against the
reference (on the CPU under ``TRITON_INTERPRET=1`` with V = 1000 and 4099, multiples of no tile; on a
GPU compiled, plus ``gpu`` tests at V = 151936 and a CUDA-graph replay of a sampled round).

Tolerances: uniforms bit for bit; probabilities ``atol = 2e-6`` (fp32 normalisers in the kernels,
float64 in the reference), real-size Markov rows (R = 256, |z| ~ 25) ``rtol = 1e-4``; sampled tokens
by the boundary rule of ``sampling_cases.assert_tokens_agree``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import BACKEND_PARAMS, DEVICE, INTERPRETER_WARNINGS, gpu, on_backends, requires_triton
from kernel_cases import markov_case

import dspark.kernels as K
import sampling_cases as cases
from dspark.kernels.reference import sampling as R

pytestmark = [pytest.mark.usefixtures("reference_backend"), INTERPRETER_WARNINGS]

I32 = torch.int32
ATOL = 2e-6


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=I32, device=device)


def f32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.float32, device=device)


def raises(exc, *words):
    """pytest.raises whose message must name the function's argument(s)."""
    return pytest.raises(exc, match=".*".join(words))


# ------------------------------------------------------------------------------ fill_uniforms

SPEC_OFFSET_56 = [0.70031732, 0.43597788, 0.27918816, 0.86557841, 0.58884507, 0.27258736, 0.83255678, 0.74530351,
                  0.68155187, 0.71002460, 0.91305971, 0.22149622, 0.78287452, 0.93724829, 0.32444394, 0.11419588]


def splitmix_uniform(seed: int, offset: int, counter: int) -> float:
    """kernels.md 2.1 with Python integers."""
    mask = (1 << 64) - 1
    x = (seed ^ ((offset + 0xD1B54A32D192ED03 * (counter + 1)) & mask)) & mask
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return (x >> 40) * 2.0**-24


def assert_eight_decimals(u, expected):
    """The spec prints values rounded to 8 decimals; compare exactly in float64."""
    torch.testing.assert_close(u.double(), torch.tensor(expected, dtype=torch.float64), atol=5e-9, rtol=0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fill_uniforms_spec_values(backend):  # kernels.md 3.10
    with K.use_backend(backend):
        u = K.fill_uniforms(16, 1234, 56, DEVICE)
        assert u.dtype == torch.float32 and u.shape == (16,)
        assert ((u[:4] * 2**24).long().tolist()) == [0xB347FF, 0x6F9C3F, 0x4778E0, 0xDD968C]
        assert_eight_decimals(u.cpu(), SPEC_OFFSET_56)
        assert_eight_decimals(K.fill_uniforms(4, 1234, 57, DEVICE).cpu(),
                              [0.91321242, 0.95574981, 0.03124821, 0.47345066])
        assert_eight_decimals(K.fill_uniforms(4, cases.RUNTIME_SEED, 0, DEVICE).cpu(),
                              [0.28777933, 0.12491786, 0.29045409, 0.52624941])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fill_uniforms_is_deterministic_and_bounded(backend):  # NVIDIA test 4
    with K.use_backend(backend):
        first, again = K.fill_uniforms(16, 1234, 56, DEVICE), K.fill_uniforms(16, 1234, 56, DEVICE)
        other = K.fill_uniforms(16, 1234, 57, DEVICE)
        assert K.fill_uniforms(0, 1, 2, DEVICE).shape == (0,)
    assert torch.equal(first, again)
    assert bool(((first >= 0) & (first < 1)).all())
    assert not torch.equal(first, other)


@pytest.mark.parametrize("seed, offset", [(0, 0), (1234, 56), ((1 << 64) - 1, (1 << 64) - 1), (1 << 63, 12345),
                                          (cases.RUNTIME_SEED, 3 * 64 * 22 + 7), (0xFFFF0000FFFF0000, 1 << 62)])
def test_fill_uniforms_bit_exact_with_integer_splitmix(seed, offset):
    u = K.fill_uniforms(300, seed, offset)
    expected = f32([splitmix_uniform(seed, offset, i) for i in range(300)])
    assert torch.equal(u, expected)


def test_fill_uniforms_rejects_bad_input():
    with raises(ValueError, "fill_uniforms", "philox_seed"):
        K.fill_uniforms(4, -1, 0)
    with raises(ValueError, "fill_uniforms", "philox_offset"):
        K.fill_uniforms(4, 0, 1 << 64)
    with raises(TypeError, "fill_uniforms", "total_elements"):
        K.fill_uniforms(4.0, 0, 0)
    with raises(TypeError, "fill_uniforms", "device"):
        K.fill_uniforms(4, 0, 0, device=3.5)


# ------------------------------------------------------------------------------ logits_to_probabilities


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("logits, temperature, top_k, top_p, expected", [
    ([3, 2, 1, 0], 1.0, 2, 1.0, [0.7310586, 0.2689414, 0, 0]),  # NVIDIA test 1
    ([-1, 0.5, 4, 3], 0.0, 0, 0.5, [0, 0, 1, 0]),  # NVIDIA test 3
    ([3, 2, 1, 0, -1], 1.0, 3, 0.9, [0.7391566, 0.2608434, 0, 0, 0]),
    (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, 0, 0.75, [0.6666667, 0.3333333, 0, 0]),  # mass-clipped
    ([3, 2, 1, 0, -1], 0.5, 0, 1.0, [0.864704, 0.117025, 0.015838, 0.002143, 0.000290]),
])
def test_logits_to_probabilities_spec_vectors(backend, logits, temperature, top_k, top_p, expected):
    with K.use_backend(backend):
        probs = K.logits_to_probabilities(f32([logits], DEVICE), temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(probs, f32([expected], DEVICE), atol=1e-5, rtol=0)
    assert abs(float(probs.sum()) - 1) < 1e-6


@pytest.mark.parametrize("vocab", [8, 300])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (3, 1.0), (7, 0.9), (0, 0.5), (0, 1e-3), (200, 1.0),
                                          (200, 0.8), (0, 0.9999995)])
def test_logits_to_probabilities_matches_spec_pseudocode(vocab, temperature, top_k, top_p):
    logits = cases.random_logits(6, vocab, neg_inf_fraction=0.2, seed=vocab + top_k)
    logits[0, 1:4] = logits[0, 0]  # ties: the lower index ranks first
    probs = K.logits_to_probabilities(logits, temperature, top_k=top_k, top_p=top_p)
    for row in range(logits.shape[0]):
        expected = cases.logits_to_probabilities(logits[row].numpy(), temperature, top_k, top_p)
        np.testing.assert_allclose(probs[row].numpy(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6), atol=1e-5, rtol=0)


def test_logits_to_probabilities_greedy_ties_pick_lowest_index():
    probs = K.logits_to_probabilities(f32([[1, 5, 2, 5, 5]]), 1e-4, top_k=3, top_p=0.3)
    assert probs.tolist() == [[0, 1, 0, 0, 0]]


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (2, 1.0, 1.0), (0, 0.5, 1.0), (2, 0.5, 0.8),
                                                       (0, 1.0, 0.0)])
def test_logits_to_probabilities_degenerate_rows_are_uniform(top_k, top_p, temperature):
    inf, nan = float("inf"), float("nan")
    logits = f32([[-inf] * 4, [0.0, nan, 1.0, 2.0], [0.0, inf, 1.0, 2.0], [0.0, -inf, 1.0, -inf]])
    probs = K.logits_to_probabilities(logits, temperature, top_k=top_k, top_p=top_p)
    assert probs[:3].eq(0.25).all()
    assert probs[3, 1] == 0 and probs[3, 3] == 0 and abs(float(probs[3].sum()) - 1) < 1e-6


@pytest.mark.parametrize("vocab", [1000, 4099])
def test_logits_to_probabilities_large_vocab_tails(vocab):
    logits = cases.random_logits(3, vocab, seed=vocab)
    plain = K.logits_to_probabilities(logits, 0.9)
    torch.testing.assert_close(plain, torch.softmax(logits / 0.9, -1), atol=1e-6, rtol=1e-5)
    assert torch.equal(K.logits_to_probabilities(logits, 0.9, top_k=vocab + 5), plain)  # K > V is no filter
    top = K.logits_to_probabilities(logits, 0.9, top_k=150)
    assert (top > 0).sum(-1).tolist() == [150] * 3
    kept = logits.topk(150, -1).indices
    expected = torch.softmax(logits.gather(1, kept) / 0.9, -1)
    torch.testing.assert_close(top.gather(1, kept), expected, atol=1e-6, rtol=1e-5)
    nucleus = K.logits_to_probabilities(logits, 0.9, top_p=0.6)
    torch.testing.assert_close(nucleus.sum(-1), torch.ones(3), atol=1e-5, rtol=0)
    assert bool((nucleus <= plain / 0.6 + 1e-7).all())  # no token gains more than 1/top_p


def test_logits_to_probabilities_keeps_leading_dimensions():
    logits = cases.random_logits(6, 10, seed=3)
    probs3 = K.logits_to_probabilities(logits.reshape(2, 3, 10), 0.8, top_k=4)
    assert probs3.shape == (2, 3, 10)
    assert torch.equal(probs3.reshape(6, 10), K.logits_to_probabilities(logits, 0.8, top_k=4))


def test_logits_to_probabilities_rejects_bad_input():
    logits = torch.zeros(2, 5)
    with raises(TypeError, "logits_to_probabilities", "logits", "float32"):
        K.logits_to_probabilities(logits.long(), 1.0)
    with raises(ValueError, "logits_to_probabilities", "logits", "2 or 3-D"):
        K.logits_to_probabilities(logits[0], 1.0)
    with raises(ValueError, "logits_to_probabilities", "temperature"):
        K.logits_to_probabilities(logits, -0.5)
    with raises(ValueError, "logits_to_probabilities", "top_p"):
        K.logits_to_probabilities(logits, 1.0, top_p=0.0)
    with raises(ValueError, "logits_to_probabilities", "top_p"):
        K.logits_to_probabilities(logits, 1.0, top_p=1.5)
    with raises(TypeError, "logits_to_probabilities", "top_k"):
        K.logits_to_probabilities(logits, 1.0, top_k=2.0)


# ------------------------------------------------------------------------------ inverse-CDF samplers


def oracle_rows(fn, *columns):
    return torch.tensor([fn(*args) for args in zip(*columns)])


@pytest.mark.parametrize("rows, vocab", [(400, 16), (6, 4099)])
def test_sample_from_probs_matches_sequential_walk(rows, vocab):
    probs = cases.random_distributions((rows,), vocab, seed=vocab)
    u = torch.rand(rows, generator=cases.generator(1))
    u[:3] = f32([0.0, 1.0, 0.99999994])
    expected = oracle_rows(cases.sample_from_probs, probs.numpy(), u.numpy())
    assert torch.equal(R.sample_from_probs(probs, u), expected)


def test_sample_from_probs_is_exact_where_float64_sums_disagree():
    """Thresholds at and next to the sequential fp32 running sums of 4099 small entries: the walk must
    pick what the fp32 loop picks, also where a float64 prefix sum would pick differently."""
    probs = cases.random_distributions((1,), 4099, zero_fraction=0.1, seed=5).repeat(64, 1)
    running = torch.from_numpy(np.cumsum(probs[0].numpy().astype(np.float32), dtype=np.float32))  # sequential fp32
    positions = torch.randint(100, 4099, (16,), generator=cases.generator(2))
    at = running[positions]
    u = torch.cat([at, torch.nextafter(at, torch.zeros(())), torch.nextafter(at, torch.ones(())),
                   (running.double()[positions] + probs[0].double().cumsum(0)[positions]).float() / 2])
    expected = oracle_rows(cases.sample_from_probs, probs.numpy(), u.numpy())
    assert torch.equal(R.sample_from_probs(probs, u), expected)
    float64_choice = (probs.double().cumsum(-1) <= u.double()[:, None]).sum(-1)
    assert not torch.equal(float64_choice, expected), "the case no longer separates fp32 from float64 sums"


@pytest.mark.parametrize("name, make", [
    ("uniform-ish", lambda g: torch.rand(300, 64, generator=g)),
    ("ties", lambda g: torch.randint(0, 64, (300, 64), generator=g).float() * 2.0**-6
     + torch.randint(0, 4, (300, 64), generator=g).float() * 2.0**-30),
    ("binades", lambda g: torch.randint(1, 1 << 24, (60, 3000), generator=g).float()
     * torch.ldexp(torch.ones(60, 3000), torch.randint(-44, -24, (60, 3000), generator=g))),
    ("subnormal", lambda g: torch.rand(50, 40, generator=g) * 1e-38),
    ("overflow", lambda g: torch.cat([torch.full((2, 30), 3e38), torch.rand(3, 30, generator=g)]).index_put_(
        (torch.tensor([3]), torch.tensor([7])), torch.tensor(float("inf")))),
])
def test_sequential_prefix_is_the_fp32_loop(name, make):
    w = make(cases.generator(7))
    with np.errstate(over="ignore"):
        expected = np.cumsum(w.numpy(), axis=1, dtype=np.float32)
    assert torch.equal(R._sequential_prefix(w), torch.from_numpy(expected)), name


def test_sample_from_probs_edge_rows():
    probs = f32([[0, 0, 0, 0], [0, 0.5, 0, 0.5], [0, 0, 1, 0], [0.25, 0.25, 0.25, 0.25], [-1, 0.5, float("nan"), 0.5]])
    assert R.sample_from_probs(probs, f32([0.3, 0.0, 0.99, 1.0, 0.7])).tolist() == [0, 1, 2, 3, 3]
    assert R.sample_from_probs(probs[1:2].repeat(3, 1), f32([float("nan"), -2.0, 0.5])).tolist() == [1, 1, 3]


def test_sample_from_residual_matches_sequential_walk():
    p = cases.random_distributions((300,), 24, seed=11)
    q = cases.random_distributions((300,), 24, seed=12)
    q[:50] = p[:50]  # zero residual mass -> sample p
    q[50:60] = p[50:60] - 1e-22  # residual mass below 1e-20 -> sample p
    u = torch.rand(300, generator=cases.generator(13))
    expected = oracle_rows(cases.sample_from_residual, p.numpy(), q.numpy(), u.numpy())
    assert torch.equal(R.sample_from_residual(p, q, u), expected)
    assert torch.equal(R.sample_from_residual(p[:60], q[:60], u[:60]), R.sample_from_probs(p[:60], u[:60]))


def test_sample_from_sparse_probs_returns_ids_and_falls_back_to_the_first():
    probs = f32([[0.2, 0.8], [0.0, 0.0], [0.5, 0.5]])
    ids = i32([[7, 9], [4, 5], [11, 3]])
    assert R.sample_from_sparse_probs(probs, ids, f32([0.5, 0.5, 0.99])).tolist() == [9, 4, 3]


# ------------------------------------------------------------------------------ per-step stores


def test_sample_probability_rows_writes_only_its_column():
    probs = cases.random_distributions((5,), 12, seed=21)
    uniforms = torch.rand(5, 3, generator=cases.generator(22))
    draft = torch.full((5, 3), 99, dtype=I32)
    K.sample_probability_rows(probs, uniforms, draft, 1)
    expected = oracle_rows(cases.sample_from_probs, probs.numpy(), uniforms[:, 1].numpy())
    assert draft[:, 1].tolist() == expected.tolist()
    assert bool((draft[:, [0, 2]] == 99).all())


def test_sample_probability_rows_rejects_bad_input():
    probs, uniforms, draft = torch.full((2, 4), 0.25), torch.rand(2, 3), torch.zeros(2, 3, dtype=I32)
    with raises(TypeError, "sample_probability_rows", "draft_token_ids", "int32"):
        K.sample_probability_rows(probs, uniforms, draft.long(), 0)
    with raises(ValueError, "sample_probability_rows", "step"):
        K.sample_probability_rows(probs, uniforms, draft, 3)
    with raises(ValueError, "sample_probability_rows", "proposal_uniforms"):
        K.sample_probability_rows(probs, uniforms[:, :2], draft, 0)
    with raises(ValueError, "sample_probability_rows", "draft_token_ids", "contiguous"):
        K.sample_probability_rows(probs, uniforms, torch.zeros(3, 2, dtype=I32).t(), 0)


def test_store_draft_step_probabilities_copies_the_row():
    probs = cases.random_distributions((3,), 7, seed=31)
    buffer = torch.zeros(3, 4, 7)
    K.store_draft_step_probabilities(probs, buffer, 2)
    assert torch.equal(buffer[:, 2], probs) and buffer[:, [0, 1, 3]].eq(0).all()


def test_store_draft_step_probabilities_rejects_bad_input():
    probs = torch.rand(3, 7)
    with raises(ValueError, "store_draft_step_probabilities", "draft_probabilities"):
        K.store_draft_step_probabilities(probs, torch.zeros(3, 4, 8), 0)
    with raises(ValueError, "store_draft_step_probabilities", "step"):
        K.store_draft_step_probabilities(probs, torch.zeros(3, 4, 7), -1)
    with raises(TypeError, "store_draft_step_probabilities", "probability_scratch"):
        K.store_draft_step_probabilities(probs.double(), torch.zeros(3, 4, 7), 0)


# ------------------------------------------------------------------------------ top-k rows


def test_normalize_top_k_rows_is_a_softmax_without_greedy_mode():
    values = (torch.randn(4, 6, generator=cases.generator(41)) * 3).sort(-1, descending=True).values
    torch.testing.assert_close(K.normalize_top_k_rows(values, 0.7), torch.softmax(values / 0.7, -1), atol=1e-6, rtol=0)
    assert torch.equal(K.normalize_top_k_rows(values, 0.0), K.normalize_top_k_rows(values, 1.0))  # T < 1e-3 -> T = 1
    inf = float("inf")
    degenerate = K.normalize_top_k_rows(f32([[-inf, -inf], [float("nan"), 1.0]]), 1.0)
    assert degenerate.eq(0.5).all()


def test_normalize_top_k_rows_rejects_bad_input():
    with raises(TypeError, "normalize_top_k_rows", "top_k_values"):
        K.normalize_top_k_rows(torch.zeros(2, 3, dtype=torch.float16), 1.0)
    with raises(ValueError, "normalize_top_k_rows", "temperature"):
        K.normalize_top_k_rows(torch.zeros(2, 3), -1.0)
    with raises(ValueError, "normalize_top_k_rows", "top_k_values", "K >= 1"):
        K.normalize_top_k_rows(torch.zeros(2, 0), 1.0)


def test_sample_top_k_rows_and_store_matches_sequential_walk():
    case = cases.top_k_step_inputs(200, 3, 6, 50, seed=51)
    K.sample_top_k_rows_and_store(**case, step=2, temperature=0.6)
    probs = K.normalize_top_k_rows(case["top_k_values"], 0.6)
    assert torch.equal(case["draft_top_k_probabilities"][:, 2], probs)
    assert torch.equal(case["draft_top_k_indices"][:, 2], case["top_k_indices"])
    expected = [cases.walk(p, cases.clamp_uniform(u), ids) for p, ids, u in
                zip(probs.numpy(), case["top_k_indices"].numpy(), case["proposal_uniforms"][:, 2].numpy())]
    assert case["draft_token_ids"][:, 2].tolist() == expected
    assert case["draft_token_ids"][:, :2].eq(0).all()


def test_sample_top_k_rows_and_store_rejects_bad_input():
    case = cases.top_k_step_inputs(2, 3, 4, 10)
    with raises(TypeError, "sample_top_k_rows_and_store", "top_k_indices", "int32"):
        K.sample_top_k_rows_and_store(**{**case, "top_k_indices": case["top_k_indices"].long()}, step=0,
                                      temperature=1.0)
    with raises(ValueError, "sample_top_k_rows_and_store", "draft_top_k_probabilities"):
        K.sample_top_k_rows_and_store(**{**case, "draft_top_k_probabilities": torch.zeros(2, 3, 5)}, step=0,
                                      temperature=1.0)
    with raises(ValueError, "sample_top_k_rows_and_store", "top_k_indices", "outside"):
        K.sample_top_k_rows_and_store(**{**case, "top_k_indices": case["top_k_indices"] - 100}, step=0,
                                      temperature=1.0)
    with raises(ValueError, "sample_top_k_rows_and_store", "step"):
        K.sample_top_k_rows_and_store(**case, step=3, temperature=1.0)


# ------------------------------------------------------------------------------ Markov sampling


def nvidia_vector_5():
    return {"backbone_logits": f32([[0, 2, 1, -1], [0, 0, 3, 1]]), "markov_w1": torch.zeros(4, 1, dtype=torch.float16),
            "markov_w2": torch.zeros(4, 1, dtype=torch.float16), "first_prev_tokens": i32([0]),
            "proposal_uniforms": f32([[0.0, 0.99]])}


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_vanilla_markov_sample_materializes_distribution(backend):  # NVIDIA test 5
    case = {name: t.to(DEVICE) for name, t in nvidia_vector_5().items()}
    with K.use_backend(backend):
        tokens, probs = K.vanilla_markov_sample(**case, temperature=1.0, top_k=2, top_p=1.0)
        plain_tokens, plain_probs = K.vanilla_markov_sample(**case, temperature=1.0)  # the unfiltered path
    assert tokens.dtype == I32 and tokens.tolist() == [[1, 3]]
    torch.testing.assert_close(probs, f32([[[0, 0.7310586, 0.2689414, 0], [0, 0, 0.8807971, 0.1192029]]], DEVICE),
                               atol=1e-6, rtol=0)
    with K.use_backend("reference"):
        expected_tokens, expected_probs = K.vanilla_markov_sample(**case, temperature=1.0)
    assert torch.equal(plain_tokens, expected_tokens)
    torch.testing.assert_close(plain_probs, expected_probs, atol=1e-6, rtol=0)


def test_per_step_top_k_path_materializes_distribution():  # NVIDIA test 6
    # The C++ test composes BuildMarkovLogits -> selectAllTopK(2) -> topKLogitsToDenseProbabilities ->
    # SampleProbabilityRows -> StoreDraftStepProbabilities per step; dspark's dense top-k path
    # (logits_to_probabilities with top_k=2) stands in for the two generic helpers.
    case = nvidia_vector_5()
    tokens, probs = torch.zeros(1, 2, dtype=I32), torch.zeros(1, 2, 4)
    for step in range(2):
        corrected = K.build_markov_logits(case["backbone_logits"], case["markov_w1"], case["markov_w2"],
                                          case["first_prev_tokens"], tokens, step)
        scratch = K.logits_to_probabilities(corrected, 1.0, top_k=2)
        K.sample_probability_rows(scratch, case["proposal_uniforms"], tokens, step)
        K.store_draft_step_probabilities(scratch, probs, step)
    assert tokens.tolist() == [[1, 3]]
    torch.testing.assert_close(probs, f32([[[0, 0.7310586, 0.2689414, 0], [0, 0, 0.8807971, 0.1192029]]]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("top_k, top_p, stride, offset",
                         [(0, 1.0, 0, 0), (5, 1.0, 5, 1), (0, 0.8, 6, 2), (3, 0.7, 0, 0)])
def test_vanilla_markov_sample_is_its_steps_and_their_composition(dtype, top_k, top_p, stride, offset):
    case = cases.markov_sample_inputs(4, 4, 37, 8, dtype=dtype, logits_stride=stride, logits_offset=offset, seed=61)
    tokens, probs = K.vanilla_markov_sample(**case, temperature=0.9, top_k=top_k, top_p=top_p)
    step_tokens, step_probs = torch.full((4, 4), -7, dtype=I32), torch.zeros(4, 4, 37)
    uniforms = case.pop("proposal_uniforms")
    for step in range(4):
        K.markov_sample_step(**{**case, "proposal_uniforms": uniforms}, draft_token_ids=step_tokens,
                             draft_probabilities=step_probs, step=step, temperature=0.9, top_k=top_k, top_p=top_p)
        window = {k: v for k, v in case.items() if k.startswith("logits_")}
        corrected = K.build_markov_logits(case["backbone_logits"], case["markov_w1"], case["markov_w2"],
                                          case["first_prev_tokens"], tokens, step, **window)
        q = K.logits_to_probabilities(corrected, 0.9, top_k=top_k, top_p=top_p)
        assert torch.equal(probs[:, step], q)
        expected = oracle_rows(cases.sample_from_probs, q.numpy(), uniforms[:, step].numpy())
        assert tokens[:, step].tolist() == expected.tolist()
    assert torch.equal(step_tokens, tokens) and torch.equal(step_probs, probs)


def test_markov_sample_step_rejects_bad_input():
    case = nvidia_vector_5()
    uniforms = case.pop("proposal_uniforms")
    tokens, probs = torch.zeros(1, 2, dtype=I32), torch.zeros(1, 2, 4)

    def step(**changes):
        args = {**case, "proposal_uniforms": uniforms, "draft_token_ids": tokens, "draft_probabilities": probs,
                "step": 1, "temperature": 1.0, **changes}
        K.markov_sample_step(**args)

    with raises(ValueError, "markov_sample_step", "step"):
        step(step=2)
    with raises(ValueError, "markov_sample_step", "draft_probabilities"):
        step(draft_probabilities=torch.zeros(1, 2, 5))
    with raises(ValueError, "markov_sample_step", "proposal_uniforms"):
        step(proposal_uniforms=torch.zeros(1, 3))
    with raises(ValueError, "markov_sample_step", r"draft_token_ids\[:, 0\]"):
        step(draft_token_ids=i32([[4, 0]]))
    with raises(TypeError, "markov_sample_step", "markov_w1"):
        step(markov_w1=case["markov_w1"].float())
    with raises(ValueError, "markov_sample_step", "top_p"):
        step(top_p=0.0)


def test_vanilla_markov_sample_rejects_bad_input():
    case = nvidia_vector_5()
    with raises(ValueError, "vanilla_markov_sample", "first_prev_tokens", "4"):
        K.vanilla_markov_sample(**{**case, "first_prev_tokens": i32([4])}, temperature=1.0)
    with raises(ValueError, "vanilla_markov_sample", "backbone_logits"):
        K.vanilla_markov_sample(**{**case, "backbone_logits": torch.zeros(3, 4)}, temperature=1.0)
    with raises(TypeError, "vanilla_markov_sample", "proposal_uniforms"):
        K.vanilla_markov_sample(**{**case, "proposal_uniforms": case["proposal_uniforms"].double()}, temperature=1.0)
    with raises(ValueError, "vanilla_markov_sample", "temperature"):
        K.vanilla_markov_sample(**case, temperature=float("nan"))


def test_negative_top_k_means_no_top_k():
    """kernels.md 3.9: ``K < 0`` is ``K = V`` (vLLM's -1), in every function that takes ``top_k``; the
    public functions pass it on as 0, so every backend sees the unfiltered setting."""
    logits = cases.random_logits(3, 300, seed=8)
    case = cases.markov_sample_inputs(2, 2, 300, 16, seed=9)
    for top_k, top_p in ((-1, 1.0), (-7, 0.9)):
        assert torch.equal(K.logits_to_probabilities(logits, 0.8, top_k, top_p),
                           K.logits_to_probabilities(logits, 0.8, 0, top_p))
        sampled = K.vanilla_markov_sample(**case, temperature=0.8, top_k=top_k, top_p=top_p)
        unfiltered = K.vanilla_markov_sample(**case, temperature=0.8, top_k=0, top_p=top_p)
        assert all(torch.equal(a, b) for a, b in zip(sampled, unfiltered))
    plain_tokens, plain_probs = K.vanilla_markov_sample(**case, temperature=0.8)
    tokens, probs = torch.zeros(2, 2, dtype=I32), torch.zeros(2, 2, 300)
    K.markov_sample_step(**case, draft_token_ids=tokens, draft_probabilities=probs, step=0, temperature=0.8, top_k=-1)
    assert torch.equal(probs[:, 0], plain_probs[:, 0]) and torch.equal(tokens[:, 0], plain_tokens[:, 0])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_sampled_steps_take_fp8_w2(backend):
    """On the exact grid E4M3 codes times the row scales are W2 exactly, so FP8 changes nothing."""
    case = markov_case(2, 3, 300, 64, device=DEVICE)
    with K.use_backend("reference"):
        codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    uniforms = torch.rand(2, 3, generator=cases.generator(3)).to(DEVICE)
    args = (case.backbone_logits, case.markov_w1)
    with K.use_backend(backend):
        fp16 = K.vanilla_markov_sample(*args, case.markov_w2, case.first_prev_tokens, uniforms, 0.8, 50, 0.9)
        fp8 = K.vanilla_markov_sample(*args, codes, case.first_prev_tokens, uniforms, 0.8, 50, 0.9,
                                      w2_row_scales=scales)
        logits16 = K.build_markov_logits(*args, case.markov_w2, case.first_prev_tokens, fp16[0], 2)
        logits8 = K.build_markov_logits(*args, codes, case.first_prev_tokens, fp16[0], 2, w2_row_scales=scales)
    assert all(torch.equal(a, b) for a, b in zip(fp16, fp8)) and torch.equal(logits16, logits8)


def test_sampled_fp8_bad_input():
    case = cases.markov_sample_inputs(2, 2, 64, 16, seed=1)
    codes, scales = K.quantize_markov_w2_fp8(case["markov_w2"])
    with raises(ValueError, "vanilla_markov_sample", "uint8 FP8 codes", "w2_row_scales"):
        K.vanilla_markov_sample(**{**case, "markov_w2": codes}, temperature=1.0)
    with raises(ValueError, "vanilla_markov_sample", "w2_row_scales is given", "float16"):
        K.vanilla_markov_sample(**case, temperature=1.0, w2_row_scales=scales)
    with raises(ValueError, "markov_sample_step", "w2_row_scales", r"\[64\]"):
        K.markov_sample_step(**{**case, "markov_w2": codes}, draft_token_ids=torch.zeros(2, 2, dtype=I32),
                             draft_probabilities=torch.zeros(2, 2, 64), step=0, temperature=1.0,
                             w2_row_scales=scales[:10])


def f32_dev(values):
    return f32(values, DEVICE)


def i32_dev(values):
    return i32(values, DEVICE)


# ------------------------------------------------------------------------------ Triton backend: uniforms and probabilities


@requires_triton
@pytest.mark.parametrize("seed, offset", [(1234, 56), (cases.RUNTIME_SEED, 0), ((1 << 64) - 1, (1 << 64) - 1),
                                          (1 << 63, 12345), (7, 1 << 62), (1, 1)])  # compiled, 1 is special
def test_fill_uniforms_bit_exact(seed, offset):
    reference, triton = on_backends(lambda: K.fill_uniforms(3001, seed, offset, device=DEVICE))
    assert torch.equal(reference, triton)


FILTERS = [(1.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 5, 1.0), (0.8, 50, 0.9), (1.0, 0, 0.9), (0.0, 0, 1.0),
           (1.0, 200, 1.0), (0.8, 200, 0.9)]


@requires_triton
@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_logits_to_probabilities_matches_reference(vocab, temperature, top_k, top_p):
    logits = cases.random_logits(3, vocab, neg_inf_fraction=0.05, seed=vocab + top_k, device=DEVICE)
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


@requires_triton
@pytest.mark.parametrize("top_k, top_p, passes", [
    *[(top_k, top_p, passes) for top_k, top_p in ((0, 0.9), (0, 0.3), (2000, 1.0)) for passes in (0, 1, 3)],
    (300, 0.95, 3),  # the nucleus inside a large top-k is cut by the row program whatever the passes
])
def test_wide_nucleus_and_large_top_k_are_searched_exactly(top_k, top_p, passes, monkeypatch):
    """Flat rows put the cut far beyond the 128 candidates: the value-space search decides it, from
    any point where the multi-program passes hand over to the one-program-per-row finish (by mass
    for top-p, by count for ``top_k > 128``). Two rows: each row's programs read and write their own
    row (the interpreter's time grows with the rows; the search does not depend on their number)."""
    from dspark.kernels.triton import search

    assert search.SEARCH_PASSES == 3  # the default is among the cases
    monkeypatch.setattr(search, "SEARCH_PASSES", passes)
    logits = cases.random_logits(2, 4099, scale=0.3, seed=top_k, device=DEVICE)
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, 1.0, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


def _order_key(value: float, index: int) -> int:
    """The Triton filter key of fp32 ``value`` at ``index`` (``_shared.order_key``), as a Python int."""
    bits = int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
    return ((bits ^ 0x7FFFFFFF if bits < 0 else bits) << 32) | (index ^ 0xFFFFFFFF)


@requires_triton
def test_the_search_cuts_only_what_its_gather_found():
    """The search's start state bounds the entries of its interval (the select kernel's bound is V);
    where that bound is at most a bucket no probe pass makes it exact, and the gather finds fewer:
    the cut must come from those, not from the keys an earlier call left in the bucket past them.
    White box: ``search.search`` on one row of 8 entries, the interval [-1, 3] holding 5 of them."""
    from dspark.kernels.triton import search
    from dspark.kernels.triton._shared import row_chunk

    vocab, top_p = 8, 0.6
    x = torch.tensor([[3.0, 1.0, 2.0, -5.0, 0.5, -6.0, 2.5, -7.0]], device=DEVICE)
    nucleus = top_p * float(torch.exp(x - 3.0).sum())
    chunk = row_chunk(vocab)
    n_chunks = -(-vocab // chunk)

    def cut(stale_key: int) -> tuple[int, float]:
        o = [_order_key(v, 0) >> 32 for v in (-1.0, 3.0)]
        buf = {"par": torch.tensor([3.0, nucleus, 0.0]), "kappa": torch.zeros(1, dtype=torch.int64),
               "bounds": torch.tensor(o, dtype=torch.int32), "cut": torch.tensor([0.0, 0.0, vocab, nucleus]),
               "fill": torch.zeros(1, dtype=torch.int32),
               "probe_partials": torch.zeros(n_chunks * 2 * search.NPROBE),
               "bucket": torch.full((search.bucket_size(vocab),), stale_key, dtype=torch.int64)}
        buf = {name: t.to(DEVICE) for name, t in buf.items()}
        search.search(x, vocab, 1, vocab, 1.0, 0, top_p, x, 0, chunk, n_chunks,
                      torch.tensor([2], dtype=torch.int32, device=DEVICE), buf)
        return int(buf["kappa"]), float(buf["par"][2])

    clean = cut(-(2**63))  # SENTINEL: absent
    assert clean[0] == _order_key(2.5, 6)  # 3.0 and 2.5 hold 0.73 of the mass: the cut is at 2.5
    assert cut(_order_key(100.0, 0)) == clean


@requires_triton
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


# ------------------------------------------------------------------------------ Triton backend: draws, sparse rows, stores


@requires_triton
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
        cases.assert_tokens_agree(reference[:, step], triton[:, step], probs, u[:, step])


@requires_triton
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
    u = f32_dev([[0.99999994], [0.5], [0.2], [0.95], [float("nan")], [-3.0]])

    def run():
        ids = torch.full((6, 1), -1, dtype=I32, device=DEVICE)
        K.sample_probability_rows(probs, u, ids, 0)
        return ids[:, 0]

    reference, triton = on_backends(run)
    assert triton.tolist() == reference.tolist() == [vocab - 1, 0, 2, 900, 3, 4]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_sparse_top_k_sample_stores_distribution(backend):  # NVIDIA test 9
    width = 2
    tokens, probs, ids = torch.zeros(1, width, dtype=I32), torch.zeros(1, width, 2), torch.zeros(1, width, 2, dtype=I32)
    tokens, probs, ids = tokens.to(DEVICE), probs.to(DEVICE), ids.to(DEVICE)
    u = f32_dev([[0.0, 0.99]])
    with K.use_backend(backend):
        for step, (values, indices) in enumerate([([2, 1], [1, 2]), ([3, 1], [2, 3])]):
            K.sample_top_k_rows_and_store(f32_dev([values]), i32_dev([indices]), u, tokens, probs, ids, step, 1.0)
    assert tokens.tolist() == [[1, 3]] and ids.flatten().tolist() == [1, 2, 2, 3]
    torch.testing.assert_close(probs.flatten(), f32_dev([0.7310586, 0.2689414, 0.8807971, 0.1192029]), atol=1e-6, rtol=0)


@requires_triton
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
    cases.assert_tokens_agree(expected_positions, positions, probs, case["proposal_uniforms"][:, 1])


@requires_triton
def test_store_draft_step_probabilities_matches_reference():
    scratch = torch.rand(3, 4099, generator=cases.generator(1)).to(DEVICE)

    def run():
        probs = torch.zeros(3, 4, 4099, device=DEVICE)
        K.store_draft_step_probabilities(scratch, probs, 2)
        return probs

    reference, triton = on_backends(run)
    assert torch.equal(reference, triton)


# ------------------------------------------------------------------------------ Triton backend: the fused Markov sampler


MARKOV_CASES = [  # batch, width, vocab, rank, dtype, temperature, top_k, top_p, stride, offset, FP8 W2
    (3, 4, 1000, 16, torch.float16, 0.8, 0, 1.0, 0, 0, False),
    (1, 4, 4099, 64, torch.bfloat16, 1.0, 0, 0.9, 8, 1, False),
    (8, 1, 1000, 8, torch.float16, 0.0, 0, 1.0, 0, 0, False),
    (3, 4, 4099, 256, torch.float16, 0.8, 50, 0.9, 5, 1, False),
    (8, 4, 1000, 16, torch.bfloat16, 1.0, 5, 1.0, 0, 0, True),
    (3, 4, 1000, 8, torch.float16, 1.0, 200, 1.0, 0, 0, False),
]


def check_markov_round(batch, width, vocab, rank, dtype, temperature, top_k, top_p, stride, offset, seed=0,
                       rtol=1e-5, fp8=False):
    """Triton's round: each step's probabilities vs the reference step re-run on Triton's own earlier
    tokens (so a legal boundary choice does not change what later steps see), each token vs NVIDIA's
    walk over the probabilities Triton stored. ``fp8``: W2 as the reference's E4M3 codes + row scales."""
    case = cases.markov_sample_inputs(batch, width, vocab, rank, dtype=dtype, logits_stride=stride,
                                      logits_offset=offset, seed=seed, device=DEVICE)
    if fp8:
        with K.use_backend("reference"):
            case["markov_w2"], case["w2_row_scales"] = K.quantize_markov_w2_fp8(case["markov_w2"])
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
        cases.assert_tokens_agree(expected, tokens[:, step], probs[:, step], uniforms_[:, step], window=cases.FUSED_BOUNDARY)


@requires_triton
@pytest.mark.parametrize("case", MARKOV_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_markov_sampler_matches_reference(case):
    *shape, fp8 = case
    check_markov_round(*shape, fp8=fp8)


@requires_triton
def test_markov_sample_step_fills_only_its_step():
    case = cases.markov_sample_inputs(3, 4, 1000, 16, seed=3, device=DEVICE)
    uniforms_ = case.pop("proposal_uniforms")
    tokens = torch.full((3, 4), -5, dtype=I32, device=DEVICE)
    tokens[:, 0] = i32_dev([1, 2, 3])
    probs = torch.full((3, 4, 1000), -1.0, device=DEVICE)
    with K.use_backend("triton"):
        K.markov_sample_step(**case, proposal_uniforms=uniforms_, draft_token_ids=tokens, draft_probabilities=probs,
                             step=1, temperature=0.8, top_k=50, top_p=0.9)
    assert bool((tokens[:, 2:] == -5).all()) and tokens[:, 0].tolist() == [1, 2, 3]
    assert bool((probs[:, [0, 2, 3]] == -1).all()) and bool((tokens[:, 1] >= 0).all())
    torch.testing.assert_close(probs[:, 1].sum(-1), torch.ones(3, device=DEVICE), atol=1e-5, rtol=0)


@requires_triton
def test_bad_token_ids_are_clamped_not_read_out_of_range():
    """On the GPU ids are not validated (no host sync): the backends clamp them before addressing."""
    from dspark.kernels.triton import markov as tmarkov

    vocab = 1000
    case = cases.markov_sample_inputs(2, 2, vocab, 16, seed=4, device=DEVICE)
    bad, clamped = i32_dev([vocab + 7, -2]), i32_dev([vocab - 1, 0])
    runs = []
    for first in (bad, clamped):
        tokens = torch.zeros(2, 2, dtype=I32, device=DEVICE)
        probs = torch.zeros(2, 2, vocab, device=DEVICE)
        tmarkov.markov_sample_step(case["backbone_logits"].reshape(-1, vocab), case["markov_w1"], case["markov_w2"],
                                   None, first, case["proposal_uniforms"], tokens, probs, 0, 1.0, 0, 1.0, 2, 0,
                                   K.Workspace())
        runs.append((tokens, probs))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# ------------------------------------------------------------------------------ GPU: real sizes, CUDA graphs


@requires_triton
@gpu
@pytest.mark.parametrize("temperature, top_k, top_p, fp8", [(0.8, 0, 1.0, False), (0.8, 50, 0.9, False),
                                                            (1.0, 0, 0.9, False), (0.0, 0, 1.0, False),
                                                            (0.8, 50, 0.9, True), (0.8, 0, 1.0, True)])
def test_real_size_markov_round_matches_reference(temperature, top_k, top_p, fp8):
    check_markov_round(8, 7, 151936, 256, torch.float16, temperature, top_k, top_p, 8, 1, seed=1, rtol=1e-4, fp8=fp8)


@requires_triton
@gpu
@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_real_size_probabilities_match_reference(temperature, top_k, top_p):
    logits = cases.random_logits(16, 151936, scale=2.0, seed=top_k, device=DEVICE)
    logits[8:] *= 0.1  # flat rows: wide nucleus
    reference, triton = on_backends(lambda: K.logits_to_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(triton, reference, atol=ATOL, rtol=0)


@requires_triton
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
