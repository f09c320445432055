"""Confidence family: confidence head, threshold and SPS schedulers.

Reference tests against plain loops (float64 scores, fp32 scheduler arithmetic) and NVIDIA's vectors,
then the Triton backend against the reference. Confidences go through ``exp``, whose last bits
differ between libraries: ``atol = 1e-6``; lengths are compared exactly (the grid inputs keep the
scores away from the scheduler's boundaries).
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import DEVICE, assert_same, on_backends, requires_triton
from kernel_cases import (SPS_VECTORS, confidence_case, confidence_case_from_scores, nvidia_confidence_sps_case,
                          nvidia_confidence_threshold_case)

import dspark.kernels as K
from dspark.kernels.reference.confidence import sps_costs, sps_proposal_lengths, threshold_proposal_lengths

pytestmark = pytest.mark.usefixtures("reference_backend")

f32 = np.float32


# ------------------------------------------------------------------------------ plain oracles


def loop_scores(case) -> list[list[float]]:
    """kernels.md 3.5 in float64, one (b, k) at a time."""
    batch, width = case.draft_token_ids.shape
    stride = case.hidden_stride or width
    hidden = case.draft_hidden_states.double().reshape(batch * stride, -1)
    size = hidden.shape[1]
    weight, bias = case.confidence_weight.double(), float(case.confidence_bias[0])
    out = []
    for b in range(batch):
        row = []
        for k in range(width):
            dot = float(hidden[b * stride + k + case.hidden_offset] @ weight[:size])
            if case.confidence_with_markov:
                prev = int(case.first_prev_tokens[b]) if k == 0 else int(case.draft_token_ids[b, k - 1])
                dot += float(case.markov_w1.double()[prev] @ weight[size:])
            row.append(1 / (1 + math.exp(-(dot + bias))))
        out.append(row)
    return out


def bounds(width, min_len, max_len):
    c_min = max(1, min(width, min_len))
    return c_min, max(c_min, min(width, width if max_len <= 0 else max_len))


def loop_threshold(conf, threshold, min_len, max_len) -> list[int]:
    """kernels.md 3.6 with numpy float32 scalars, one row at a time."""
    out = []
    for row in conf.tolist():
        c_min, c_max = bounds(len(row), min_len, max_len)
        if threshold <= 0:
            out.append(c_max)
            continue
        survival, selected = f32(1), c_min
        for k in range(c_max):
            survival = f32(survival * f32(row[k]))
            if survival >= f32(threshold):
                selected = k + 1
            else:
                break
        out.append(min(max(selected, c_min), c_max))
    return out


def fp32_round(x: Fraction) -> float:
    """Round an exact rational to the nearest fp32, ties to even (a single rounding)."""
    near = f32(float(x))
    candidates = [np.nextafter(near, f32(-np.inf)), near, np.nextafter(near, f32(np.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.int32)) & 1)))


def fma32(a, b, c) -> float:
    return fp32_round(Fraction(float(f32(a))) * Fraction(float(b)) + Fraction(float(f32(c))))


def loop_sps(conf, floor, min_len, max_len) -> list[int]:
    """kernels.md 3.7 with numpy float32 scalars and exactly rounded fused multiply-adds."""
    out = []
    for row in conf.tolist():
        c_min, c_max = bounds(len(row), min_len, max_len)
        floor32 = f32(min(max(floor, 0.0), 1.0))
        survival, expected, best, selected = f32(1), f32(1), -np.finfo(np.float32).max, c_min
        for k in range(c_max):
            length = k + 1
            survival = f32(survival * f32(row[k]))
            expected = f32(expected + survival)
            if length >= c_min:
                cost = f32(fma32(0.02, length, fma32(0.45, length + 1, f32(0.5) + f32(1.0))))
                score = f32(expected / max(cost, f32(1e-6)))
                if score > best:
                    best, selected = score, length
            if floor32 > 0 and survival < floor32 and length >= c_min:
                break
        out.append(min(max(selected, c_min), c_max))
    return out


# ------------------------------------------------------------------------------ NVIDIA vectors


def test_nvidia_vector_10_threshold_scheduler_selects_prefix():
    case = nvidia_confidence_threshold_case()
    scores, lengths = K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=0.5,
                                                                min_proposal_len=1, max_proposal_len=3)
    torch.testing.assert_close(scores, torch.tensor([[0.8807971, 0.7310586, 0.1192029]]), atol=1e-5, rtol=0)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [2]


def test_nvidia_vector_11_sps_scheduler_selects_best_throughput_prefix():
    case = nvidia_confidence_sps_case()
    scores, lengths = K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=0.0,
                                                                    min_proposal_len=1, max_proposal_len=4)
    torch.testing.assert_close(scores, torch.tensor([[0.9525741, 0.5, 0.5, 0.5]]), atol=1e-5, rtol=0)
    assert lengths.tolist() == [2]
    survival = torch.cumprod(scores[0].double(), 0)
    sps = (1 + torch.cumsum(survival, 0)) / sps_costs(4).double()
    torch.testing.assert_close(sps, torch.tensor([0.80685, 0.84044, 0.79375, 0.72744], dtype=torch.float64),
                               atol=1e-5, rtol=0)


def test_sps_costs_reproduce_the_fused_multiply_adds():
    costs = sps_costs(32).tolist()
    spec = [2.42, 2.8899999, 3.36, 3.83, 4.2999997, 4.77, 5.24, 5.7099996]
    assert costs[:8] == [float(f32(x)) for x in spec]
    assert costs[31] == float(f32(16.99))
    assert costs == [fma32(0.02, L, fma32(0.45, L + 1, 1.5)) for L in range(1, 33)]
    assert costs[5] != float(f32(f32(f32(1.5) + f32(f32(0.45) * f32(7))) + f32(f32(0.02) * f32(6))))  # 4.7699995


@pytest.mark.parametrize("confidences,floor,expected", SPS_VECTORS)
def test_extra_sps_vectors(confidences, floor, expected):
    conf = torch.tensor([confidences], dtype=torch.float32)
    assert sps_proposal_lengths(conf, floor, 1, 0).tolist() == [expected]
    case = confidence_case_from_scores([confidences])
    _, lengths = K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=floor)
    assert lengths.tolist() == [expected]


def test_extra_sps_vector_scores():
    conf = torch.full((8,), 0.9, dtype=torch.float32)
    sps = (1 + torch.cumsum(torch.cumprod(conf, 0), 0)) / sps_costs(8)
    expect = [0.785, 0.938, 1.024, 1.069, 1.090, 1.094, 1.087, 1.073]
    torch.testing.assert_close(sps.double(), torch.tensor(expect, dtype=torch.float64), atol=6e-4, rtol=0)


# ------------------------------------------------------------------------------ confidence head


@pytest.mark.parametrize("batch,width,hidden,rank,dtype,with_markov,stride,offset,flat", [
    (1, 1, 8, 8, torch.float16, True, 0, 0, False),
    (3, 4, 64, 16, torch.bfloat16, True, 5, 1, True),
    (8, 7, 96, 64, torch.float16, False, 8, 1, False),
    (2, 7, 33, 8, torch.bfloat16, False, 0, 0, True),
])
def test_confidence_scores_match_float64(batch, width, hidden, rank, dtype, with_markov, stride, offset, flat):
    case = confidence_case(batch, width, hidden, rank, 131, dtype, with_markov=with_markov, hidden_stride=stride,
                           hidden_offset=offset, flat=flat, seed=width)
    scores = K.compute_confidence_scores(*case.args(), **case.kwargs())
    assert scores.dtype == torch.float32 and scores.shape == (batch, width)
    torch.testing.assert_close(scores.double(), torch.tensor(loop_scores(case), dtype=torch.float64), atol=1e-6,
                               rtol=0)


def test_confidence_uses_the_markov_embedding_of_the_previous_token():
    case = confidence_case(1, 3, 4, 8, 20, with_markov=True)
    case.markov_w1.zero_()
    case.markov_w1[[11, 12, 13]] = 1.0
    case.confidence_weight.zero_()
    case.confidence_weight[4:] = 0.25  # Markov part only: dot 2 for rows 11..13, 0 otherwise
    case.first_prev_tokens[0] = 11
    case.draft_token_ids[0] = torch.tensor([5, 13, 12], dtype=torch.int32)  # last column is never read
    scores = K.compute_confidence_scores(*case.args(), **case.kwargs())
    s = torch.sigmoid(torch.tensor([4.0, 2.0, 4.0]))  # bias 2 + (2, 0, 2)
    torch.testing.assert_close(scores[0], s, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------ schedulers


@pytest.mark.parametrize("threshold", [-1.0, 0.0, 0.2, 0.5, 0.8, 1.5])
@pytest.mark.parametrize("min_len,max_len", [(1, 0), (0, 3), (3, 2), (2, 9)])
def test_threshold_scheduler_matches_plain_loop(threshold, min_len, max_len):
    case = confidence_case(16, 7, 32, 16, 64, seed=5)
    scores, lengths = K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=threshold,
                                                                min_proposal_len=min_len, max_proposal_len=max_len)
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == loop_threshold(scores, threshold, min_len, max_len)


def test_threshold_scheduler_edges():
    conf = torch.tensor([[0.4, 0.9, 0.9], [0.9, 0.9, 0.9], [0.9, float("nan"), 0.9], [0.5, 1.0, 1.0]])
    assert threshold_proposal_lengths(conf, 0.5, 1, 0).tolist() == [1, 3, 1, 3]  # never below cMin
    assert threshold_proposal_lengths(conf, 0.5, 2, 0).tolist() == [2, 3, 2, 3]
    assert threshold_proposal_lengths(conf, 0.0, 1, 2).tolist() == [2, 2, 2, 2]  # disabled: cMax


@pytest.mark.parametrize("floor", [0.0, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("min_len,max_len", [(1, 0), (3, 0), (2, 5), (9, 0)])
def test_sps_scheduler_matches_plain_loop(floor, min_len, max_len):
    case = confidence_case(16, 7, 32, 16, 64, seed=6)
    scores, lengths = K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=floor,
                                                                    min_proposal_len=min_len, max_proposal_len=max_len)
    assert lengths.tolist() == loop_sps(scores, floor, min_len, max_len)


def test_sps_scheduler_spread_of_lengths():
    gen = torch.Generator().manual_seed(2)
    conf = torch.rand(256, 8, generator=gen) ** 0.25
    lengths = sps_proposal_lengths(conf, 0.0, 1, 0)
    assert lengths.tolist() == loop_sps(conf, 0.0, 1, 0)
    assert len(set(lengths.tolist())) >= 4


def test_sps_ties_keep_the_shorter_length():
    # expTok(1) / cost(1) == expTok(2) / cost(2) needs conf_2 = 0: the second length adds nothing.
    conf = torch.tensor([[1.0, 0.0, 0.0]])
    assert sps_proposal_lengths(conf, 0.0, 1, 0).tolist() == [1]
    assert sps_proposal_lengths(conf, 0.0, 2, 0).tolist() == [2]  # cMin wins over the better L = 1


def test_sps_floor_breaks_after_scoring():
    conf = torch.full((1, 6), 0.99)  # survival 0.99, 0.9801, 0.9703, 0.9606, ...; scores rise up to L = 6
    assert sps_proposal_lengths(conf, 0.0, 1, 0).tolist() == [6]
    assert sps_proposal_lengths(conf, 0.97, 1, 0).tolist() == [4]  # L = 4 is scored, then the floor stops
    assert sps_proposal_lengths(conf, 0.97, 5, 0).tolist() == [5]  # no break before cMin


# ------------------------------------------------------------------------------ bad input


def test_confidence_scores_bad_input():
    case = confidence_case(2, 3, 8, 4, 16)
    args, kwargs = case.args(), case.kwargs()
    with pytest.raises(ValueError, match="confidence_weight.*H \\+ R"):
        K.compute_confidence_scores(*args[:2], case.confidence_weight[:8], *args[3:], **kwargs)
    with pytest.raises(TypeError, match="draft_hidden_states"):
        K.compute_confidence_scores(case.draft_hidden_states.float(), *args[1:], **kwargs)
    with pytest.raises(ValueError, match="row stride"):
        K.compute_confidence_scores(*args, **{**kwargs, "hidden_offset": 1})
    with pytest.raises(ValueError, match="confidence_bias"):
        K.compute_confidence_scores(*args[:3], case.confidence_bias.repeat(2), *args[4:], **kwargs)
    with pytest.raises(TypeError, match="confidence_with_markov"):
        K.compute_confidence_scores(*args, **{**kwargs, "confidence_with_markov": 1})
    with pytest.raises(ValueError, match="first_prev_tokens.*16"):
        K.compute_confidence_scores(*args[:4], torch.tensor([0, 16], dtype=torch.int32), args[5], **kwargs)
    bad = case.draft_token_ids.clone()
    bad[0, 1] = -3
    with pytest.raises(ValueError, match=r"draft_token_ids\[:, :2\].*-3"):
        K.compute_confidence_scores(*args[:5], bad, **kwargs)
    bad[0, 1], bad[0, 2] = 0, -3  # the last column is never read
    K.compute_confidence_scores(*args[:5], bad, **kwargs)


def test_threshold_scheduler_bad_input():
    case = confidence_case(2, 3, 8, 4, 16)
    with pytest.raises(ValueError, match="threshold"):
        K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=float("nan"))
    with pytest.raises(TypeError, match="threshold"):
        K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold="0.5")
    with pytest.raises(ValueError, match="min_proposal_len"):
        K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=0.5, min_proposal_len=-1)
    with pytest.raises(TypeError, match="max_proposal_len"):
        K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=0.5, max_proposal_len=2.0)


def test_sps_scheduler_bad_input():
    case = confidence_case(2, 3, 8, 4, 16)
    with pytest.raises(ValueError, match="survival_floor"):
        K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=1.5)
    with pytest.raises(TypeError, match="survival_floor"):
        K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=None)
    with pytest.raises(ValueError, match="markov_w1"):
        K.compute_confidence_and_sps_proposal_lengths(case.draft_hidden_states, case.markov_w1[0],
                                                      *case.args()[2:], **case.kwargs())


# ------------------------------------------------------------------------------ schedulers on given scores


@pytest.mark.parametrize("threshold, floor, lo, hi", [(0.5, 0.0, 1, 0), (0.3, 0.4, 2, 5), (0.0, 0.9, 3, 6)])
def test_public_schedulers_on_scores_agree_with_the_fused_head(threshold, floor, lo, hi):
    case = confidence_case(6, 7, 32, 8, 50, seed=11)
    bounds = dict(min_proposal_len=lo, max_proposal_len=hi)
    scores, lengths = K.compute_confidence_and_proposal_lengths(*case.args(), **case.kwargs(), threshold=threshold, **bounds)
    assert torch.equal(K.threshold_proposal_lengths(scores, threshold, **bounds), lengths)
    scores, lengths = K.compute_confidence_and_sps_proposal_lengths(*case.args(), **case.kwargs(), survival_floor=floor,
                                                                    **bounds)
    assert torch.equal(K.sps_proposal_lengths(scores, floor, **bounds), lengths)


def test_public_schedulers_on_scores_bad_input():
    scores = torch.full((2, 4), 0.9)
    with pytest.raises(TypeError, match="confidence_scores must have dtype torch.float32"):
        K.threshold_proposal_lengths(scores.double(), 0.5)
    with pytest.raises(ValueError, match="confidence_scores must be 2-D"):
        K.sps_proposal_lengths(scores[0], 0.0)
    with pytest.raises(ValueError, match="survival_floor must be in"):
        K.sps_proposal_lengths(scores, 1.5)
    with pytest.raises(ValueError, match="min_proposal_len must be in"):
        K.threshold_proposal_lengths(scores, 0.5, min_proposal_len=-1)


# ------------------------------------------------------------------------------ Triton backend


CONFIDENCE_SHAPES = [
    # B, P, H, R, dtype, with_markov, hidden_stride, hidden_offset
    (1, 1, 64, 8, torch.float16, True, 0, 0),
    (3, 4, 300, 16, torch.bfloat16, True, 6, 2),
    (8, 7, 64, 64, torch.float16, False, 0, 0),
    (3, 7, 100, 256, torch.float16, True, 8, 1),
]


@requires_triton
@pytest.mark.parametrize("batch, width, hidden, rank, dtype, with_markov, stride, offset", CONFIDENCE_SHAPES)
def test_confidence_and_schedulers_match_reference(batch, width, hidden, rank, dtype, with_markov, stride, offset):
    case = confidence_case(batch, width, hidden, rank, 97, dtype, with_markov=with_markov, hidden_stride=stride,
                           hidden_offset=offset, device=DEVICE, seed=batch + width)

    def heads():
        scores = K.compute_confidence_scores(*case.args(), **case.kwargs())
        threshold = [K.compute_confidence_and_proposal_lengths(*case.args(), threshold=t, min_proposal_len=lo,
                                                               max_proposal_len=hi, **case.kwargs())
                     for t, lo, hi in ((0.3, 1, 0), (0.0, 2, 5), (0.7, 3, 2))]
        sps = [K.compute_confidence_and_sps_proposal_lengths(*case.args(), survival_floor=f, min_proposal_len=lo,
                                                             max_proposal_len=hi, **case.kwargs())
               for f, lo, hi in ((0.0, 1, 0), (0.4, 2, 6), (1.0, 1, 3))]
        return scores, threshold, sps

    (ref_scores, ref_thr, ref_sps), (scores, thr, sps) = on_backends(heads)
    torch.testing.assert_close(scores, ref_scores, atol=1e-6, rtol=0)
    for (ref_conf, ref_len), (conf, length) in zip(ref_thr + ref_sps, thr + sps, strict=True):
        torch.testing.assert_close(conf, ref_conf, atol=1e-6, rtol=0)
        assert_same(ref_len, length)


@requires_triton
def test_confidence_nvidia_vectors_10_and_11():
    with K.use_backend("triton"):
        case = nvidia_confidence_threshold_case(device=DEVICE)
        conf, length = K.compute_confidence_and_proposal_lengths(*case.args(), threshold=0.5, min_proposal_len=1,
                                                                 max_proposal_len=3, **case.kwargs())
        torch.testing.assert_close(conf.cpu(), torch.tensor([[0.8807971, 0.7310586, 0.1192029]]), atol=1e-5, rtol=0)
        assert length.tolist() == [2]
        case = nvidia_confidence_sps_case(device=DEVICE)
        conf, length = K.compute_confidence_and_sps_proposal_lengths(*case.args(), survival_floor=0.0,
                                                                     min_proposal_len=1, max_proposal_len=4,
                                                                     **case.kwargs())
        torch.testing.assert_close(conf.cpu(), torch.tensor([[0.9525741, 0.5, 0.5, 0.5]]), atol=1e-5, rtol=0)
        assert length.tolist() == [2]


@requires_triton
@pytest.mark.parametrize("scores, floor, want", SPS_VECTORS)
def test_sps_spec_vectors(scores, floor, want):
    case = confidence_case_from_scores([scores], device=DEVICE)
    with K.use_backend("triton"):
        _, length = K.compute_confidence_and_sps_proposal_lengths(*case.args(), survival_floor=floor, **case.kwargs())
    assert length.tolist() == [want]
