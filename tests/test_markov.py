"""Markov family: correction logits, packed keys, fused greedy steps, FP8 W2, the greedy round.

The first part tests the reference (the spec) against float64 oracles and NVIDIA's vectors; the
second runs the Triton backend against the reference. On the CPU Triton runs under
``TRITON_INTERPRET=1`` with small shapes (V not a multiple of any tile); on a GPU the same tests run
compiled, plus the ``gpu`` tests at real sizes and a CUDA-graph replay.

Tolerances: the ``exact`` builders of ``kernel_cases`` put every value on a dyadic grid where all
products and partial sums are exact in fp32, so there both backends must agree bit for bit
(token ids, packed keys, stacked rows, ties included). Gaussian inputs compare floats to
``atol = rtol = 1e-5`` (fp32 summation order) and token ids exactly (the seeds give no near-ties).
"""

import math

import numpy as np
import pytest
import torch
from conftest import DEVICE, INTERPRETER_WARNINGS, assert_same, gpu, on_backends, requires_triton
from kernel_cases import markov_case, nvidia_fp8_step_case, nvidia_fused_step_case

import dspark.kernels as K
from dspark.kernels.reference.markov import max_greedy_keys, pack_greedy_keys, unpack_greedy_keys

pytestmark = [pytest.mark.usefixtures("reference_backend"), INTERPRETER_WARNINGS]

U64 = (1 << 64) - 1


def u64(keys: torch.Tensor) -> list[int]:
    return [k & U64 for k in keys.reshape(-1).tolist()]


def corrected_f64(case, step: int, prev: torch.Tensor) -> torch.Tensor:
    """float64 oracle of kernels.md 3.11 for one step given the previous tokens."""
    w1 = case.markov_w1.double()[prev.long()]
    return case.base_rows(step).double() + w1 @ case.markov_w2.double().t()


def run_steps(case, *, fp8=None, stacked=None):
    """P fused steps on fresh slots; returns the slots. ``fp8`` = (codes, scales) selects FP8."""
    slots = case.greedy_slots()
    for step in range(case.proposal_len):
        extra = {"stacked_logits": stacked, "stacked_depth_row": step + 1} if stacked is not None else {}
        if fp8 is None:
            K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens,
                                       slots, step, **extra, **case.kwargs())
        else:
            K.markov_greedy_fused_step_fp8(case.backbone_logits, case.markov_w1, *fp8, case.first_prev_tokens, slots,
                                           step, **extra, **case.kwargs())
    return slots


# ------------------------------------------------------------------------------ host helpers


def test_markov_partial_count():
    assert K.markov_partial_count(151936) == 9496
    assert [K.markov_partial_count(v) for v in (1, 16, 17, 131)] == [1, 1, 2, 9]
    with pytest.raises(ValueError, match="vocab_size"):
        K.markov_partial_count(0)
    with pytest.raises(TypeError, match="vocab_size"):
        K.markov_partial_count(16.0)


def test_fused_greedy_supported():
    assert all(K.fused_greedy_supported(r) for r in range(8, 513, 8))
    assert not any(K.fused_greedy_supported(r) for r in (-8, 0, 4, 12, 100, 520, 1024))
    with pytest.raises(TypeError, match="markov_rank"):
        K.fused_greedy_supported("64")
    with pytest.raises(TypeError, match="markov_rank"):
        K.fused_greedy_supported(64.0)


# ------------------------------------------------------------------------------ packed keys


def test_packed_key_examples_of_the_spec():
    inf = float("inf")
    values = torch.tensor([1.5, 1.5, -2.0, -inf, inf])
    keys = pack_greedy_keys(values, torch.tensor([7, 3, 0, 0, 1]))
    assert keys.dtype == torch.int64
    assert u64(keys) == [0xBFC00000FFFFFFF8, 0xBFC00000FFFFFFFC, 0x3FFFFFFFFFFFFFFF, 0x007FFFFFFFFFFFFF,
                         0xFF800000FFFFFFFE]
    assert unpack_greedy_keys(keys).tolist() == [7, 3, 0, 0, 1]
    assert unpack_greedy_keys(keys).dtype == torch.int32
    assert u64(max_greedy_keys(keys[:2])) == [0xBFC00000FFFFFFFC]  # equal values: lower index wins


