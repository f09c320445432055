"""Reference verify family: verify tokens, greedy accept, proposal lengths (kernels.md 3.2-3.4).

Arguments arrive validated and normalised by ``dspark.kernels.verify`` (see ``_backend``).
"""

from __future__ import annotations

import torch

__all__ = ["build_verify_tokens", "greedy_accept", "fill_proposal_lengths"]


def build_verify_tokens(last_accepted_tokens, draft_token_ids, verify_proposal_len):
    """int32 ``[B, P_v+1]``: ``[last_accepted[b], draft[b, 0], ..., draft[b, P_v-1]]``."""
    return torch.cat([last_accepted_tokens[:, None], draft_token_ids[:, :verify_proposal_len]], dim=1)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int32 argmax of each row of f32 ``[rows, V]`` (kernels.md 2.5).

    Larger value wins, equal values go to the lower index, NaN never wins, a row with no value above
    -inf (all -inf or NaN) gives 0.
    """
    clean = torch.where(torch.isnan(logits), float("-inf"), logits)
    return clean.argmax(dim=1).to(torch.int32)  # torch returns the first maximal index


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len):
    """Greedy verification (kernels.md 3.3); returns ``(accepted int32 [B, P_v+1], accept_length int32 [B])``.

    ``base_logits`` f32 ``[B*(P_v+1), V]`` (row ``b*(P_v+1) + i`` predicts the token after verify
    token i), ``draft_token_ids`` int32 ``[B, S]``, ``proposal_lengths`` int32 ``[B]``. Row b accepts the
    longest prefix of ``rowP = max(1, min(P_v, proposal_lengths[b]))`` drafts that equal the base
    argmax, then the base argmax at the first mismatch (or bonus). Entries past ``accept_length`` are
    0 (NVIDIA leaves them stale).
    """
    batch, verify_len = draft_token_ids.shape[0], verify_proposal_len + 1
    argmax = row_argmax(base_logits).view(batch, verify_len)
    row_p = proposal_lengths.clamp(max=verify_proposal_len).clamp(min=1)
    position = torch.arange(verify_proposal_len, device=argmax.device)
    match = (argmax[:, :verify_proposal_len] == draft_token_ids[:, :verify_proposal_len]) & (position < row_p[:, None])
    matched = match.to(torch.int32).cumprod(dim=1).sum(dim=1)  # length of the all-match prefix
    accepted = torch.where(torch.arange(verify_len, device=argmax.device) <= matched[:, None], argmax, 0)
    return accepted.to(torch.int32), (matched + 1).to(torch.int32)


def fill_proposal_lengths(batch_size, proposal_len, device):
    """int32 ``[batch_size]`` filled with ``proposal_len`` (kernels.md 3.4)."""
    return torch.full((batch_size,), proposal_len, dtype=torch.int32, device=device)
