"""Triton kernels of the greedy path vs the PyTorch reference (markov, verify, confidence families).

On the CPU these run under ``TRITON_INTERPRET=1`` with small shapes (V not a multiple of any tile);
on a GPU the same tests run compiled, plus the ``gpu`` tests at real sizes and a CUDA-graph replay.

Tolerances: the ``exact`` builders of ``kernel_cases`` put every value on a dyadic grid where all
products and partial sums are exact in fp32, so there both backends must agree bit for bit
(token ids, packed keys, stacked rows, ties included). Gaussian inputs compare floats to
``atol = rtol = 1e-5`` (fp32 summation order) and token ids exactly (the seeds give no near-ties).
Confidences go through ``exp``, whose last bits differ between libraries: ``atol = 1e-6``; lengths
are compared exactly (the grid inputs keep the scores away from the scheduler's boundaries).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, gpu, requires_triton
from kernel_cases import (
    SPS_VECTORS,
    confidence_case,
    confidence_case_from_scores,
    greedy_accept_case,
    markov_case,
    nvidia_confidence_sps_case,
    nvidia_confidence_threshold_case,
    nvidia_fp8_step_case,
    nvidia_fused_step_case,
)

import dspark.kernels as K
from dspark.kernels.reference.markov import max_greedy_keys, pack_greedy_keys, unpack_greedy_keys

pytestmark = requires_triton

BACKENDS = ("reference", "triton")


def on_backends(run):
    """``run()`` under the reference and then the Triton backend: ``(reference, triton)`` results."""
    results = []
    for name in BACKENDS:
        with K.use_backend(name):
            results.append(run())
    return results


def assert_same(expected, actual):
    """Bit-identical tensors (NaN equal to NaN), or tuples of them."""
    if isinstance(expected, tuple):
        for e, a in zip(expected, actual, strict=True):
            assert_same(e, a)
        return
    assert expected.dtype == actual.dtype and expected.shape == actual.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def fp8_weights(case):
    """The case's W2 quantised by the reference (both backends then read the same codes)."""
    with K.use_backend("reference"):
        return K.quantize_markov_w2_fp8(case.markov_w2)


def run_round(case, fp8: bool):
    """A whole round with preallocated buffers; returns (tokens, slots, stacked rows)."""
    slots, tokens, stacked = case.greedy_slots(), torch.empty_like(case.draft_token_ids), case.stacked_logits(-7.0)
    w2, scales = fp8_weights(case) if fp8 else (case.markov_w2, None)
    K.markov_greedy_round(case.backbone_logits, case.markov_w1, w2, case.first_prev_tokens, proposal_len=case.proposal_len,
                          w2_row_scales=scales, greedy_slots=slots, draft_token_ids=tokens, stacked_logits=stacked,
                          **case.kwargs())
    return tokens, slots, stacked


# ------------------------------------------------------------------------------ Markov steps


ROUND_SHAPES = [
    # B, P, V, R, dtype, logits_stride, logits_offset, fp8
    (1, 1, 131, 8, torch.float16, 0, 0, False),
    (3, 4, 1000, 64, torch.bfloat16, 6, 1, False),
    (8, 7, 1000, 16, torch.float16, 0, 0, False),
    (3, 7, 131, 256, torch.bfloat16, 0, 0, False),
    (3, 4, 1000, 64, torch.float16, 0, 0, True),
    (8, 1, 131, 16, torch.bfloat16, 3, 2, True),
    (1, 7, 1000, 256, torch.float16, 0, 0, True),
]


@pytest.mark.parametrize("batch, width, vocab, rank, dtype, stride, offset, fp8", ROUND_SHAPES)
def test_round_matches_reference_exactly(batch, width, vocab, rank, dtype, stride, offset, fp8):
    case = markov_case(batch, width, vocab, rank, dtype, logits_stride=stride, logits_offset=offset, device=DEVICE)
    expected, actual = on_backends(lambda: run_round(case, fp8))
    assert_same(expected, actual)
    assert (actual[2][:, 0] == -7.0).all()  # depth row 0 is the caller's