def test_packed_key_quirks():
    nan = torch.tensor(float("nan"))
    neg_nan = -nan
    assert neg_nan.view(torch.int32) < 0  # really a negative NaN
    values = torch.stack([torch.tensor(0.0), torch.tensor(-0.0), torch.tensor(float("inf")), nan, neg_nan,
                          torch.tensor(-float("inf"))])
    keys = u64(pack_greedy_keys(values, torch.zeros(6, dtype=torch.int64)))
    assert keys[0] == 0x80000000FFFFFFFF and keys[1] == 0x7FFFFFFFFFFFFFFF  # +0 above -0
    assert keys[3] > keys[2] > keys[0]  # +NaN above +inf
    assert keys[4] < keys[5]  # -NaN below -inf
    assert min(keys) > 0  # every real key is above the empty slot
    assert unpack_greedy_keys(torch.zeros(3, dtype=torch.int64)).tolist() == [-1, -1, -1]


def test_packed_key_order_is_value_then_lower_index():
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(-4, 5, (300,), generator=gen).float() / 4
    values[:6] = torch.tensor([float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38])
    indices = torch.randint(0, 2**32, (300,), generator=gen)
    keys = u64(pack_greedy_keys(values, indices))
    vals, idx = values.tolist(), indices.tolist()
    for i in range(0, 300, 7):
        for j in range(300):
            expect = vals[i] > vals[j] or (vals[i] == vals[j] and idx[i] < idx[j])
            assert (keys[i] > keys[j]) == expect, (vals[i], idx[i], vals[j], idx[j])
    assert unpack_greedy_keys(pack_greedy_keys(values, indices % 2**31)).tolist() == (indices % 2**31).tolist()


# ------------------------------------------------------------------------------ build_markov_logits


@pytest.mark.parametrize("batch,width,vocab,rank,dtype,stride,offset,flat", [
    (1, 1, 131, 8, torch.float16, 0, 0, False),
    (3, 4, 1000, 16, torch.bfloat16, 0, 0, True),
    (2, 7, 4099, 64, torch.float16, 9, 1, False),
    (3, 3, 257, 5, torch.bfloat16, 4, 1, True),  # any rank works here
])
def test_build_markov_logits_matches_float64(batch, width, vocab, rank, dtype, stride, offset, flat):
    case = markov_case(batch, width, vocab, rank, dtype, logits_stride=stride, logits_offset=offset, flat=flat)
    for step in range(width):
        prev = case.first_prev_tokens if step == 0 else case.draft_token_ids[:, step - 1]
        z = K.build_markov_logits(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens,
                                  case.draft_token_ids, step, **case.kwargs())
        assert z.dtype == torch.float32 and z.shape == (batch, vocab)
        assert torch.equal(z.double(), corrected_f64(case, step, prev))  # exact grid: no rounding at all


def test_build_markov_logits_gaussian_tolerance():
    case = markov_case(2, 3, 1000, 256, exact=False)
    z = K.build_markov_logits(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens,
                              case.draft_token_ids, 2)
    torch.testing.assert_close(z.double(), corrected_f64(case, 2, case.draft_token_ids[:, 1]), atol=1e-4, rtol=1e-5)


def test_build_markov_logits_bad_input():
    case = markov_case(2, 3, 50, 8)
    args = [case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, case.draft_token_ids]
    with pytest.raises(ValueError, match="step"):
        K.build_markov_logits(*args, 3)
    with pytest.raises(TypeError, match="markov_w2"):
        K.build_markov_logits(*args[:2], case.markov_w2.float(), *args[3:], 0)
    with pytest.raises(TypeError, match="draft_token_ids"):
        K.build_markov_logits(*args[:4], case.draft_token_ids.long(), 1)
    bad = case.draft_token_ids.clone()
    bad[1, 0] = 50
    with pytest.raises(ValueError, match=r"draft_token_ids\[:, 0\].*50"):
        K.build_markov_logits(*args[:4], bad, 1)
    with pytest.raises(ValueError, match="first_prev_tokens"):
        K.build_markov_logits(*args[:3], torch.tensor([0, -1], dtype=torch.int32), case.draft_token_ids, 0)
    with pytest.raises(ValueError, match="backbone_logits"):
        K.build_markov_logits(case.backbone_logits[:, :, :49], *args[1:], 0)
    with pytest.raises(ValueError, match="row stride"):
        K.build_markov_logits(*args, 2, logits_offset=1)
    with pytest.raises(ValueError, match="markov_w2.*markov_w1"):
        K.build_markov_logits(args[0], case.markov_w1[:, :4], *args[2:], 0)


