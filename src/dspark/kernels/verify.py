"""Verify family: verify tokens, greedy and probabilistic accept, proposal lengths (kernels.md 3.2-3.4,
3.23).

Shared terms: ``draft_token_ids`` int32 ``[B, S]`` (S = draft stride, the allocation width P);
``verify_proposal_len`` ``P_v`` in ``[1, S]`` drafts are verified this round, so verify-side tensors
have ``P_v + 1`` rows per batch entry.

Value checks (``dspark.kernels._validate``): a verification on NaN logits or on rows that are not
distributions silently accepts garbage, so ``greedy_accept`` rejects NaN logits and
``probabilistic_accept`` rows that are not probabilities (finite, >= 0, summing to 1 within 1e-3) --
checked for CPU tensors; on CUDA each check would cost a host synchronisation, so there they run
only with ``DSPARK_CHECK_VALUES=1`` (outside graph capture). Unchecked, the kernels behave as stated
in each function (NaN is ignored by the argmax; a NaN ratio accepts).
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._validate import Checker
from .workspace import resolve

__all__ = ["build_verify_tokens", "greedy_accept", "probabilistic_accept", "fill_proposal_lengths"]


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


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len, *, workspace=None):
    """Greedy verification (kernels.md 3.3); returns ``(accepted_token_ids int32 [B, P_v+1], accept_length int32 [B])``.

    ``base_logits`` f32 ``[B, P_v+1, V]`` or ``[B*(P_v+1), V]``: row i of entry b is the base model's
    prediction after verify token i. ``draft_token_ids`` int32 ``[B, S]`` (ids in ``[0, V)``),
    ``proposal_lengths`` int32 ``[B]``, ``1 <= P_v <= S``. Row b walks
    ``rowP = max(1, min(P_v, proposal_lengths[b]))`` drafts, accepting while the draft equals the row's
    argmax (ties to the lowest index, NaN ignored, an all -inf/NaN row gives 0), then appends the
    argmax at the first mismatch (correction) or after ``rowP`` matches (bonus):
    ``accept_length[b]`` is in ``[1, rowP + 1]``. dspark zeroes the entries past ``accept_length``
    (NVIDIA leaves them stale). NaN logits are rejected where values are checked (module docstring).
    ``workspace``: a ``dspark.kernels.Workspace`` for the Triton argmax partials (default: a private one).
    """
    c = Checker("greedy_accept")
    draft, p_v = verify_drafts(c, draft_token_ids, verify_proposal_len)
    batch, device = draft.shape[0], draft.device
    lengths = c.tensor("proposal_lengths", proposal_lengths, dtype=torch.int32, shape=[batch], device=device)
    logits = c.tensor("base_logits", base_logits, dtype=torch.float32, ndim=(2, 3), device=device)
    logits = c.rows("base_logits", logits, batch, p_v + 1, 0, p_v + 1)
    c.ids_in_range(f"draft_token_ids[:, :{p_v}]", draft[:, :p_v], logits.shape[1])
    c.no_nan("base_logits", logits)
    return implementation("greedy_accept", device)(logits, draft.contiguous(), lengths.contiguous(), p_v,
                                                   resolve(c, workspace))


def probabilistic_accept(target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms,
                         verify_proposal_len, *, workspace=None):
    """Speculative-sampling verification (kernels.md 3.23).

    Returns ``(accepted int32 [B, P_v+1], accept_length int32 [B])``.

    ``target_probabilities`` f32 ``[B, P_v+1, V]`` (row i: the target's distribution after verify
    token i), ``draft_probabilities`` f32 ``[B, S, V]``, ``draft_token_ids`` int32 ``[B, S]`` (ids in
    ``[0, V)``), ``proposal_lengths`` int32 ``[B]``, ``accept_uniforms`` f32 ``[B, 2S+1]`` (``[0, S)``
    accept tests, ``S + s`` the residual draw after a rejection at s, ``2S`` the bonus draw),
    ``1 <= P_v <= S``. Row b walks ``rowP = max(1, min(P_v, proposal_lengths[b]))`` drafts: draft
    ``t`` at s is accepted iff ``p = target[b, s, t] > 0`` and ``u[b, s] <= a`` with
    ``a = 1 if q <= 1e-20 else min(1, p / q)`` (``q = draft[b, s, t]``); the first rejection appends a
    draw from ``max(p - q, 0)`` (from ``p`` when that has mass ``<= 1e-20``) and stops; after ``rowP``
    acceptances a bonus token is drawn from target row ``rowP``. Entries past ``accept_length`` are 0.
    Rows that are not probabilities are rejected where values are checked (module docstring: the
    target rows and the draft rows ``[:, :P_v]``). ``workspace``: a ``dspark.kernels.Workspace`` for
    the Triton draw's scratch (default: a private one).
    """
    c = Checker("probabilistic_accept")
    draft, p_v = verify_drafts(c, draft_token_ids, verify_proposal_len)
    (batch, stride), device = draft.shape, draft.device
    target = c.tensor("target_probabilities", target_probabilities, dtype=torch.float32, ndim=3, device=device)
    vocab = target.shape[2]
    if vocab < 1:
        c.fail(f"target_probabilities must have V >= 1 columns, got shape {list(target.shape)}")
    c.tensor("target_probabilities", target, shape=[batch, p_v + 1, vocab])
    probs = c.tensor("draft_probabilities", draft_probabilities, dtype=torch.float32, shape=[batch, stride, vocab],
                     device=device)
    lengths = c.tensor("proposal_lengths", proposal_lengths, dtype=torch.int32, shape=[batch], device=device)
    uniforms = c.tensor("accept_uniforms", accept_uniforms, dtype=torch.float32, shape=[batch, 2 * stride + 1],
                        device=device)
    c.ids_in_range(f"draft_token_ids[:, :{p_v}]", draft[:, :p_v], vocab)
    c.probabilities("target_probabilities", target)
    c.probabilities(f"draft_probabilities[:, :{p_v}]", probs[:, :p_v])
    return implementation("probabilistic_accept", device)(
        target.contiguous(), probs.contiguous(), draft.contiguous(), lengths.contiguous(), uniforms.contiguous(), p_v,
        resolve(c, workspace))


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