@pytest.mark.parametrize("dtype, fp8", [(torch.float16, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_fused_steps_match_reference_on_gaussian_inputs(dtype, fp8):
    case = markov_case(3, 4, 1000, 64, dtype, exact=False, flat=True, device=DEVICE, seed=3)
    w2, scales = fp8_weights(case) if fp8 else (case.markov_w2, None)

    def steps():
        slots, stacked = case.greedy_slots(), case.stacked_logits()
        for step in range(case.proposal_len):
            if fp8:
                K.markov_greedy_fused_step_fp8(case.backbone_logits, case.markov_w1, w2, scales, case.first_prev_tokens,
                                               slots, step, stacked_logits=stacked, stacked_depth_row=step + 1)
            else:
                K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, w2, case.first_prev_tokens, slots, step,
                                           stacked_logits=stacked, stacked_depth_row=step + 1)
        return unpack_greedy_keys(slots), stacked

    (ref_tokens, ref_stacked), (tokens, stacked) = on_backends(steps)
    assert_same(ref_tokens, tokens)
    torch.testing.assert_close(stacked, ref_stacked, atol=1e-5, rtol=1e-5)


def test_fused_step_merges_with_older_slot_content():
    # NVIDIA's atomicMax contract: the slot keeps the larger of its content and the step's key.
    case = markov_case(3, 2, 131, 16, device=DEVICE, seed=5)
    high = pack_greedy_keys(torch.tensor([1e9]), torch.tensor([17]))  # beats every real value
    low = pack_greedy_keys(torch.tensor([-1e9]), torch.tensor([99]))

    def step():
        slots = case.greedy_slots()
        slots[0, 0], slots[1, 0] = high.to(DEVICE)[0], low.to(DEVICE)[0]
        K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, slots, 0)
        return slots

    expected, actual = on_backends(step)
    assert_same(expected, actual)
    assert int(unpack_greedy_keys(actual)[0, 0]) == 17


def test_packed_keys_are_bit_exact_on_special_values():
    """W1 = 0, so the keys are those of the backbone rows (+ a zero dot): ties across tiles, NaN, -inf."""
    vocab, batch = 131, 8
    case = markov_case(batch, 1, vocab, 16, device=DEVICE)
    case.markov_w1.zero_()
    rows = torch.full((batch, vocab), -3.0)
    rows[0, 5] = rows[0, 129] = 2.5  # tie across the 128-wide tile boundary: index 5
    rows[1, 130] = 4.0  # winner in the tail tile
    rows[2] = float("-inf")
    rows[2, 7], rows[2, 3] = 0.0, -0.0  # -0 + (zero dot) is +0: a tie, index 3
    rows[3, 40] = float("nan")  # NaN outranks everything
    rows[4, 60] = -torch.tensor(float("nan"))  # -NaN ranks lowest (CPU; a GPU add makes it +NaN)
    rows[5] = float("-inf")  # all -inf: index 0
    rows[6] = -1e30  # all negative: the padding lanes of the tail tile (value 0) must not win
    case.backbone_logits.copy_(rows.view(batch, 1, vocab))

    def step():
        slots = case.greedy_slots()
        K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, slots, 0)
        return slots

    expected, actual = on_backends(step)
    assert_same(expected, actual)
    tokens = unpack_greedy_keys(actual[:, 0]).tolist()
    assert [tokens[b] for b in (0, 1, 2, 3, 5, 6, 7)] == [5, 130, 3, 40, 0, 0, 0]
    finite = [0, 1, 5, 6, 7]  # rows whose keys do not depend on how the device adds to NaN or -0
    want = max_greedy_keys(pack_greedy_keys(rows[finite], torch.arange(vocab)))
    assert_same(want, actual.cpu()[finite, 0])


@pytest.mark.parametrize("exact", [True, False])
def test_build_markov_logits_matches_reference(exact):
    case = markov_case(3, 4, 1000, 64, torch.bfloat16, logits_stride=5, logits_offset=1, exact=exact, device=DEVICE)
    for step in (0, 3):
        expected, actual = on_backends(lambda: K.build_markov_logits(
            case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, case.draft_token_ids, step,
            **case.kwargs()))
        tol = 0 if exact else 1e-5
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_bad_token_ids_are_clamped_not_read_out_of_range():
    # On the GPU nobody validates ids (that would sync the host): the kernel clamps them into [0, V).
    from dspark.kernels.triton import greedy

    case = markov_case(2, 2, 131, 16, device=DEVICE)
    logits = case.backbone_logits.reshape(-1, case.vocab)

    def corrected(ids):
        draft = torch.stack([ids, ids], dim=1)
        return tuple(greedy.build_markov_logits(logits, case.markov_w1, case.markov_w2, ids, draft, step, 2, 0)
                     for step in (0, 1))

    bad = torch.tensor([-5, 1000], dtype=torch.int32, device=DEVICE)
    good = torch.tensor([0, case.vocab - 1], dtype=torch.int32, device=DEVICE)
    assert_same(corrected(good), corrected(bad))
    # an unwritten (zero) previous slot unpacks to -1 and reads row 0
    slots, slots_row0 = case.greedy_slots(), case.greedy_slots()
    slots_row0[:, 0] = pack_greedy_keys(torch.zeros(2), torch.zeros(2, dtype=torch.long)).to(DEVICE)
    for s in (slots, slots_row0):
        greedy.markov_greedy_fused_step(logits, case.markov_w1, case.markov_w2, good, s, 1, None, 0, 2, 0)
    assert_same(slots[:, 1], slots_row0[:, 1])