# ------------------------------------------------------------------------------ fused greedy steps


@pytest.mark.parametrize("batch,width,vocab,rank,dtype,stride,offset", [
    (1, 1, 131, 8, torch.float16, 0, 0),
    (3, 4, 1000, 64, torch.bfloat16, 0, 0),
    (2, 4, 4099, 256, torch.float16, 6, 2),
    (8, 7, 131, 512, torch.float16, 8, 1),
])
def test_fused_steps_match_build_markov_logits_and_argmax(batch, width, vocab, rank, dtype, stride, offset):
    case = markov_case(batch, width, vocab, rank, dtype, logits_stride=stride, logits_offset=offset)
    stacked = case.stacked_logits(fill=-7.0)
    slots = run_steps(case, stacked=stacked)
    tokens = K.finalize_greedy_draft_tokens(slots)
    for step in range(width):
        z = K.build_markov_logits(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens,
                                  tokens, step, **case.kwargs())
        best = z.max(dim=1)
        assert torch.equal(tokens[:, step], best.indices.to(torch.int32))  # torch: first maximal index
        assert torch.equal(slots[:, step], pack_greedy_keys(best.values, best.indices))
        assert torch.equal(stacked[:, step + 1], z)
    assert (stacked[:, 0] == -7.0).all()


def test_fused_step_ties_go_to_the_lowest_index():
    case = markov_case(2, 2, 300, 8)
    case.backbone_logits[:, :, [17, 250, 299]] = 500.0  # far above any Markov correction (|dot| <= 6.2)
    case.markov_w2[[17, 250, 299]] = case.markov_w2[17].clone()
    tokens = K.finalize_greedy_draft_tokens(run_steps(case))
    assert (tokens == 17).all()


def test_fused_step_special_values(unchecked_values):
    case = markov_case(3, 1, 64, 8)
    case.markov_w2.zero_()  # corrected logits = backbone exactly
    logits = case.backbone_logits
    logits[0] = float("-inf")  # all -inf: key of (-inf, 0) wins
    logits[1, 0, 9] = float("nan")  # +NaN beats every number
    logits[2, 0, :] = -1.0
    logits[2, 0, 5] = -float("nan")  # -NaN never wins
    tokens = K.finalize_greedy_draft_tokens(run_steps(case))
    assert tokens[:, 0].tolist() == [0, 9, 0]


def test_fused_step_is_a_max_with_the_slot_content():
    case = markov_case(2, 2, 100, 16)
    slots = case.greedy_slots()
    stale = pack_greedy_keys(torch.tensor([1e30, -1e30]), torch.tensor([42, 42]))
    slots[:, 1] = stale
    K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, slots, 0)
    K.markov_greedy_fused_step(case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, slots, 1)
    assert slots[0, 1] == stale[0]  # atomicMax semantics: the larger stale key survives
    assert slots[1, 1] != stale[1]


def test_nvidia_vector_14_fused_step_matches_cpu_reference():
    case = nvidia_fused_step_case()
    stacked = case.stacked_logits()
    tokens = K.finalize_greedy_draft_tokens(run_steps(case, stacked=stacked))
    prev = case.first_prev_tokens
    for step in range(case.proposal_len):
        expect = corrected_f64(case, step, prev)
        torch.testing.assert_close(stacked[:, step + 1].double(), expect, atol=2e-3, rtol=0)
        winner = expect.gather(1, tokens[:, step : step + 1].long())[:, 0]
        assert ((expect.max(dim=1).values - winner) <= 2e-3).all()
        prev = tokens[:, step]


def test_nvidia_vector_15_fp8_matches_fp16_closely():
    case, spikes = nvidia_fp8_step_case()
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    stacked16, stacked8 = case.stacked_logits(), case.stacked_logits()
    tokens16 = K.finalize_greedy_draft_tokens(run_steps(case, stacked=stacked16))
    tokens8 = K.finalize_greedy_draft_tokens(run_steps(case, fp8=(codes, scales), stacked=stacked8))
    assert torch.equal(tokens16, spikes) and torch.equal(tokens8, spikes)
    bound = case.rank * case.markov_w2.float().abs().max().item() * 0.125
    assert (stacked8[:, 1:] - stacked16[:, 1:]).abs().max().item() <= bound


