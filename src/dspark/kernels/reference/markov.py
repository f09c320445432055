"""Reference Markov family: correction logits, packed greedy keys, fused greedy steps, FP8 W2.

Arguments arrive validated and normalised by ``dspark.kernels.markov`` (see ``_backend``):
``backbone_logits`` is a contiguous fp32 ``[rows, V]`` tensor whose row ``b*logits_stride + step +
logits_offset`` is the base logit row of (b, step), ``logits_stride`` is resolved. All math is fp32.
Data-dependent token ids are clamped into ``[0, V)`` before indexing: on the GPU ids are not
checked (that would sync the host), and a bad id must never read out of range.
"""

from __future__ import annotations

import torch

__all__ = [
    "build_markov_logits",
    "markov_greedy_fused_step",
    "markov_greedy_fused_step_fp8",
    "quantize_markov_w2_fp8",
    "finalize_greedy_draft_tokens",
    "store_draft_step_top1",
    "markov_greedy_round",
]

FP8_E4M3_MAX = 448.0
_LOW_WORD = 0xFFFFFFFF
_INT64_SIGN = -(1 << 63)  # XOR with this maps unsigned 64-bit order onto signed int64 order


# ------------------------------------------------------------------------------ shared pieces


def _base_rows(backbone_logits: torch.Tensor, batch: int, step: int, logits_stride: int,
               logits_offset: int) -> torch.Tensor:
    """fp32 ``[B, V]``: base logit row ``b*logits_stride + step + logits_offset`` of every b."""
    rows = torch.arange(batch, device=backbone_logits.device) * logits_stride + (step + logits_offset)
    return backbone_logits.index_select(0, rows).float()


def _markov_rows(markov_w1: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, R]``: the Markov embedding ``W1[prev]`` of each row's previous token (clamped)."""
    prev = prev_tokens.long().clamp(0, markov_w1.shape[0] - 1)
    return markov_w1.index_select(0, prev).float()


def _corrected(backbone_logits, markov_w1, markov_w2, prev_tokens, step, logits_stride, logits_offset):
    """fp32 ``[B, V]``: ``backbone[row(b, step)] + W2 @ W1[prev_b]`` (fp16/bf16 W2)."""
    base = _base_rows(backbone_logits, prev_tokens.shape[0], step, logits_stride, logits_offset)
    return base + _markov_rows(markov_w1, prev_tokens) @ markov_w2.float().t()


def _corrected_fp8(backbone_logits, markov_w1, w2_fp8, w2_row_scales, prev_tokens, step, logits_stride,
                   logits_offset):
    """fp32 ``[B, V]``: ``backbone[row] + scale_v * (fp8(W2)[v] . W1[prev_b])`` (scale on the fp32 dot)."""
    base = _base_rows(backbone_logits, prev_tokens.shape[0], step, logits_stride, logits_offset)
    codes = w2_fp8.view(torch.float8_e4m3fn).float()
    return base + w2_row_scales.float() * (_markov_rows(markov_w1, prev_tokens) @ codes.t())


# ------------------------------------------------------------------------------ correction logits


def build_markov_logits(backbone_logits, markov_w1, markov_w2, first_prev_tokens, draft_token_ids, step,
                        logits_stride, logits_offset):
    """Markov-corrected logits of one draft step (kernels.md 3.11).

    ``backbone_logits`` f32 ``[rows, V]``; ``markov_w1``/``markov_w2`` fp16 or bf16 ``[V, R]``;
    ``first_prev_tokens`` int32 ``[B]``; ``draft_token_ids`` int32 ``[B, P]`` (column ``step-1`` is the
    previous token for ``step > 0``). Returns f32 ``[B, V]``:
    ``backbone[b*logits_stride + step + logits_offset] + W2 @ W1[prev_b]``.
    """
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    return _corrected(backbone_logits, markov_w1, markov_w2, prev, step, logits_stride, logits_offset)


# ------------------------------------------------------------------------------ packed greedy keys


