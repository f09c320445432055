"""Reference candidate-set drafting step (contract: ``dspark.kernels.candidates``).

Written in the Triton kernel's formulation -- pairwise comparisons among the C candidates for the
top-k and top-p ranks -- so that both backends agree to fp32 rounding; the draw is the exact
sequential walk of kernels.md 2.4. Data-dependent ids are clamped before they index anything.
"""

from __future__ import annotations

import torch

from .._shared import GREEDY_TEMPERATURE
from .markov import _markov_rows
from .sampling import sample_from_sparse_probs

__all__ = ["candidate_top_ids", "markov_candidate_sample_step"]


def candidate_logits(backbone_logits, markov_w1, markov_w2, prev_tokens, ids, step, logits_stride, logits_offset,
                     logit_bias=None):
    """f32 ``[B, C]``: ``(backbone[row(b, step), ids[b, c]] + logit_bias[b, ids[b, c]]) + W2[ids[b, c]] . W1[prev_b]``
    (``logit_bias`` f32 ``[B, V]`` or None)."""
    vocab = markov_w1.shape[0]
    ids = ids.long().clamp(0, vocab - 1)
    rows = torch.arange(ids.shape[0], device=ids.device) * logits_stride + (step + logits_offset)
    base = backbone_logits[rows[:, None], ids]
    if logit_bias is not None:
        base = base + logit_bias.gather(1, ids)
    embedding = _markov_rows(markov_w1, prev_tokens)  # [B, R]
    return base + (markov_w2[ids].float() * embedding[:, None, :]).sum(-1)


def first_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """bool ``[B, C]``: lane c holds an id no earlier lane of its row holds."""
    lanes = torch.arange(ids.shape[1], device=ids.device)
    earlier = (ids[:, None, :] == ids[:, :, None]) & (lanes[None, :] < lanes[:, None])  # [b, i, j]
    return ~earlier.any(-1)


def candidate_probabilities(z, temperature, top_k, top_p, min_p, valid=None):
    """f32 ``[B, C]`` q of candidate logits ``z`` f32 ``[B, C]`` under per-row settings ``[B]``
    (``dspark.kernels.candidates``' filters) over the ``valid`` lanes (bool ``[B, C]``; None: all;
    the others get 0 and count for nothing)."""
    valid = torch.ones_like(z, dtype=torch.bool) if valid is None else valid
    count = valid.sum(-1)
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    z = torch.where(valid, z, -torch.inf)
    x = z / torch.where(greedy, 1.0, temperature)[:, None]
    w = torch.where(valid, torch.exp(x - x.amax(-1, keepdim=True)), 0.0)
    keep = valid & (w >= min_p[:, None])
    greater = (x[:, None, :] > x[:, :, None]) & valid[:, None, :]  # [b, i, j]: x_j > x_i
    k = torch.where((top_k > 0) & (top_k < count), top_k, count)
    keep &= greater.sum(-1) < k[:, None]
    w = torch.where(keep, w, 0.0)
    index = torch.arange(z.shape[1], device=z.device)
    before = greater | ((x[:, None, :] == x[:, :, None]) & (index[None, :] < index[:, None]))
    above = torch.where(before, w[:, None, :], 0.0).sum(-1)
    keep &= (above < top_p[:, None] * w.sum(-1, keepdim=True)) | (top_p[:, None] >= 1.0)
    w = torch.where(keep, w, 0.0)
    q = w / w.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(z.argmax(-1), z.shape[1]).float()
    return torch.where(greedy[:, None], one_hot, q)


def markov_candidate_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, candidate_ids,
                                 successor_ids, proposal_uniforms, draft_token_ids, candidate_probabilities_out, step,
                                 temperature, top_k, top_p, min_p, logits_stride, logits_offset, logit_bias):
    """``dspark.kernels.markov_candidate_sample_step``."""
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    if successor_ids is not None:
        row = prev.long().clamp(0, successor_ids.shape[0] - 1)
        candidate_ids[:, step, candidate_ids.shape[2] - successor_ids.shape[1]:] = successor_ids[row]
    ids = candidate_ids[:, step]
    z = candidate_logits(backbone_logits, markov_w1, markov_w2, prev, ids, step, logits_stride, logits_offset,
                         logit_bias)
    q = candidate_probabilities(z, temperature, top_k, top_p, min_p, first_occurrences(ids))
    candidate_probabilities_out[:, step] = q
    draft_token_ids[:, step] = sample_from_sparse_probs(q, ids, proposal_uniforms[:, step])


def candidate_top_ids(backbone_logits, logits_stride, logits_offset, candidate_ids, count, logit_bias):
    """``candidate_ids[b, s, :count]``: the ids of the ``count`` largest entries of slot s's backbone
    row ``b*L + s + logits_offset`` plus ``logit_bias[b]`` (None: none) (``torch.topk``: descending;
    which of tied entries, unspecified)."""
    batch, width = candidate_ids.shape[:2]
    slots = backbone_logits.view(batch, logits_stride, -1)[:, logits_offset:logits_offset + width]
    if logit_bias is not None:
        slots = slots + logit_bias[:, None]
    candidate_ids[..., :count] = slots.topk(count, dim=-1).indices