@pytest.mark.parametrize("rank,dtype", [(16, torch.float16), (64, torch.bfloat16), (512, torch.float16)])
def test_fp8_step_is_exact_on_the_exact_grid(rank, dtype):
    case = markov_case(3, 4, 1000, rank, dtype, logits_stride=5, logits_offset=1)
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    assert (scales == 2.0**-9).all()
    stacked16, stacked8 = case.stacked_logits(), case.stacked_logits()
    slots16 = run_steps(case, stacked=stacked16)
    slots8 = run_steps(case, fp8=(codes, scales), stacked=stacked8)
    assert torch.equal(slots16, slots8) and torch.equal(stacked16, stacked8)


def test_fp8_step_matches_dequantised_weights():
    case = markov_case(3, 3, 1000, 128, exact=False)
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    stacked = case.stacked_logits()
    tokens = K.finalize_greedy_draft_tokens(run_steps(case, fp8=(codes, scales), stacked=stacked))
    dequant = codes.view(torch.float8_e4m3fn).double() * scales.double()[:, None]
    prev = case.first_prev_tokens
    for step in range(3):
        expect = case.base_rows(step).double() + case.markov_w1.double()[prev.long()] @ dequant.t()
        torch.testing.assert_close(stacked[:, step + 1].double(), expect, atol=1e-4, rtol=1e-5)
        prev = tokens[:, step]


def test_fused_step_bad_input():
    case = markov_case(2, 3, 64, 8)
    slots = case.greedy_slots()
    args = [case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens]
    with pytest.raises(ValueError, match="step"):
        K.markov_greedy_fused_step(*args, slots, 3)
    with pytest.raises(TypeError, match="greedy_slots"):
        K.markov_greedy_fused_step(*args, slots.int(), 0)
    with pytest.raises(ValueError, match="greedy_slots.*contiguous"):
        K.markov_greedy_fused_step(*args, torch.zeros(3, 2, dtype=torch.int64).t(), 0)
    with pytest.raises(ValueError, match=r"greedy_slots\[:, 0\].*-1"):
        K.markov_greedy_fused_step(*args, slots, 1)  # step 0 never ran: the slot is empty
    with pytest.raises(ValueError, match="stacked_logits"):
        K.markov_greedy_fused_step(*args, slots, 0, stacked_logits=torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="stacked_depth_row"):
        K.markov_greedy_fused_step(*args, slots, 0, stacked_logits=case.stacked_logits(), stacked_depth_row=4)
    odd = markov_case(2, 3, 64, 12)
    with pytest.raises(ValueError, match="rank R = 12"):
        K.markov_greedy_fused_step(odd.backbone_logits, odd.markov_w1, odd.markov_w2, odd.first_prev_tokens, slots, 0)
    with pytest.raises(ValueError, match="markov_w1"):
        K.markov_greedy_fused_step(args[0], case.markov_w1.t(), *args[2:], slots, 0)


def test_fused_step_fp8_bad_input():
    case = markov_case(2, 3, 64, 32)
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    args = [case.backbone_logits, case.markov_w1]
    with pytest.raises(TypeError, match="w2_fp8"):
        K.markov_greedy_fused_step_fp8(*args, case.markov_w2, scales, case.first_prev_tokens, case.greedy_slots(), 0)
    with pytest.raises(TypeError, match="w2_row_scales"):
        K.markov_greedy_fused_step_fp8(*args, codes, scales.float(), case.first_prev_tokens, case.greedy_slots(), 0)
    with pytest.raises(TypeError, match="w2_row_scales"):
        K.markov_greedy_fused_step_fp8(*args, codes, None, case.first_prev_tokens, case.greedy_slots(), 0)
    with pytest.raises(ValueError, match="w2_row_scales"):
        K.markov_greedy_fused_step_fp8(*args, codes, scales[:10], case.first_prev_tokens, case.greedy_slots(), 0)
    odd = markov_case(2, 3, 64, 48)
    odd_codes, odd_scales = K.quantize_markov_w2_fp8(odd.markov_w2)  # R % 16 == 0 quantises ...
    with pytest.raises(ValueError, match="FP8 fused step"):  # ... but the FP8 step needs a power of two
        K.markov_greedy_fused_step_fp8(odd.backbone_logits, odd.markov_w1, odd_codes, odd_scales,
                                       odd.first_prev_tokens, odd.greedy_slots(), 0)