# ------------------------------------------------------------------------------ FP8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_fp8_matches_reference_codes_and_scales(dtype):
    gen = torch.Generator().manual_seed(11)
    w2 = torch.randn(131, 64, generator=gen) * torch.logspace(-7, 3, 131)[:, None]  # tiny rows: subnormal scales
    w2[3] = 0.0  # zero row: scale 1, codes 0
    # absmax 448 gives scale 1: these entries sit exactly halfway between E4M3 neighbours (ties to even)
    w2[4, :8] = torch.tensor([448.0, 1.0625, 1.1875, -2.0 ** -10, 3 * 2.0 ** -10, 11 * 2.0 ** -10, 15 * 2.0 ** -7, 232.0])
    w2 = w2.to(dtype)
    # The reference runs on the CPU: on CUDA, PyTorch divides by the scalar 448 as a * (1/448),
    # which is not the correctly rounded fp32 division of kernels.md 3.15.
    with K.use_backend("reference"):
        expected = K.quantize_markov_w2_fp8(w2)
    with K.use_backend("triton"):
        actual = tuple(t.cpu() for t in K.quantize_markov_w2_fp8(w2.to(DEVICE)))
    assert_same(expected, actual)
    assert (actual[0][3] == 0).all() and float(actual[1][3]) == 1.0


def test_fp8_step_matches_fp16_on_nvidia_vector_15():
    case, spikes = nvidia_fp8_step_case(device=DEVICE)
    with K.use_backend("triton"):
        fp16 = run_round(case, fp8=False)
        fp8 = run_round(case, fp8=True)
    assert_same(spikes, fp16[0])
    assert_same(spikes, fp8[0])
    bound = case.rank * float(case.markov_w2.float().abs().max()) * 0.125
    assert float((fp8[2] - fp16[2])[:, 1:].abs().max()) <= bound


def test_fused_step_nvidia_vector_14():
    case = nvidia_fused_step_case(device=DEVICE)
    with K.use_backend("triton"):
        tokens, _, stacked = run_round(case, fp8=False)
    w1, w2 = case.markov_w1.double().cpu(), case.markov_w2.double().cpu()
    prev = case.first_prev_tokens.long().cpu()
    for step in range(case.proposal_len):
        corrected = case.base_rows(step).double().cpu() + w1[prev] @ w2.T  # CPU reference along the chain
        torch.testing.assert_close(stacked[:, step + 1].double().cpu(), corrected, atol=2e-3, rtol=0)
        won = corrected.gather(1, tokens[:, step].long().cpu()[:, None])[:, 0]
        assert (won >= corrected.max(dim=1).values - 2e-3).all()
        prev = tokens[:, step].long().cpu()


# ------------------------------------------------------------------------------ tiny kernels


def test_finalize_and_store_top1_match_reference():
    keys = pack_greedy_keys(torch.randn(4, 5), torch.randint(0, 1 << 31, (4, 5))).to(DEVICE)
    keys[1, 2] = 0  # never written: unpacks to -1
    expected, actual = on_backends(lambda: K.finalize_greedy_draft_tokens(keys))
    assert_same(expected, actual)
    assert int(actual[1, 2]) == -1

    top1 = torch.tensor([[3], [9], [0], [151935]], dtype=torch.int32, device=DEVICE)

    def store():
        draft = torch.full((4, 3), -1, dtype=torch.int32, device=DEVICE)
        K.store_draft_step_top1(top1, draft, 2)
        return draft

    assert_same(*on_backends(store))


def test_build_verify_tokens_and_fill_proposal_lengths_match_reference():
    last = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    draft = torch.tensor([[7, 8, 9]], dtype=torch.int32, device=DEVICE)
    with K.use_backend("triton"):
        assert K.build_verify_tokens(last, draft, 1).tolist() == [[5, 7]]  # NVIDIA vector 12
    last = torch.randint(0, 1000, (5,), dtype=torch.int32, device=DEVICE)
    draft = torch.randint(0, 1000, (5, 7), dtype=torch.int32, device=DEVICE)
    for p_v in (1, 4, 7):
        assert_same(*on_backends(lambda: K.build_verify_tokens(last, draft, p_v)))
    for batch, length in ((0, 3), (1, 7), (1500, 4)):
        assert_same(*on_backends(lambda: K.fill_proposal_lengths(batch, length, device=DEVICE)))


