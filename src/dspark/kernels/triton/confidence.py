"""Triton confidence family: the DSpark confidence head fused with the threshold / SPS schedulers
(contracts: ``dspark.kernels.confidence``).

``draft_hidden_states`` arrives as a contiguous ``[rows, H]`` tensor whose row ``b*hidden_stride + k +
hidden_offset`` is position k of batch row b; token ids are clamped into ``[0, V)`` before indexing.

One program per batch row loads the row's P hidden states at once (the bytes are tiny, so the
kernel is latency-bound: all loads of a row are issued together), computes the P confidences
``sigmoid(w . concat(h_k, W1[prev_k]) + bias)`` in fp32 and then runs the scheduler's sequential
scan over k in registers, so scores and lengths come out of a single launch (kernels.md 3.5-3.8).
The scan reproduces the reference's fp32 operation order (sequential products and sums, correctly
rounded division, the SPS cost as two single-rounding fmas) so that equal scores choose equal lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import SPS_ACCEPT_COST, SPS_DRAFT_COST, SPS_MIN_COST, SPS_VERIFY_BASE_COST, SPS_VERIFY_TOKEN_COST
from .._shared import length_bounds, next_pow2

__all__ = [
    "compute_confidence_scores",
    "compute_confidence_and_proposal_lengths",
    "compute_confidence_and_sps_proposal_lengths",
]

_NO_SCHEDULER, _THRESHOLD, _SPS = 0, 1, 2
_TILE_ELEMENTS = 16384  # hidden-state elements loaded per program iteration
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_TOKEN_COST = tl.constexpr(SPS_VERIFY_TOKEN_COST)
_ACCEPT_COST = tl.constexpr(SPS_ACCEPT_COST)
_FIXED_COST = tl.constexpr(SPS_DRAFT_COST + SPS_VERIFY_BASE_COST)  # 0.5f + 1.0f = 1.5, exact
_MIN_COST = tl.constexpr(SPS_MIN_COST)


@triton.jit
def _element(values, offs, k):
    """Entry ``k`` of a 1-D register tensor (a masked sum of one term: exact)."""
    return tl.sum(tl.where(offs == k, values, 0.0), axis=0)


@triton.jit
def _sps_cost(length):
    """``fma(0.02f, L, fma(0.45f, L + 1, 1.5f))`` in fp32: each fma is exact in fp64, rounded once."""
    token_cost = tl.full([], _TOKEN_COST, tl.float32).to(tl.float64)
    accept_cost = tl.full([], _ACCEPT_COST, tl.float32).to(tl.float64)
    inner = (token_cost * (length + 1).to(tl.float64) + _FIXED_COST).to(tl.float32)
    return (accept_cost * length.to(tl.float64) + inner.to(tl.float64)).to(tl.float32)


@triton.jit
def _threshold_length(conf, offs, c_min, c_max, threshold, BLOCK_P: tl.constexpr):
    """Longest prefix whose running product of confidences stays ``>= threshold`` (3.6)."""
    survival = tl.full([], 1.0, tl.float32)
    selected = c_min
    alive = threshold > 0
    for k in tl.static_range(BLOCK_P):
        survival = survival * _element(conf, offs, k)
        alive = alive & (k < c_max) & (survival >= threshold)
        selected = tl.where(alive, k + 1, selected)
    selected = tl.where(threshold > 0, selected, c_max)
    return tl.minimum(tl.maximum(selected, c_min), c_max)


@triton.jit
def _sps_length(conf, offs, c_min, c_max, floor, BLOCK_P: tl.constexpr):
    """Length maximising expected tokens / SPS cost, scanning until the survival floor (3.7)."""
    survival = tl.full([], 1.0, tl.float32)
    expected = tl.full([], 1.0, tl.float32)
    best = tl.full([], -_FLT_MAX, tl.float32)
    selected = c_min
    alive = tl.full([], 1, tl.int1)
    for k in tl.static_range(BLOCK_P):
        survival = survival * _element(conf, offs, k)
        expected = expected + survival
        cost = tl.maximum(_sps_cost(tl.full([], k + 1, tl.int32)), _MIN_COST)
        score = tl.math.div_rn(expected, cost)
        alive = alive & (k < c_max)
        scored = (k + 1) >= c_min
        better = alive & scored & (score > best)
        best = tl.where(better, score, best)
        selected = tl.where(better, k + 1, selected)
        alive = alive & ~((floor > 0) & (survival < floor) & scored)
    return tl.minimum(tl.maximum(selected, c_min), c_max)


@triton.jit
def _confidence_kernel(
    hidden_ptr, hidden_batch_stride, w1_ptr, weight_ptr, bias_ptr, first_prev_ptr, draft_ptr,
    conf_ptr, lengths_ptr,
    V, c_min, c_max, limit,
    P: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
    WITH_MARKOV: tl.constexpr, SCHEDULER: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Scores ``conf[b, :P]`` (and ``lengths[b]``) of batch row ``b = program_id(0)``."""
    b = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    valid_p = offs_p < P
    rows = hidden_ptr + b.to(tl.int64) * hidden_batch_stride + offs_p[:, None].to(tl.int64) * H

    acc = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        valid_h = offs_h < H
        x = tl.load(rows + offs_h[None, :], mask=valid_p[:, None] & valid_h[None, :], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + offs_h, mask=valid_h, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    dot = tl.sum(acc, axis=1)

    if WITH_MARKOV:
        # prev_k: the anchor token for k = 0, else the token drafted at k - 1
        first = tl.load(first_prev_ptr + b)
        drafted = tl.load(draft_ptr + b * P + offs_p - 1, mask=valid_p & (offs_p > 0), other=0)
        prev = tl.minimum(tl.maximum(tl.where(offs_p == 0, first, drafted), 0), V - 1).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        valid_r = offs_r < R
        emb = tl.load(w1_ptr + prev[:, None] * R + offs_r[None, :], mask=valid_p[:, None] & valid_r[None, :], other=0.0)
        w_r = tl.load(weight_ptr + H + offs_r, mask=valid_r, other=0.0).to(tl.float32)
        dot += tl.sum(emb.to(tl.float32) * w_r[None, :], axis=1)

    z = dot + tl.load(bias_ptr).to(tl.float32)
    conf = tl.math.div_rn(tl.full([BLOCK_P], 1.0, tl.float32), 1.0 + tl.exp(-z))
    tl.store(conf_ptr + b * P + offs_p, conf, mask=valid_p)

    if SCHEDULER == 1:
        tl.store(lengths_ptr + b, _threshold_length(conf, offs_p, c_min, c_max, limit, BLOCK_P))
    elif SCHEDULER == 2:
        tl.store(lengths_ptr + b, _sps_length(conf, offs_p, c_min, c_max, limit, BLOCK_P))


def _run(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens, draft_token_ids,
         confidence_with_markov, hidden_stride, hidden_offset, scheduler=_NO_SCHEDULER, limit=0.0,
         min_proposal_len=1, max_proposal_len=0):
    """Launch the fused kernel; returns ``(conf f32 [B, P], lengths int32 [B] or None)``."""
    batch, width = draft_token_ids.shape
    hidden = draft_hidden_states.shape[1]
    vocab, rank = markov_w1.shape
    device = draft_hidden_states.device
    conf = torch.empty(batch, width, dtype=torch.float32, device=device)
    lengths = torch.empty(batch, dtype=torch.int32, device=device) if scheduler != _NO_SCHEDULER else None
    if batch == 0:
        return conf, lengths
    c_min, c_max = length_bounds(width, min_proposal_len, max_proposal_len)
    block_p = next_pow2(width)
    block_h = min(next_pow2(hidden), max(16, _TILE_ELEMENTS // block_p))
    _confidence_kernel[(batch,)](
        draft_hidden_states[hidden_offset:], hidden_stride * hidden, markov_w1, confidence_weight, confidence_bias,
        first_prev_tokens, draft_token_ids, conf, conf if lengths is None else lengths,
        vocab, c_min, c_max, float(limit),
        P=width, H=hidden, R=rank,
        WITH_MARKOV=confidence_with_markov, SCHEDULER=scheduler,
        BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_R=next_pow2(rank), num_warps=8,
    )
    return conf, lengths


def compute_confidence_scores(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                              draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset):
    """``dspark.kernels.compute_confidence_scores``."""
    conf, _ = _run(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                   draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset)
    return conf


def compute_confidence_and_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                            first_prev_tokens, draft_token_ids, confidence_with_markov, threshold,
                                            min_proposal_len, max_proposal_len, hidden_stride, hidden_offset):
    """``dspark.kernels.compute_confidence_and_proposal_lengths``."""
    return _run(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset,
                _THRESHOLD, threshold, min_proposal_len, max_proposal_len)


def compute_confidence_and_sps_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                                first_prev_tokens, draft_token_ids, confidence_with_markov,
                                                survival_floor, min_proposal_len, max_proposal_len, hidden_stride,
                                                hidden_offset):
    """``dspark.kernels.compute_confidence_and_sps_proposal_lengths``."""
    return _run(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset,
                _SPS, min(max(survival_floor, 0.0), 1.0), min_proposal_len, max_proposal_len)