# ------------------------------------------------------------------------------ FP8 quantisation


def _e4m3_values() -> list[float]:
    """Value of every non-negative finite E4M3 code 0x00..0x7E."""
    values = []
    for code in range(0x7F):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


def _rederive(w2: torch.Tensor) -> tuple[list[list[int]], list[float]]:
    """Straightforward per-element FP8 quantisation (numpy float32 scalars, exhaustive RNE)."""
    table = _e4m3_values()
    codes, scales = [], []
    for row in w2.float().numpy():
        absmax = np.float32(np.max(np.abs(row)))
        scale = np.float32(absmax / np.float32(448.0)) if absmax > 0 else np.float32(1.0)
        inv = np.float32(np.float32(1.0) / scale)
        out = []
        for w in row:
            x = float(np.float32(w) * inv)
            mag = min(abs(x), 448.0)
            best = min(range(0x7F), key=lambda c: (abs(table[c] - mag), c & 1))  # nearest, ties to even
            out.append(best | (0x80 if math.copysign(1.0, x) < 0 else 0))
        codes.append(out)
        scales.append(float(np.float16(scale)))
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_matches_rederivation(dtype):
    gen = torch.Generator().manual_seed(3)
    w2 = (torch.randn(6, 16, generator=gen) * torch.tensor([1.0, 0.01, 30.0, 1e-3, 0.2, 5.0])[:, None]).to(dtype)
    w2[0, 3] = -0.0
    w2[1, 0] = w2[1].float().abs().max() * 0.999  # near-max entries exercise the top of the range
    w2[5].zero_()  # zero row: scale 1, codes 0
    codes, scales = K.quantize_markov_w2_fp8(w2)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float16
    expect_codes, expect_scales = _rederive(w2)
    assert codes.tolist() == expect_codes
    assert scales.float().tolist() == expect_scales
    assert scales[5] == 1.0 and (codes[5] == 0).all()


@pytest.mark.gpu
def test_quantize_reference_same_codes_on_cuda_and_cpu():
    w2 = (torch.randn(4096, 64, generator=torch.Generator().manual_seed(5)) * 0.3).half()
    with K.use_backend("reference"):
        cpu_codes, cpu_scales = K.quantize_markov_w2_fp8(w2)
        gpu_codes, gpu_scales = K.quantize_markov_w2_fp8(w2.cuda())
    assert torch.equal(cpu_codes, gpu_codes.cpu()) and torch.equal(cpu_scales, gpu_scales.cpu())


