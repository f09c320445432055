"""Confidence family: the DSpark confidence head and the threshold / SPS schedulers (kernels.md 3.5-3.8).

Shared inputs: ``draft_hidden_states`` fp16 or bf16 ``[B, L, H]`` or ``[B*L, H]`` (``L =
hidden_stride or P``; row ``b*L + k + hidden_offset`` is position k), ``markov_w1`` fp16 or bf16
``[V, R]``, ``confidence_weight`` fp16 or bf16 ``[H + R]`` (``[H]`` when ``confidence_with_markov``
is False), ``confidence_bias`` fp16 or bf16 ``[1]``, ``first_prev_tokens`` int32 ``[B]``,
``draft_token_ids`` int32 ``[B, P]``. ``conf[b, k] = sigmoid(w . concat(h[b, k], W1[prev_k]) + bias)``
in fp32, where ``prev_k`` is ``first_prev_tokens[b]`` for k = 0 and ``draft_token_ids[b, k-1]``
otherwise. bf16 is a dspark extension (NVIDIA: fp16 only).

Schedulers clamp lengths to ``[cMin, cMax]`` with ``cMin = clamp(min_proposal_len, 1, P)`` and
``cMax = max(cMin, min(P, max_proposal_len or P))`` (``max_proposal_len <= 0`` means P).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import implementation
from ._validate import HALF_DTYPES, Checker
from .reference import confidence as reference

__all__ = [
    "compute_confidence_scores",
    "compute_confidence_and_proposal_lengths",
    "compute_confidence_and_sps_proposal_lengths",
    "threshold_proposal_lengths",
    "sps_proposal_lengths",
]


@dataclass
class _Head:
    """Validated, normalised confidence-head arguments, in backend order (see ``args``)."""

    device: torch.device
    hidden: torch.Tensor
    markov_w1: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    first_prev_tokens: torch.Tensor
    draft_token_ids: torch.Tensor
    with_markov: bool
    stride: int
    offset: int

    def args(self) -> tuple:
        return (self.hidden, self.markov_w1, self.weight, self.bias, self.first_prev_tokens, self.draft_token_ids,
                self.with_markov)


def _head(c: Checker, draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
          draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset) -> _Head:
    """Check the confidence-head inputs shared by the three public functions."""
    if not isinstance(confidence_with_markov, bool):
        c.fail(f"confidence_with_markov must be a bool, got {type(confidence_with_markov).__name__}", TypeError)
    draft = c.tensor("draft_token_ids", draft_token_ids, dtype=torch.int32, ndim=2)
    batch, width = draft.shape
    if width < 1:
        c.fail(f"draft_token_ids must be [B, P] with P >= 1, got shape {list(draft.shape)}")
    device = draft.device
    first = c.tensor("first_prev_tokens", first_prev_tokens, dtype=torch.int32, shape=[batch], device=device)
    w1 = c.tensor("markov_w1", markov_w1, dtype=HALF_DTYPES, ndim=2, device=device)
    vocab, rank = w1.shape
    hidden = c.tensor("draft_hidden_states", draft_hidden_states, dtype=HALF_DTYPES, ndim=(2, 3), device=device)
    stride = c.integer("hidden_stride", hidden_stride, low=0) or width
    offset = c.integer("hidden_offset", hidden_offset, low=0)
    hidden = c.rows("draft_hidden_states", hidden, batch, stride, offset, width)
    size = hidden.shape[1] + (rank if confidence_with_markov else 0)
    what = "H + R" if confidence_with_markov else "H (confidence_with_markov=False)"
    weight = c.tensor("confidence_weight", confidence_weight, dtype=HALF_DTYPES, ndim=1, device=device)
    if weight.shape[0] != size:
        c.fail(f"confidence_weight must have shape [{size}] ({what}), got {list(weight.shape)}")
    bias = c.tensor("confidence_bias", confidence_bias, dtype=HALF_DTYPES, shape=[1], device=device)
    if confidence_with_markov:
        c.ids_in_range("first_prev_tokens", first, vocab)
        c.ids_in_range(f"draft_token_ids[:, :{width - 1}]", draft[:, : width - 1], vocab)
    return _Head(device, hidden, w1.contiguous(), weight.contiguous(), bias.contiguous(), first.contiguous(),
                 draft.contiguous(), confidence_with_markov, stride, offset)


def _lengths(c: Checker, min_proposal_len, max_proposal_len) -> tuple[int, int]:
    return (c.integer("min_proposal_len", min_proposal_len, low=0),
            c.integer("max_proposal_len", max_proposal_len, low=0))


def compute_confidence_scores(draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
                              draft_token_ids, *, confidence_with_markov, hidden_stride=0, hidden_offset=0):
    """Confidence head only (kernels.md 3.5, 3.8); returns ``confidence_scores`` f32 ``[B, P]``.

    Inputs as described in the module docstring.
    """
    c = Checker("compute_confidence_scores")
    h = _head(c, draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
              draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset)
    return implementation("compute_confidence_scores", h.device)(*h.args(), h.stride, h.offset)


def compute_confidence_and_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                            first_prev_tokens, draft_token_ids, *, confidence_with_markov, threshold,
                                            min_proposal_len=1, max_proposal_len=0, hidden_stride=0, hidden_offset=0):
    """Confidence head + threshold scheduler (kernels.md 3.6).

    Returns ``(confidence_scores f32 [B, P], proposal_lengths int32 [B])``: per row, the longest
    prefix whose running fp32 product of confidences stays ``>= threshold``, clamped to
    ``[cMin, cMax]`` (so never below cMin even when the first confidence is already too low);
    ``threshold <= 0`` gives cMax for every row.
    """
    c = Checker("compute_confidence_and_proposal_lengths")
    h = _head(c, draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
              draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset)
    threshold = c.real("threshold", threshold)
    min_len, max_len = _lengths(c, min_proposal_len, max_proposal_len)
    return implementation("compute_confidence_and_proposal_lengths", h.device)(
        *h.args(), threshold, min_len, max_len, h.stride, h.offset)


def compute_confidence_and_sps_proposal_lengths(draft_hidden_states, markov_w1, confidence_weight, confidence_bias,
                                                first_prev_tokens, draft_token_ids, *, confidence_with_markov,
                                                survival_floor=0.0, min_proposal_len=1, max_proposal_len=0,
                                                hidden_stride=0, hidden_offset=0):
    """Confidence head + SPS scheduler (kernels.md 3.7).

    Returns ``(confidence_scores f32 [B, P], proposal_lengths int32 [B])``: per row, the L in
    ``[cMin, cMax]`` maximising ``expTok(L) / cost(L)`` with ``expTok(L) = 1 + sum_{j<=L} prod_{i<=j}
    conf_i`` and NVIDIA's linear cost ``cost(L) = fma(0.02, L, fma(0.45, L+1, 1.5))`` (fp32, each
    fma rounded once); ties keep the shorter L. With ``survival_floor`` in ``(0, 1]`` the scan stops
    after scoring the first ``L >= cMin`` whose survival falls below it (0 disables).
    """
    c = Checker("compute_confidence_and_sps_proposal_lengths")
    h = _head(c, draft_hidden_states, markov_w1, confidence_weight, confidence_bias, first_prev_tokens,
              draft_token_ids, confidence_with_markov, hidden_stride, hidden_offset)
    floor = c.real("survival_floor", survival_floor, low=0.0, high=1.0)
    min_len, max_len = _lengths(c, min_proposal_len, max_proposal_len)
    return implementation("compute_confidence_and_sps_proposal_lengths", h.device)(
        *h.args(), floor, min_len, max_len, h.stride, h.offset)


# ------------------------------------------------------------------ schedulers on given confidences
# Beyond the C++ set: the two length rules on confidences computed elsewhere (e.g. calibrated by
# STS, ``sigmoid(logit_k / T_k)``). They scan a tiny ``[B, P]`` tensor, so they run in PyTorch on any
# device on every backend.


def _scores(c: Checker, confidence_scores) -> torch.Tensor:
    scores = c.tensor("confidence_scores", confidence_scores, dtype=torch.float32, ndim=2)
    if scores.shape[1] < 1:
        c.fail(f"confidence_scores must be [B, P] with P >= 1, got shape {list(scores.shape)}")
    return scores.contiguous()


def threshold_proposal_lengths(confidence_scores, threshold, *, min_proposal_len=1, max_proposal_len=0):
    """Threshold scheduler of kernels.md 3.6 on given confidences ``f32 [B, P]``; int32 ``[B]``."""
    c = Checker("threshold_proposal_lengths")
    scores = _scores(c, confidence_scores)
    threshold = c.real("threshold", threshold)
    min_len, max_len = _lengths(c, min_proposal_len, max_proposal_len)
    return reference.threshold_proposal_lengths(scores, threshold, min_len, max_len)


def sps_proposal_lengths(confidence_scores, survival_floor=0.0, *, min_proposal_len=1, max_proposal_len=0):
    """SPS scheduler of kernels.md 3.7 on given confidences ``f32 [B, P]``; int32 ``[B]``."""
    c = Checker("sps_proposal_lengths")
    scores = _scores(c, confidence_scores)
    floor = c.real("survival_floor", survival_floor, low=0.0, high=1.0)
    min_len, max_len = _lengths(c, min_proposal_len, max_proposal_len)
    return reference.sps_proposal_lengths(scores, floor, min_len, max_len)
