"""Reference Markov family: correction logits, packed greedy keys, fused greedy steps, FP8 W2
(contracts: ``dspark.kernels.markov``).

``backbone_logits`` arrives as a contiguous fp32 ``[rows, V]`` tensor whose row ``b*logits_stride +
step + logits_offset`` is the base logit row of (b, step), ``logits_stride`` resolved. W2 is fp16/bf16,
or uint8 E4M3 codes when ``w2_row_scales`` (fp16 ``[V]``) is given. All math is fp32. Data-dependent
token ids are clamped into ``[0, V)`` before indexing: on the GPU ids are not checked (that would
sync the host), and a bad id must never read out of range.
"""

from __future__ import annotations

import torch

from .._shared import FP8_E4M3_MAX

__all__ = [
    "build_markov_logits",
    "markov_greedy_fused_step",
    "quantize_markov_w2_fp8",
    "finalize_greedy_draft_tokens",
    "store_draft_step_top1",
]
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


def corrected(backbone_logits, markov_w1, markov_w2, w2_row_scales, prev_tokens, step, logits_stride, logits_offset):
    """fp32 ``[B, V]``: ``backbone[row(b, step)] + W2 @ W1[prev_b]`` (kernels.md 3.11); with FP8 W2
    ``backbone[row] + scale_v * (codes[v] . W1[prev_b])``, the scale applied to the fp32 dot (3.16)."""
    base = _base_rows(backbone_logits, prev_tokens.shape[0], step, logits_stride, logits_offset)
    embedding = _markov_rows(markov_w1, prev_tokens)
    if w2_row_scales is None:
        return base + embedding @ markov_w2.float().t()
    return base + w2_row_scales.float() * (embedding @ markov_w2.view(torch.float8_e4m3fn).float().t())


# ------------------------------------------------------------------------------ correction logits


def build_markov_logits(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, draft_token_ids, step,
                        logits_stride, logits_offset):
    """``dspark.kernels.build_markov_logits``."""
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    return corrected(backbone_logits, markov_w1, markov_w2, w2_row_scales, prev, step, logits_stride, logits_offset)


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


def _store_best_key(greedy_slots: torch.Tensor, rows: torch.Tensor, step: int) -> None:
    """``greedy_slots[:, step] = umax(greedy_slots[:, step], max_v key(rows[b, v], v))``.

    Max-with-the-old-content is NVIDIA's ``atomicMax`` semantics (slots are zeroed per round).
    """
    vocab = torch.arange(rows.shape[1], device=rows.device)
    best = max_greedy_keys(pack_greedy_keys(rows, vocab))
    greedy_slots[:, step] = max_greedy_keys(torch.stack([greedy_slots[:, step], best]), dim=0)


# ------------------------------------------------------------------------------ fused greedy steps


def markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, greedy_slots,
                             step, stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """``dspark.kernels.markov_greedy_fused_step`` (and ``_fp8``): the previous token unpacked from
    ``greedy_slots[:, step - 1]``, the corrected row, its best key merged into the slot."""
    prev = first_prev_tokens if step == 0 else unpack_greedy_keys(greedy_slots[:, step - 1])
    rows = corrected(backbone_logits, markov_w1, markov_w2, w2_row_scales, prev, step, logits_stride, logits_offset)
    if stacked_logits is not None:
        stacked_logits[:, stacked_depth_row] = rows
    _store_best_key(greedy_slots, rows, step)


def quantize_markov_w2_fp8(markov_w2):
    """``dspark.kernels.quantize_markov_w2_fp8``."""
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


def finalize_greedy_draft_tokens(greedy_slots, draft_token_ids):
    """``dspark.kernels.finalize_greedy_draft_tokens`` into ``draft_token_ids``."""
    return draft_token_ids.copy_(unpack_greedy_keys(greedy_slots))


def store_draft_step_top1(top1_indices, draft_token_ids, step):
    """``dspark.kernels.store_draft_step_top1``."""
    draft_token_ids[:, step] = top1_indices