def test_quantize_saturates_past_448():
    w2 = torch.zeros(3, 16, dtype=torch.float16)
    big, small = 0.5048828125, 0.0030117034912109375  # absmax * (1 / (absmax/448)) = 448.00003 in fp32
    w2[0, 0], w2[0, 1] = big, -big
    w2[1, 5] = small  # its scale 6.7e-6 is an fp16 subnormal
    w2[2, 2] = 1e-7  # scale 2.2e-10 underflows to fp16 0, as NVIDIA's __float2half does
    for absmax in (big, small):
        x = np.float32(absmax) * (np.float32(1) / np.float32(np.float32(absmax) / np.float32(448)))
        assert x > 448  # the scaled value really is past +-448
    codes, scales = K.quantize_markov_w2_fp8(w2)
    assert codes[0, 0] == 0x7E and codes[0, 1] == 0xFE and codes[1, 5] == 0x7E  # +-448, never NaN (0x7F)
    assert 0 < scales[1] < 2.0**-14
    assert scales[2] == 0 and codes[2, 2] == 0x7E


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        K.quantize_markov_w2_fp8(torch.zeros(4, 24, dtype=torch.float16))
    with pytest.raises(TypeError, match="markov_w2"):
        K.quantize_markov_w2_fp8(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="markov_w2"):
        K.quantize_markov_w2_fp8(torch.zeros(16, dtype=torch.float16))
    bad = torch.zeros(4, 16, dtype=torch.float16)
    bad[2, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        K.quantize_markov_w2_fp8(bad)


# ------------------------------------------------------------------------------ finalize / store


def test_finalize_greedy_draft_tokens():
    values = torch.tensor([[0.5, -3.0], [float("-inf"), 2.0]])
    indices = torch.tensor([[4, 99], [0, 151935]])
    slots = pack_greedy_keys(values, indices)
    slots[1, 0] = 0  # never written
    tokens = K.finalize_greedy_draft_tokens(slots)
    assert tokens.dtype == torch.int32 and tokens.tolist() == [[4, 99], [-1, 151935]]
    with pytest.raises(TypeError, match="greedy_slots"):
        K.finalize_greedy_draft_tokens(slots.int())
    with pytest.raises(ValueError, match="greedy_slots"):
        K.finalize_greedy_draft_tokens(slots.reshape(-1))


def test_store_draft_step_top1():
    draft = torch.zeros(3, 4, dtype=torch.int32)
    K.store_draft_step_top1(torch.tensor([5, 6, 7], dtype=torch.int32), draft, 2)
    K.store_draft_step_top1(torch.tensor([[1], [2], [3]], dtype=torch.int32), draft, 0)
    assert draft.tolist() == [[1, 0, 5, 0], [2, 0, 6, 0], [3, 0, 7, 0]]
    with pytest.raises(ValueError, match="step"):
        K.store_draft_step_top1(torch.zeros(3, dtype=torch.int32), draft, 4)
    with pytest.raises(TypeError, match="top1_indices"):
        K.store_draft_step_top1(torch.zeros(3, dtype=torch.int64), draft, 0)
    with pytest.raises(ValueError, match="top1_indices"):
        K.store_draft_step_top1(torch.zeros(3, 2, dtype=torch.int32), draft, 0)
    with pytest.raises(ValueError, match="draft_token_ids"):
        K.store_draft_step_top1(torch.zeros(4, dtype=torch.int32), draft.t(), 0)
    with pytest.raises(ValueError, match="top1_indices"):
        K.store_draft_step_top1(torch.tensor([0, -2, 0], dtype=torch.int32), draft, 0)


# ------------------------------------------------------------------------------ whole greedy round


@pytest.mark.parametrize("fp8", [False, True])
def test_greedy_round_is_the_composition_of_steps(fp8):
    case = markov_case(3, 4, 1000, 64, torch.bfloat16, logits_stride=6, logits_offset=1, exact=False)
    w2, scales = K.quantize_markov_w2_fp8(case.markov_w2) if fp8 else (case.markov_w2, None)
    expect_stacked = case.stacked_logits(fill=3.0)
    expect = K.finalize_greedy_draft_tokens(
        run_steps(case, fp8=(w2, scales) if fp8 else None, stacked=expect_stacked))
    slots = torch.full((3, 4), -5, dtype=torch.int64)  # stale garbage: the round zeroes it first
    draft = torch.empty(3, 4, dtype=torch.int32)
    stacked = case.stacked_logits(fill=3.0)
    out = K.markov_greedy_round(case.backbone_logits, case.markov_w1, w2, case.first_prev_tokens, proposal_len=4,
                                w2_row_scales=scales, greedy_slots=slots, draft_token_ids=draft,
                                stacked_logits=stacked, **case.kwargs())
    assert out is draft and torch.equal(out, expect)
    assert torch.equal(stacked, expect_stacked)  # row 0 untouched, rows 1..P the corrected logits
    assert torch.equal(unpack_greedy_keys(slots), expect)
    fresh = K.markov_greedy_round(case.backbone_logits, case.markov_w1, w2, case.first_prev_tokens, proposal_len=4,
                                  w2_row_scales=scales, **case.kwargs())
    assert torch.equal(fresh, expect)


def test_greedy_round_bad_input():
    case = markov_case(2, 3, 64, 16)
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    args = [case.backbone_logits, case.markov_w1]
    first = case.first_prev_tokens
    with pytest.raises(ValueError, match="w2_row_scales"):
        K.markov_greedy_round(*args, codes, first, proposal_len=3)
    with pytest.raises(ValueError, match="w2_row_scales"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=3, w2_row_scales=scales)
    with pytest.raises(ValueError, match="proposal_len"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=0)
    with pytest.raises(ValueError, match="row stride"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=3, logits_offset=1)
    with pytest.raises(ValueError, match="greedy_slots"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=3,
                              greedy_slots=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="draft_token_ids"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=3, draft_token_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="stacked_logits"):
        K.markov_greedy_round(*args, case.markov_w2, first, proposal_len=3, stacked_logits=torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="first_prev_tokens"):
        K.markov_greedy_round(*args, case.markov_w2, torch.tensor([0, 64], dtype=torch.int32), proposal_len=3)


def test_greedy_functions_reject_nan_in_the_rows_they_read():
    case = markov_case(2, 3, 64, 16, logits_stride=5, logits_offset=1)
    args = [case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens]
    case.backbone_logits[:, 0] = float("nan")  # before the offset: never read
    case.backbone_logits[:, 4] = float("nan")  # after the P rows: never read
    expected = K.markov_greedy_round(*args, proposal_len=3, **case.kwargs())
    case.backbone_logits[1, 3, 7] = float("nan")  # step 2's row of entry 1
    with pytest.raises(ValueError, match="markov_greedy_round: backbone_logits rows 1..3 .*NaN"):
        K.markov_greedy_round(*args, proposal_len=3, **case.kwargs())
    slots = case.greedy_slots()
    K.markov_greedy_fused_step(*args, slots, 0, **case.kwargs())  # reads row 1 only
    K.markov_greedy_fused_step(*args, slots, 1, **case.kwargs())
    assert torch.equal(K.finalize_greedy_draft_tokens(slots)[:, :2], expected[:, :2])
    with pytest.raises(ValueError, match="markov_greedy_fused_step: backbone_logits rows 3..3 .*NaN"):
        K.markov_greedy_fused_step(*args, slots, 2, **case.kwargs())
    codes, scales = K.quantize_markov_w2_fp8(case.markov_w2)
    with pytest.raises(ValueError, match="markov_greedy_fused_step_fp8: backbone_logits .*NaN"):
        K.markov_greedy_fused_step_fp8(*args[:2], codes, scales, args[3], slots, 2, **case.kwargs())


# ------------------------------------------------------------------------------ Triton backend: Markov steps


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


@requires_triton
@pytest.mark.parametrize("batch, width, vocab, rank, dtype, stride, offset, fp8", ROUND_SHAPES)
def test_round_matches_reference_exactly(batch, width, vocab, rank, dtype, stride, offset, fp8):
    case = markov_case(batch, width, vocab, rank, dtype, logits_stride=stride, logits_offset=offset, device=DEVICE)
    expected, actual = on_backends(lambda: run_round(case, fp8))
    assert_same(expected, actual)
    assert (actual[2][:, 0] == -7.0).all()  # depth row 0 is the caller's


@requires_triton
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


@requires_triton
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


@requires_triton
def test_packed_keys_are_bit_exact_on_special_values(unchecked_values):
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


@requires_triton
@pytest.mark.parametrize("exact", [True, False])
def test_build_markov_logits_matches_reference(exact):
    case = markov_case(3, 4, 1000, 64, torch.bfloat16, logits_stride=5, logits_offset=1, exact=exact, device=DEVICE)
    for step in (0, 3):
        expected, actual = on_backends(lambda: K.build_markov_logits(
            case.backbone_logits, case.markov_w1, case.markov_w2, case.first_prev_tokens, case.draft_token_ids, step,
            **case.kwargs()))
        tol = 0 if exact else 1e-5
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


GEMM_CONFIGS = [  # one program per tile / persistent / R in chunks
    dict(BLOCK_V=64, BLOCK_R=64, NUM_STAGES=1, PROGRAMS_PER_SM=0, num_warps=4),
    dict(BLOCK_V=32, BLOCK_R=64, NUM_STAGES=2, PROGRAMS_PER_SM=1, num_warps=4),
    dict(BLOCK_V=64, BLOCK_R=16, NUM_STAGES=2, PROGRAMS_PER_SM=0, num_warps=4),
]


@requires_triton
@pytest.mark.parametrize("fp8", [False, True])
def test_every_gemm_configuration_gives_the_same_epilogues(fp8):
    """Rows, keys and group maxima bit for bit (exact inputs), softmax partials to fp32 rounding, for
    every tiling and pipelining of the one Markov GEMM, all epilogues in one launch."""
    from dspark.kernels.triton import filter as tfilter
    from dspark.kernels.triton import markov as tmarkov

    batch, vocab, rank = 3, 1000, 64
    case = markov_case(batch, 4, vocab, rank, torch.float16, device=DEVICE)
    w2, scales = K.quantize_markov_w2_fp8(case.markov_w2) if fp8 else (case.markov_w2, None)
    base = case.backbone_logits[:, 1]
    weights = (w2.view(torch.float8_e4m3fn).double() * scales.double()[:, None]) if fp8 else w2.double()
    want_rows = case.base_rows(1).double() + case.markov_w1.double()[case.first_prev_tokens.long()] @ weights.t()
    results = []
    for cfg in GEMM_CONFIGS:
        config = dict(cfg, BLOCK_B=16)
        tiles = tmarkov.markov_tiles(vocab, config)
        rows = torch.zeros(batch, vocab, device=DEVICE)
        keys = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
        m, s = (torch.zeros(batch * tiles, device=DEVICE) for _ in range(2))
        groups = torch.zeros(batch * -(-vocab // tfilter.GROUP), dtype=torch.int64, device=DEVICE)
        with K.use_backend("triton"):
            tmarkov.launch_markov(base, 4, case.markov_w1, w2, scales, case.first_prev_tokens, rows_out=rows,
                                  keys_out=keys, stats=(m, s), groups=groups, inv_temp=1.0, config=config)
        log_total = torch.logsumexp((m.double() + s.double().log()).view(batch, tiles), 1)  # the partials combined
        results.append((rows.cpu(), keys.cpu(), groups.cpu(), log_total.cpu()))
    rows0, keys0, groups0, log_total0 = results[0]
    torch.testing.assert_close(rows0.double(), want_rows.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(log_total0, torch.logsumexp(want_rows.cpu(), 1), atol=1e-5, rtol=0)
    assert_same(keys0, max_greedy_keys(pack_greedy_keys(rows0, torch.arange(vocab))))
    for rows, keys, groups, log_total in results[1:]:
        assert_same(rows0, rows)
        assert_same(keys0, keys)
        assert_same(groups0, groups)
        torch.testing.assert_close(log_total, log_total0, atol=1e-5, rtol=0)


@requires_triton
def test_bad_token_ids_are_clamped_not_read_out_of_range():
    # On the GPU nobody validates ids (that would sync the host): the kernel clamps them into [0, V).
    from dspark.kernels.triton import markov as tmarkov

    case = markov_case(2, 2, 131, 16, device=DEVICE)
    logits = case.backbone_logits.reshape(-1, case.vocab)

    def corrected(ids):
        draft = torch.stack([ids, ids], dim=1)
        return tuple(tmarkov.build_markov_logits(logits, case.markov_w1, case.markov_w2, None, ids, draft, step, 2, 0)
                     for step in (0, 1))

    bad = torch.tensor([-5, 1000], dtype=torch.int32, device=DEVICE)
    good = torch.tensor([0, case.vocab - 1], dtype=torch.int32, device=DEVICE)
    assert_same(corrected(good), corrected(bad))
    # an unwritten (zero) previous slot unpacks to -1 and reads row 0
    slots, slots_row0 = case.greedy_slots(), case.greedy_slots()
    slots_row0[:, 0] = pack_greedy_keys(torch.zeros(2), torch.zeros(2, dtype=torch.long)).to(DEVICE)
    for s in (slots, slots_row0):
        tmarkov.markov_greedy_fused_step(logits, case.markov_w1, case.markov_w2, None, good, s, 1, None, 0, 2, 0)
    assert_same(slots[:, 1], slots_row0[:, 1])


# ------------------------------------------------------------------------------ Triton backend: FP8, finalize, store


@requires_triton
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


@requires_triton
def test_fp8_step_matches_fp16_on_nvidia_vector_15():
    case, spikes = nvidia_fp8_step_case(device=DEVICE)
    with K.use_backend("triton"):
        fp16 = run_round(case, fp8=False)
        fp8 = run_round(case, fp8=True)
    assert_same(spikes, fp16[0])
    assert_same(spikes, fp8[0])
    bound = case.rank * float(case.markov_w2.float().abs().max()) * 0.125
    assert float((fp8[2] - fp16[2])[:, 1:].abs().max()) <= bound


@requires_triton
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


@requires_triton
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


# ------------------------------------------------------------------------------ GPU: real sizes, CUDA graphs


@requires_triton
@gpu
@pytest.mark.parametrize("rank, dtype, fp8", [(256, torch.float16, False), (64, torch.bfloat16, False), (256, torch.float16, True)])
def test_real_size_round_matches_reference(rank, dtype, fp8):
    case = markov_case(64, 7, 151936, rank, dtype, logits_stride=8, logits_offset=1, device=DEVICE)
    expected, actual = on_backends(lambda: run_round(case, fp8))
    assert_same(expected, actual)


@requires_triton
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
