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

__all__ = ["markov_candidate_sample_step"]


def candidate_logits(backbone_logits, markov_w1, markov_w2, prev_tokens, ids, step, logits_stride, logits_offset):
    """f32 ``[B, C]``: ``backbone[row(b, step), ids[b, c]] + W2[ids[b, c]] . W1[prev_b]``."""
    vocab = markov_w1.shape[0]
    ids = ids.long().clamp(0, vocab - 1)
    rows = torch.arange(ids.shape[0], device=ids.device) * logits_stride + (step + logits_offset)
    base = backbone_logits[rows[:, None], ids]
    embedding = _markov_rows(markov_w1, prev_tokens)  # [B, R]
    return base + (markov_w2[ids].float() * embedding[:, None, :]).sum(-1)


def candidate_probabilities(z, temperature, top_k, top_p, min_p):
    """f32 ``[B, C]`` q of candidate logits ``z`` f32 ``[B, C]`` under per-row settings ``[B]``
    (``dspark.kernels.candidates``' filters)."""
    count = z.shape[1]
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    x = z / torch.where(greedy, 1.0, temperature)[:, None]
    w = torch.exp(x - x.amax(-1, keepdim=True))
    keep = w >= min_p[:, None]
    greater = x[:, None, :] > x[:, :, None]  # [b, i, j]: x_j > x_i
    k = torch.where((top_k > 0) & (top_k < count), top_k, count)
    keep &= greater.sum(-1) < k[:, None]
    w = torch.where(keep, w, 0.0)
    index = torch.arange(count, device=z.device)
    before = greater | ((x[:, None, :] == x[:, :, None]) & (index[None, :] < index[:, None]))
    above = torch.where(before, w[:, None, :], 0.0).sum(-1)
    keep &= (above < top_p[:, None] * w.sum(-1, keepdim=True)) | (top_p[:, None] >= 1.0)
    w = torch.where(keep, w, 0.0)
    q = w / w.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(z.argmax(-1), count).float()
    return torch.where(greedy[:, None], one_hot, q)


def markov_candidate_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, candidate_ids,
                                 proposal_uniforms, draft_token_ids, candidate_probabilities_out, step, temperature,
                                 top_k, top_p, min_p, logits_stride, logits_offset):
    """``dspark.kernels.markov_candidate_sample_step``."""
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    ids = candidate_ids[:, step]
    z = candidate_logits(backbone_logits, markov_w1, markov_w2, prev, ids, step, logits_stride, logits_offset)
    q = candidate_probabilities(z, temperature, top_k, top_p, min_p)
    candidate_probabilities_out[:, step] = q
    draft_token_ids[:, step] = sample_from_sparse_probs(q, ids, proposal_uniforms[:, step])
