"""Sampling family, reference backend: NVIDIA vectors (kernels.md §6), spec-derived values, literal
oracles (tests/sampling_cases.py), edge cases and argument validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dspark.kernels as K
import sampling_cases as cases
from dspark.kernels.reference import sampling as R

I32 = torch.int32


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):
        yield


def i32(values):
    return torch.tensor(values, dtype=I32)


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


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


def test_fill_uniforms_spec_values():
    u = K.fill_uniforms(16, 1234, 56)
    assert u.dtype == torch.float32 and u.shape == (16,)
    assert ((u[:4] * 2**24).long().tolist()) == [0xB347FF, 0x6F9C3F, 0x4778E0, 0xDD968C]
    assert_eight_decimals(u, SPEC_OFFSET_56)
    assert_eight_decimals(K.fill_uniforms(4, 1234, 57), [0.91321242, 0.95574981, 0.03124821, 0.47345066])
    assert_eight_decimals(K.fill_uniforms(4, cases.RUNTIME_SEED, 0), [0.28777933, 0.12491786, 0.29045409, 0.52624941])


def test_fill_uniforms_is_deterministic_and_bounded():  # NVIDIA test 4
    first, again, other = K.fill_uniforms(16, 1234, 56), K.fill_uniforms(16, 1234, 56), K.fill_uniforms(16, 1234, 57)
    assert torch.equal(first, again)
    assert bool(((first >= 0) & (first < 1)).all())
    assert not torch.equal(first, other)
    assert K.fill_uniforms(0, 1, 2).shape == (0,)


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


def test_logits_to_probabilities_applies_top_k():  # NVIDIA test 1
    probs = K.logits_to_probabilities(f32([[3, 2, 1, 0]]), 1.0, top_k=2, top_p=1.0)
    torch.testing.assert_close(probs, f32([[0.7310586, 0.2689414, 0, 0]]), atol=1e-5, rtol=0)
    assert abs(float(probs.sum()) - 1) < 1e-6


def test_logits_to_probabilities_temperature_zero_is_greedy():  # NVIDIA test 3
    probs = K.logits_to_probabilities(f32([[-1, 0.5, 4, 3]]), 0.0, top_k=0, top_p=0.5)
    assert probs.tolist() == [[0, 0, 1, 0]]


@pytest.mark.parametrize("logits, temperature, top_k, top_p, expected", [
    ([3, 2, 1, 0, -1], 1.0, 3, 0.9, [0.7391566, 0.2608434, 0, 0, 0]),
    (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, 0, 0.75, [0.6666667, 0.3333333, 0, 0]),  # mass-clipped
    ([3, 2, 1, 0, -1], 0.5, 0, 1.0, [0.864704, 0.117025, 0.015838, 0.002143, 0.000290]),
])
def test_logits_to_probabilities_spec_vectors(logits, temperature, top_k, top_p, expected):
    probs = K.logits_to_probabilities(f32([logits]), temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(probs, f32([expected]), atol=1e-5, rtol=0)


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
    with raises(ValueError, "logits_to_probabilities", "top_k"):
        K.logits_to_probabilities(logits, 1.0, top_k=-1)
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


def test_sparse_top_k_sample_stores_distribution():  # NVIDIA test 9
    buffers = {"draft_token_ids": torch.zeros(1, 2, dtype=I32), "draft_top_k_probabilities": torch.zeros(1, 2, 2),
               "draft_top_k_indices": torch.zeros(1, 2, 2, dtype=I32)}
    uniforms = f32([[0.0, 0.99]])
    for step, (values, ids) in enumerate([([2.0, 1.0], [1, 2]), ([3.0, 1.0], [2, 3])]):
        K.sample_top_k_rows_and_store(f32([values]), i32([ids]), uniforms, buffers["draft_token_ids"],
                                      buffers["draft_top_k_probabilities"], buffers["draft_top_k_indices"], step, 1.0)
    assert buffers["draft_token_ids"].tolist() == [[1, 3]]
    assert buffers["draft_top_k_indices"].flatten().tolist() == [1, 2, 2, 3]
    torch.testing.assert_close(buffers["draft_top_k_probabilities"].flatten(),
                               f32([0.7310586, 0.2689414, 0.8807971, 0.1192029]), atol=1e-6, rtol=0)


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


def test_vanilla_markov_sample_materializes_distribution():  # NVIDIA test 5
    tokens, probs = K.vanilla_markov_sample(**nvidia_vector_5(), temperature=1.0, top_k=2, top_p=1.0)
    assert tokens.dtype == I32 and tokens.tolist() == [[1, 3]]
    torch.testing.assert_close(probs, f32([[[0, 0.7310586, 0.2689414, 0], [0, 0, 0.8807971, 0.1192029]]]),
                               atol=1e-6, rtol=0)


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


# ------------------------------------------------------------------------------ probabilistic_accept


def accept(target, draft, tokens, uniforms, verify_proposal_len, lengths=None):
    lengths = i32([len(tokens)] if lengths is None else lengths)
    accepted, length = K.probabilistic_accept(f32([target]), f32([draft]), i32([tokens]), lengths, f32([uniforms]),
                                              verify_proposal_len)
    return accepted[0].tolist(), int(length[0])


def test_probabilistic_accept_samples_residual_on_reject():  # NVIDIA test 7
    result = accept([[.1, .8, .05, .05], [.5, .2, .1, .2], [.25] * 4], [[.2, .4, .2, .2], [.2, .3, .5, 0]], [1, 2],
                    [0.5, 0.9, 0.0, 0.7, 0.0], 2)
    assert result == ([1, 3, 0], 2)


def test_probabilistic_accept_samples_bonus_when_all_accepted():  # NVIDIA test 8
    result = accept([[.1, .8, .05, .05], [.1, .2, .6, .1], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.2, .2, .2, .4]],
                    [1, 2], [.9, .9, 0, 0, .75], 2)
    assert result == ([1, 2, 3], 3)


def test_probabilistic_accept_supports_dynamic_verify_length():  # NVIDIA test 13
    result = accept([[.1, .8, .05, .05], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.25] * 4], [1, 2], [0.9, 0, 0, 0, 0.75],
                    1, lengths=[1])
    assert result == ([1, 3], 2)


def test_probabilistic_accept_rejects_token_the_target_gives_no_mass():  # NVIDIA test 16
    result = accept([[.7, .3, 0, 0], [.6, .4, 0, 0]], [[.2, .8, 0, 0]], [2], [0.0, 0.5, 0.5], 1)
    assert result == ([0, 0], 1)


def test_probabilistic_accept_edge_cases():
    # q = 0 at the drafted token but p > 0: a = 1, accepted even with u close to 1.
    assert accept([[.5, .5, 0], [0, 0, 1]], [[1, 0, 0]], [1], [0.99999994, 0, 0.3], 1) == ([1, 2], 2)
    # p == q with p = q = 0 at the token: rejected, zero residual mass -> draw from p.
    assert accept([[.5, .5, 0], [1, 0, 0]], [[.5, .5, 0]], [2], [0.0, 0.6, 0.0], 1) == ([1, 0], 1)
    # all mass in one token: always accepted, bonus from the one-hot row.
    assert accept([[0, 1, 0], [0, 0, 1]], [[0, 1, 0]], [1], [0.99999994, 0.5, 0.5], 1) == ([1, 2], 2)
    # proposal length 0 walks one draft (rowP >= 1); a length beyond P_v walks P_v.
    target, draft = [[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 0, 1]]
    assert accept(target, draft, [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, lengths=[0]) == ([1, 2, 0], 2)
    assert accept(target, draft, [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, lengths=[9]) == ([1, 2, 0], 3)
    assert accept(target[:2], draft, [1, 2], [0.5, 0.5, 0, 0, 0.5], 1, lengths=[9]) == ([1, 2], 2)


@pytest.mark.parametrize("stride, verify_proposal_len, vocab", [(1, 1, 8), (4, 4, 16), (4, 2, 16), (3, 3, 1000)])
def test_probabilistic_accept_matches_spec_pseudocode(stride, verify_proposal_len, vocab):
    case = cases.accept_inputs(64, stride, verify_proposal_len, vocab, seed=stride * 10 + verify_proposal_len)
    accepted, lengths = K.probabilistic_accept(**case)
    expected, expected_lengths = cases.probabilistic_accept(
        case["target_probabilities"].numpy(), case["draft_probabilities"].numpy(), case["draft_token_ids"].numpy(),
        case["proposal_lengths"].numpy(), case["accept_uniforms"].numpy(), verify_proposal_len)
    assert accepted.dtype == I32 and lengths.dtype == I32
    assert accepted.tolist() == expected.tolist() and lengths.tolist() == expected_lengths.tolist()
    assert len(set(lengths.tolist())) > 1  # both accepts and rejections happened


def test_probabilistic_accept_rejects_bad_input():
    case = cases.accept_inputs(2, 3, 2, 6)

    def run(**changes):
        K.probabilistic_accept(**{**case, **changes})

    with raises(ValueError, "probabilistic_accept", "verify_proposal_len"):
        run(verify_proposal_len=4)
    with raises(ValueError, "probabilistic_accept", "accept_uniforms", r"\[2, 7\]"):
        run(accept_uniforms=torch.rand(2, 6))
    with raises(ValueError, "probabilistic_accept", "target_probabilities"):
        run(target_probabilities=torch.rand(2, 4, 6))
    with raises(ValueError, "probabilistic_accept", "draft_token_ids", "6"):
        run(draft_token_ids=i32([[6, 0, 0], [0, 0, 0]]))
    with raises(TypeError, "probabilistic_accept", "proposal_lengths"):
        run(proposal_lengths=case["proposal_lengths"].long())
    with raises(ValueError, "probabilistic_accept", "draft_probabilities"):
        run(draft_probabilities=torch.rand(2, 3, 7))
