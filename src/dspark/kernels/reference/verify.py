"""Reference verify family: verify tokens, greedy and probabilistic accept, proposal lengths
(contracts: ``dspark.kernels.verify``).
"""

from __future__ import annotations

import torch

from .._shared import TINY
from .sampling import sample_from_probs, sample_from_residual

__all__ = ["build_verify_tokens", "greedy_accept", "probabilistic_accept", "fill_proposal_lengths"]


def build_verify_tokens(last_accepted_tokens, draft_token_ids, verify_proposal_len):
    """``dspark.kernels.build_verify_tokens``."""
    return torch.cat([last_accepted_tokens[:, None], draft_token_ids[:, :verify_proposal_len]], dim=1)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int32 argmax of each row of f32 ``[rows, V]`` (kernels.md 2.5).

    Larger value wins, equal values go to the lower index, NaN never wins, a row with no value above
    -inf (all -inf or NaN) gives 0.
    """
    clean = torch.where(torch.isnan(logits), float("-inf"), logits)
    return clean.argmax(dim=1).to(torch.int32)  # torch returns the first maximal index


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len, workspace):
    """``dspark.kernels.greedy_accept``: the accepted prefix as a cumulative product of matches."""
    batch, verify_len = draft_token_ids.shape[0], verify_proposal_len + 1
    argmax = row_argmax(base_logits).view(batch, verify_len)
    row_p = proposal_lengths.clamp(max=verify_proposal_len).clamp(min=1)
    position = torch.arange(verify_proposal_len, device=argmax.device)
    match = (argmax[:, :verify_proposal_len] == draft_token_ids[:, :verify_proposal_len]) & (position < row_p[:, None])
    matched = match.to(torch.int32).cumprod(dim=1).sum(dim=1)  # length of the all-match prefix
    accepted = torch.where(torch.arange(verify_len, device=argmax.device) <= matched[:, None], argmax, 0)
    return accepted.to(torch.int32), (matched + 1).to(torch.int32)


def fill_proposal_lengths(batch_size, proposal_len, device):
    """``dspark.kernels.fill_proposal_lengths``."""
    return torch.full((batch_size,), proposal_len, dtype=torch.int32, device=device)


def probabilistic_accept(target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms,
                         verify_proposal_len, workspace):
    """``dspark.kernels.probabilistic_accept``, vectorised over the batch: the ratio tests of every
    position at once, the accepted prefix as a cumulative product, then one residual or bonus draw
    per row (NVIDIA's walks, bit-exact)."""
    batch, _, vocab = target_probabilities.shape
    stride, pv = draft_token_ids.shape[1], verify_proposal_len
    rows = torch.arange(batch, device=draft_token_ids.device)
    positions = torch.arange(pv, device=draft_token_ids.device)
    row_p = proposal_lengths.long().clamp(max=pv).clamp(min=1)  # max(1, min(P_v, len))
    proposed = draft_token_ids[:, :pv].long()
    index = proposed.clamp(0, vocab - 1)[:, :, None]
    p = target_probabilities[:, :pv].gather(2, index).squeeze(2)
    q = draft_probabilities[:, :pv].gather(2, index).squeeze(2)
    ratio = torch.where(q <= TINY, torch.ones_like(p), torch.fmin(p / q, torch.ones_like(p)))  # fminf: NaN -> 1
    accept = (p > 0) & (accept_uniforms[:, :pv] <= ratio) & (positions < row_p[:, None])
    n = accept.long().cumprod(1).sum(1)  # length of the accepted prefix
    # Target row n gives the residual draw after a rejection at n < rowP, else the bonus (n == rowP).
    target_row = target_probabilities[rows, n]
    rejected, bonus = n < row_p, n >= row_p
    last = torch.empty_like(n)
    at = n[rejected]
    last[rejected] = sample_from_residual(target_row[rejected], draft_probabilities[rows[rejected], at],
                                          accept_uniforms[rows[rejected], stride + at])
    last[bonus] = sample_from_probs(target_row[bonus], accept_uniforms[bonus, 2 * stride])
    accepted = torch.zeros(batch, pv + 1, dtype=torch.int64, device=draft_token_ids.device)
    accepted[:, :pv] = torch.where(positions < n[:, None], proposed, 0)
    accepted.scatter_(1, n[:, None], last[:, None])
    return accepted.to(torch.int32), (n + 1).to(torch.int32)
