"""Verify family: verify tokens, greedy accept, proposal lengths (kernels.md 3.2-3.4).

Shared terms: ``draft_token_ids`` int32 ``[B, S]`` (S = draft stride, the allocation width P);
``verify_proposal_len`` ``P_v`` in ``[1, S]`` drafts are verified this round, so verify-side tensors
have ``P_v + 1`` rows per batch entry. ``probabilistic_accept`` lives in ``dspark.kernels.sampling``.
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._validate import Checker

__all__ = ["build_verify_tokens", "greedy_accept", "fill_proposal_lengths"]


def verify_drafts(c: Checker, draft_token_ids, verify_proposal_len):
    """int32 ``[B, S]`` drafts and ``P_v`` checked against the draft stride S."""
    draft = c.tensor("draft_token_ids", draft_token_ids, dtype=torch.int32, ndim=2)
    stride = draft.shape[1]
    if stride < 1:
        c.fail(f"draft_token_ids must have a draft stride S >= 1, got shape {list(draft.shape)}")
    p_v = c.integer("verify_proposal_len", verify_proposal_len, low=1)
    if p_v > stride:
        c.fail(f"verify_proposal_len must be <= the draft stride S = {stride} of draft_token_ids, got {p_v}")
    return draft, p_v


def build_verify_tokens(last_accepted_tokens, draft_token_ids, verify_proposal_len):
    """Tokens of the base verify pass (kernels.md 3.2); returns int32 ``[B, P_v+1]``.

    Row b is ``[last_accepted_tokens[b], draft_token_ids[b, 0], ..., draft_token_ids[b, P_v-1]]``.
    ``last_accepted_tokens`` int32 ``[B]``, ``draft_token_ids`` int32 ``[B, S]``, ``1 <= P_v <= S``.
    """
    c = Checker("build_verify_tokens")
    draft, p_v = verify_drafts(c, draft_token_ids, verify_proposal_len)
    last = c.tensor("last_accepted_tokens", last_accepted_tokens, dtype=torch.int32, shape=[draft.shape[0]],
                    device=draft.device)
    return implementation("build_verify_tokens", draft.device)(last.contiguous(), draft.contiguous(), p_v)


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len):
    """Greedy verification (kernels.md 3.3); returns ``(accepted_token_ids int32 [B, P_v+1], accept_length int32 [B])``.

    ``base_logits`` f32 ``[B, P_v+1, V]`` or ``[B*(P_v+1), V]``: row i of entry b is the base model's
    prediction after verify token i. ``draft_token_ids`` int32 ``[B, S]`` (ids in ``[0, V)``),
    ``proposal_lengths`` int32 ``[B]``, ``1 <= P_v <= S``. Row b walks
    ``rowP = max(1, min(P_v, proposal_lengths[b]))`` drafts, accepting while the draft equals the row's
    argmax (ties to the lowest index, NaN ignored, an all -inf/NaN row gives 0), then appends the
    argmax at the first mismatch (correction) or after ``rowP`` matches (bonus):
    ``accept_length[b]`` is in ``[1, rowP + 1]``. dspark zeroes the entries past ``accept_length``
    (NVIDIA leaves them stale).
    """
    c = Checker("greedy_accept")
    draft, p_v = verify_drafts(c, draft_token_ids, verify_proposal_len)
    batch, device = draft.shape[0], draft.device
    lengths = c.tensor("proposal_lengths", proposal_lengths, dtype=torch.int32, shape=[batch], device=device)
    logits = c.tensor("base_logits", base_logits, dtype=torch.float32, ndim=(2, 3), device=device)
    logits = c.rows("base_logits", logits, batch, p_v + 1, 0, p_v + 1)
    c.ids_in_range(f"draft_token_ids[:, :{p_v}]", draft[:, :p_v], logits.shape[1])
    return implementation("greedy_accept", device)(logits, draft.contiguous(), lengths.contiguous(), p_v)


def fill_proposal_lengths(batch_size, proposal_len, device="cpu"):
    """int32 ``[batch_size]`` filled with ``proposal_len`` (kernels.md 3.4), on ``device``."""
    c = Checker("fill_proposal_lengths")
    batch = c.integer("batch_size", batch_size, low=0)
    length = c.integer("proposal_len", proposal_len, low=0)
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        c.fail(f"device must be a torch.device or device string, got {device!r} ({exc})", TypeError)
    return implementation("fill_proposal_lengths", device)(batch, length, device)