def pack_greedy_keys(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Packed orderable keys of kernels.md 3.14, as int64 holding the unsigned 64-bit bit pattern.

    ``values`` f32 and ``indices`` (any integer dtype, ``[0, 2^32)``) broadcast together. High word:
    the fp32 bits with the sign bit set (non-negative values) or all bits flipped (negative values),
    so unsigned key order is value order; low word ``0xFFFFFFFF - index``, so equal values rank the
    lower index higher. +0.0 ranks above -0.0, +NaN above +inf, -NaN below -inf.
    """
    bits = values.float().contiguous().view(torch.int32)
    high = torch.where(bits < 0, ~bits, bits | torch.iinfo(torch.int32).min)  # int32 image of the high word
    low = _LOW_WORD - indices.long()
    # high * 2^32 + low cannot overflow: high is in [-2^31, 2^31) and low in [0, 2^32).
    return high.long() * (1 << 32) + low


def unpack_greedy_keys(keys: torch.Tensor) -> torch.Tensor:
    """int32 vocabulary indices of packed keys: ``int32(0xFFFFFFFF - (key & 0xFFFFFFFF))``; key 0 -> -1."""
    index = _LOW_WORD - (keys & _LOW_WORD)
    return torch.where(index > torch.iinfo(torch.int32).max, index - (1 << 32), index).to(torch.int32)


def max_greedy_keys(keys: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unsigned 64-bit maximum of int64-stored keys along ``dim``."""
    return (keys ^ _INT64_SIGN).amax(dim) ^ _INT64_SIGN


def _store_best_key(greedy_slots: torch.Tensor, corrected: torch.Tensor, step: int) -> None:
    """``greedy_slots[:, step] = umax(greedy_slots[:, step], max_v key(corrected[b, v], v))``.

    Max-with-the-old-content is NVIDIA's ``atomicMax`` semantics (slots are zeroed per round).
    """
    vocab = torch.arange(corrected.shape[1], device=corrected.device)
    best = max_greedy_keys(pack_greedy_keys(corrected, vocab))
    greedy_slots[:, step] = max_greedy_keys(torch.stack([greedy_slots[:, step], best]), dim=0)


def _greedy_step(corrected_fn, greedy_slots, first_prev_tokens, step, stacked_logits, stacked_depth_row):
    """Shared body of the fp16/bf16 and FP8 fused steps; ``corrected_fn(prev)`` builds ``[B, V]``."""
    prev = first_prev_tokens if step == 0 else unpack_greedy_keys(greedy_slots[:, step - 1])
    corrected = corrected_fn(prev)
    if stacked_logits is not None:
        stacked_logits[:, stacked_depth_row] = corrected
    _store_best_key(greedy_slots, corrected, step)


# ------------------------------------------------------------------------------ fused greedy steps


def markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, greedy_slots, step,
                             stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """One greedy Markov step (kernels.md 3.14), writing ``greedy_slots[:, step]`` (int64 ``[B, P]``).

    The previous token is ``first_prev_tokens`` (int32 ``[B]``) at step 0, else the unpacked key of
    ``greedy_slots[:, step - 1]``. With ``stacked_logits`` (f32 ``[B, P+1, V]``) the corrected row is
    also stored at depth row ``stacked_depth_row``.
    """
    def corrected(prev):
        return _corrected(backbone_logits, markov_w1, markov_w2, prev, step, logits_stride, logits_offset)

    _greedy_step(corrected, greedy_slots, first_prev_tokens, step, stacked_logits, stacked_depth_row)


def markov_greedy_fused_step_fp8(backbone_logits, markov_w1, w2_fp8, w2_row_scales, first_prev_tokens, greedy_slots,
                                 step, stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """``markov_greedy_fused_step`` with W2 as uint8 E4M3 codes ``[V, R]`` and f16 row scales ``[V]`` (3.16)."""
    def corrected(prev):
        return _corrected_fp8(backbone_logits, markov_w1, w2_fp8, w2_row_scales, prev, step, logits_stride,
                              logits_offset)

    _greedy_step(corrected, greedy_slots, first_prev_tokens, step, stacked_logits, stacked_depth_row)


def quantize_markov_w2_fp8(markov_w2):
    """Per-row FP8 E4M3 quantisation of ``markov_w2`` fp16/bf16 ``[V, R]`` (kernels.md 3.15).

    Returns ``(w2_fp8 uint8 [V, R], w2_row_scales f16 [V])``: ``scale = absmax / 448`` in fp32 (1 for
    a zero row), codes = RNE E4M3 of ``w * (1/scale)`` saturated to +-448, scales rounded to fp16.
    """
    w = markov_w2.float()
    absmax = w.abs().amax(dim=1)
    # Divide by a tensor, not the Python scalar: CUDA turns `x / 448.0` into `x * (1/448)`, which is
    # not the correctly rounded fp32 division of the spec and changes a few codes.
    scale = torch.where(absmax > 0, absmax / torch.full_like(absmax, FP8_E4M3_MAX), torch.ones_like(absmax))
    scaled = w * (1.0 / scale)[:, None]
    # Saturate first: depending on the torch version, the cast maps values >= 480 to NaN.
    codes = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale.to(torch.float16)


# ------------------------------------------------------------------------------ tiny stores


def finalize_greedy_draft_tokens(greedy_slots):
    """int32 ``[B, P]`` draft tokens unpacked from int64 ``[B, P]`` greedy slots (kernels.md 3.17)."""
    return unpack_greedy_keys(greedy_slots)


def store_draft_step_top1(top1_indices, draft_token_ids, step):
    """``draft_token_ids[:, step] = top1_indices`` (int32 ``[B]`` into int32 ``[B, P]``, kernels.md 3.21)."""
    draft_token_ids[:, step] = top1_indices


# ------------------------------------------------------------------------------ whole greedy round


def markov_greedy_round(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_len, w2_row_scales,
                        logits_stride, logits_offset, greedy_slots, draft_token_ids, stacked_logits):
    """A whole greedy drafting round: zero the slots, ``proposal_len`` fused steps, finalize.

    Buffers are given: ``greedy_slots`` int64 ``[B, P]``, ``draft_token_ids`` int32 ``[B, P]`` (filled
    and returned), optional ``stacked_logits`` f32 ``[B, P+1, V]`` (depth row ``step + 1``). FP8 when
    ``w2_row_scales`` is given (``markov_w2`` then holds uint8 codes).
    """
    greedy_slots.zero_()
    for step in range(proposal_len):
        if w2_row_scales is None:
            markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, greedy_slots, step,
                                     stacked_logits, step + 1, logits_stride, logits_offset)
        else:
            markov_greedy_fused_step_fp8(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens,
                                         greedy_slots, step, stacked_logits, step + 1, logits_stride, logits_offset)
    draft_token_ids.copy_(finalize_greedy_draft_tokens(greedy_slots))
    return draft_token_ids
