"""Reference confidence family: confidence head and the threshold / SPS schedulers (contracts:
``dspark.kernels.confidence``).

``draft_hidden_states`` arrives as a contiguous ``[rows, H]`` tensor whose row ``b*hidden_stride + k +
hidden_offset`` is the hidden state of (b, k). All math is fp32; the schedulers loop over the P
positions (sequential fp32 products and sums, as NVIDIA's one-thread-per-row loop) and are
vectorised over the batch.
"""

from __future__ import annotations

import torch

from .._shared import SPS_ACCEPT_COST, SPS_DRAFT_COST, SPS_MIN_COST, SPS_VERIFY_BASE_COST, SPS_VERIFY_TOKEN_COST
from .._shared import length_bounds

__all__ = [
    "compute_confidence_scores",
    "compute_confidence_and_proposal_lengths",
    "compute_confidence_and_sps_proposal_lengths",
]

_FLT_MAX = torch.finfo(torch.float32).max


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def compute_confidence_scores(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                              draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset):
    """``dspark.kernels.compute_confidence_scores`` (previous tokens clamped into ``[0, V)``)."""
    batch, width = draft_token_ids.shape
    hidden = draft_hidden_states.shape[1]
    device = draft_hidden_states.device
    rows = torch.arange(batch, device=device)[:, None] * hidden_stride + torch.arange(width, device=device)
    rows = rows + hidden_offset
    h = draft_hidden_states.index_select(0, rows.reshape(-1)).float().view(batch, width, hidden)
    weight = confidence_weight.float()
    dot = h @ weight[:hidden]
    if confidence_with_markov:
        prev = torch.cat([first_prev_tokens[:, None], draft_token_ids[:, : width - 1]], dim=1).long()
        embedding = markov_w1.index_select(0, prev.clamp(0, markov_w1.shape[0] - 1).reshape(-1)).float()
        dot = dot + embedding.view(batch, width, -1) @ weight[hidden:]
    return 1.0 / (1.0 + torch.exp(-(dot + confidence_bias.float()[0])))  # NVIDIA's expf form of the sigmoid


def threshold_proposal_lengths(confidence_scores, threshold, min_proposal_len, max_proposal_len):
    """int32 ``[B]``: the longest prefix whose running fp32 product of confidences is ``>= threshold``,
    clamped to ``[cMin, cMax]``; ``threshold <= 0`` gives ``cMax`` (kernels.md 3.6)."""
    batch, width = confidence_scores.shape
    c_min, c_max = length_bounds(width, min_proposal_len, max_proposal_len)
    device = confidence_scores.device
    if threshold <= 0:
        return torch.full((batch,), c_max, dtype=torch.int32, device=device)
    threshold = float(_f32(threshold))  # NVIDIA compares against a float argument
    survival = torch.ones(batch, dtype=torch.float32, device=device)
    selected = torch.full((batch,), c_min, dtype=torch.int32, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for k in range(c_max):
        survival = survival * confidence_scores[:, k]
        alive = alive & (survival >= threshold)
        selected = torch.where(alive, k + 1, selected)
    return selected.clamp(c_min, c_max).to(torch.int32)


def sps_costs(max_len: int, device=None) -> torch.Tensor:
    """f32 ``[max_len]``: the SPS cost of proposing L = 1..max_len tokens (kernels.md 3.7).

    ``cost(L) = fma(0.02f, L, fma(0.45f, L + 1, 0.5f + 1.0f))`` with fp32 rounding after each fused
    multiply-add. Each ``a*b + c`` of these fp32 constants and an integer L < 2^20 is exact in float64
    (at most 53 significant bits), so one rounding to fp32 reproduces the fma exactly.
    """
    length = torch.arange(1, max_len + 1, dtype=torch.float64, device=device)  # on the device: graph-safe
    token_cost, accept_cost = (_f32(x).double() for x in (SPS_VERIFY_TOKEN_COST, SPS_ACCEPT_COST))
    base = (_f32(SPS_DRAFT_COST) + _f32(SPS_VERIFY_BASE_COST)).double()
    inner = (token_cost * (length + 1) + base).float()
    return (accept_cost * length + inner.double()).float()


def sps_proposal_lengths(confidence_scores, survival_floor, min_proposal_len, max_proposal_len):
    """int32 ``[B]``: the length maximising expected tokens / SPS cost (kernels.md 3.7).

    ``expTok(L) = 1 + sum_{j<=L} prod_{i<=j} conf_i`` (sequential fp32); lengths ``L >= cMin`` are
    scored ``expTok / max(cost(L), 1e-6)`` and a strictly better score wins (ties keep the shorter L);
    with ``survival_floor > 0`` the scan stops after scoring the first ``L >= cMin`` whose survival
    drops below the floor.
    """
    batch, width = confidence_scores.shape
    c_min, c_max = length_bounds(width, min_proposal_len, max_proposal_len)
    device = confidence_scores.device
    floor = float(_f32(min(max(survival_floor, 0.0), 1.0)))
    costs = sps_costs(c_max, device).clamp(min=SPS_MIN_COST)
    survival = torch.ones(batch, dtype=torch.float32, device=device)
    expected = torch.ones(batch, dtype=torch.float32, device=device)
    best = torch.full((batch,), -_FLT_MAX, dtype=torch.float32, device=device)
    selected = torch.full((batch,), c_min, dtype=torch.int32, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for k in range(c_max):
        length = k + 1
        survival = survival * confidence_scores[:, k]
        expected = expected + survival
        if length < c_min:
            continue
        score = expected / costs[k]
        better = alive & (score > best)
        best = torch.where(better, score, best)
        selected = torch.where(better, length, selected)
        if floor > 0:
            alive = alive & ~(survival < floor)
    return selected.clamp(c_min, c_max).to(torch.int32)


def compute_confidence_and_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                            first_prev_tokens, draft_token_ids, confidence_with_markov, threshold,
                                            min_proposal_len, max_proposal_len, hidden_stride, hidden_offset):
    """``dspark.kernels.compute_confidence_and_proposal_lengths``."""
    scores = compute_confidence_scores(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                       first_prev_tokens, draft_token_ids, confidence_with_markov, hidden_stride,
                                       hidden_offset)
    return scores, threshold_proposal_lengths(scores, threshold, min_proposal_len, max_proposal_len)


def compute_confidence_and_sps_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                                first_prev_tokens, draft_token_ids, confidence_with_markov,
                                                survival_floor, min_proposal_len, max_proposal_len, hidden_stride,
                                                hidden_offset):
    """``dspark.kernels.compute_confidence_and_sps_proposal_lengths``."""
    scores = compute_confidence_scores(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                       first_prev_tokens, draft_token_ids, confidence_with_markov, hidden_stride,
                                       hidden_offset)
    return scores, sps_proposal_lengths(scores, survival_floor, min_proposal_len, max_proposal_len)