# ------------------------------------------------------------------------------ greedy accept


@pytest.mark.parametrize("batch, stride, p_v, vocab, flat", [
    (1, 1, 1, 131, False),
    (3, 4, 3, 1000, True),
    (8, 7, 7, 1000, False),
    (4, 7, 4, 4099, True),  # two argmax slices with a 3-entry tail
])
def test_greedy_accept_matches_reference(batch, stride, p_v, vocab, flat):
    case = greedy_accept_case(batch, stride, p_v, vocab, flat=flat, device=DEVICE, seed=batch)
    expected, actual = on_backends(lambda: K.greedy_accept(*case.args()))
    assert_same(expected, actual)


def test_greedy_accept_ties_across_slices_go_to_the_lowest_index():
    vocab = 4099
    logits = torch.full((3, vocab), -1.0)
    logits[0, 4097] = logits[0, 5] = 3.0  # tie across the two slices
    logits[1, 4098] = 3.0  # max in the tail of the last slice
    logits[2] = float("-inf")
    logits[2, 4096] = float("nan")  # NaN never wins; all -inf gives 0
    with K.use_backend("triton"):
        drafts = torch.tensor([[5, 4098]], dtype=torch.int32, device=DEVICE)
        accepted, length = K.greedy_accept(logits.to(DEVICE), drafts, torch.tensor([2], dtype=torch.int32, device=DEVICE), 2)
    assert accepted.tolist() == [[5, 4098, 0]] and length.tolist() == [3]


# ------------------------------------------------------------------------------ confidence


CONFIDENCE_SHAPES = [
    # B, P, H, R, dtype, with_markov, hidden_stride, hidden_offset
    (1, 1, 64, 8, torch.float16, True, 0, 0),
    (3, 4, 300, 16, torch.bfloat16, True, 6, 2),
    (8, 7, 64, 64, torch.float16, False, 0, 0),
    (3, 7, 100, 256, torch.float16, True, 8, 1),
]


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


@pytest.mark.parametrize("scores, floor, want", SPS_VECTORS)
def test_sps_spec_vectors(scores, floor, want):
    case = confidence_case_from_scores([scores], device=DEVICE)
    with K.use_backend("triton"):
        _, length = K.compute_confidence_and_sps_proposal_lengths(*case.args(), survival_floor=floor, **case.kwargs())
    assert length.tolist() == [want]


# ------------------------------------------------------------------------------ GPU: real sizes, CUDA graphs


@gpu
@pytest.mark.parametrize("rank, dtype, fp8", [(256, torch.float16, False), (64, torch.bfloat16, False), (256, torch.float16, True)])
def test_real_size_round_matches_reference(rank, dtype, fp8):
    case = markov_case(64, 7, 151936, rank, dtype, logits_stride=8, logits_offset=1, device=DEVICE)
    expected, actual = on_backends(lambda: run_round(case, fp8))
    assert_same(expected, actual)


@gpu
def test_real_size_greedy_accept_matches_reference():
    case = greedy_accept_case(64, 7, 7, 151936, device=DEVICE)
    assert_same(*on_backends(lambda: K.greedy_accept(*case.args())))


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_round_replays_as_a_cuda_graph(fp8):
    case = markov_case(8, 7, 151936, 256, device=DEVICE)
    w2, scales = fp8_weights(case) if fp8 else (case.markov_w2, None)
    slots, tokens = case.greedy_slots(), torch.empty_like(case.draft_token_ids)
    first = case.first_prev_tokens.clone()

    def round_():
        K.markov_greedy_round(case.backbone_logits, case.markov_w1, w2, first, proposal_len=case.proposal_len,
                              w2_row_scales=scales, greedy_slots=slots, draft_token_ids=tokens)

    with K.use_backend("triton"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            round_()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            round_()
        for seed in range(3):
            first.copy_(torch.randint(0, case.vocab, first.shape, generator=torch.Generator().manual_seed(seed),
                                      dtype=torch.int32))
            case.backbone_logits.add_(0.5)  # new inputs in the captured buffers
            graph.replay()
            replayed = tokens.clone()
            with K.use_backend("reference"):
                expected = K.markov_greedy_round(case.backbone_logits, case.markov_w1, w2, first,
                                                 proposal_len=case.proposal_len, w2_row_scales=scales)
            assert_same(expected, replayed)
