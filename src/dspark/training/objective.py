"""The DSpark training objective (runtime.md Part IV §5; paper §3).

Per drafting slot k of a block, with ``p_d = softmax(draft_logits)`` (the Markov-corrected draft
distribution, teacher-forced previous tokens) and ``p_t = softmax(target_logits)`` (the target's
distribution for the same position)::

    CE_k  = -log p_d(argmax p_t)                  # speculators' "ce": against the target's argmax
    TV_k  = 1 - sum_v min(p_d, p_t) = ½‖p_d - p_t‖₁
    BCE_k = BCE-with-logits(confidence_logit_k, 1 - TV_k)     # target detached (analytic acceptance)
    L = Σ_rows Σ_k w_k (0.1·CE_k + 0.9·TV_k + 1.0·BCE_k) / (rows · Σ_k w_k)

with position weights ``w_k = exp(-k/γ)`` (γ = 4) for anchor-sampled blocks (every slot drafts) and,
without ``sample_from_anchor``, ``w_0 = 0`` and ``w_k = exp(-(k-1)/γ)`` (slot 0 only carries the
anchor). CE uses the target's argmax rather than the corpus token because the drafter's job is to
agree with the target, not with the corpus (which need not be the target's own text).

For greedy decoding the confidence head can learn what greedy verification accepts instead
(``greedy_confidence``): the temperature-0 ``1 - TV`` (1 iff the argmaxes agree), conditioned like
the head's definition on the earlier drafts having been accepted. In greedy rounds the acceptance of
a late slot is much higher than its average over all blocks (the rounds that reach it are the easy
ones); a head trained on every block misses that, and per-position temperatures cannot fix a bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels._validate import Checker

__all__ = ["position_weights", "DSparkLoss", "dspark_loss", "expected_accepted_length"]

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "bce": 1.0}


def position_weights(block_size: int, gamma: float = 4.0, sample_from_anchor: bool = True,
                     device=None) -> torch.Tensor:
    """fp32 ``[block_size]`` loss weights per slot: ``exp(-k/γ)`` with ``sample_from_anchor``, else
    0 for slot 0 and ``exp(-(k-1)/γ)`` for slot k >= 1."""
    c = Checker("position_weights")
    c.integer("block_size", block_size, low=1 if sample_from_anchor else 2)
    c.real("gamma", gamma, low=1e-6)
    offset = 0 if sample_from_anchor else 1
    k = torch.arange(block_size, dtype=torch.float32, device=device) - offset
    return torch.where(k >= 0, torch.exp(-k / gamma), torch.zeros((), device=device))


@dataclass
class DSparkLoss:
    """``loss``: the differentiable scalar. ``ce``/``tv``/``bce``: the position-weighted means of
    each term (detached scalars). ``acceptance``: mean ``1 - TV`` per drafting slot (detached
    ``[P]``, the analytic per-position acceptance at temperature 1); ``greedy_acceptance``: the
    fraction of rows whose draft argmax equals the target's, per drafting slot (``[P]``)."""

    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    bce: torch.Tensor
    acceptance: torch.Tensor
    greedy_acceptance: torch.Tensor


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, confidence_logits: torch.Tensor | None,
                weights: torch.Tensor, *, greedy_confidence: bool = False,
                mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DSparkLoss:
    """The objective of the module docstring.

    draft_logits, target_logits: float ``[..., N, V]`` (computed in fp32); confidence_logits: float
    ``[..., N]`` pre-sigmoid, or None for a draft without a confidence head (the BCE term is then
    0); weights: ``[N]`` from ``position_weights`` (slots of weight 0 are ignored, also in the
    per-slot statistics). ``greedy_confidence``: the confidence head learns the acceptance of
    greedy verification given that the earlier drafts were accepted -- its definition (runtime.md
    §4) at temperature 0: the BCE target is ``1 - TV`` of the one-hot argmax distributions, i.e.
    1 where the draft's argmax is the target's, and slot k's BCE counts only in blocks whose earlier
    drafting slots all matched (the rounds in which the engine reaches slot k).
    ``mean_over_ranks``: data-parallel training's average over the ranks (``World.mean``); the
    weighted means then divide by the global batch's total weight (the greedy BCE's differs from
    rank to rank), so the ranks' averaged gradients are the global batch's.
    """
    c = Checker("dspark_loss")
    c.tensor("draft_logits", draft_logits, dtype=(torch.float32, torch.float16, torch.bfloat16))
    if draft_logits.dim() < 2:
        c.fail(f"draft_logits must be [..., N, V], got shape {list(draft_logits.shape)}")
    c.tensor("target_logits", target_logits, shape=list(draft_logits.shape), device=draft_logits.device)
    n = draft_logits.shape[-2]
    c.tensor("weights", weights, dtype=torch.float32, shape=[n], device=draft_logits.device)
    if confidence_logits is not None:
        c.tensor("confidence_logits", confidence_logits, shape=list(draft_logits.shape[:-1]),
                 device=draft_logits.device)

    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    p = F.softmax(target_logits.float(), dim=-1)
    labels = target_logits.argmax(-1)
    ce = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    tv = 1.0 - torch.minimum(log_q.exp(), p).sum(-1)
    match = (draft_logits.argmax(-1) == labels).float()
    drafting = weights > 0
    weight = weights.expand_as(tv)
    bce_weight = weight
    if confidence_logits is None:
        bce = torch.zeros_like(tv)
    else:
        accept = (1.0 - tv).detach()
        if greedy_confidence:
            passed = torch.where(drafting, match, torch.ones_like(match)).cumprod(-1)
            bce_weight = weight * torch.cat([torch.ones_like(passed[..., :1]), passed[..., :-1]], dim=-1)
            accept = match
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")

    def weighted(term: torch.Tensor, w: torch.Tensor = weight) -> torch.Tensor:
        total = w.sum() if mean_over_ranks is None else mean_over_ranks(w.sum())
        return (term * w).sum() / total.clamp_min(1e-12)

    terms = {"ce": weighted(ce), "tv": weighted(tv), "bce": weighted(bce, bce_weight)}
    loss = sum(LOSS_WEIGHTS[name] * value for name, value in terms.items())
    rows = tv.numel() // n
    with torch.no_grad():
        acceptance = (1.0 - tv).reshape(rows, n).mean(0)[drafting]
        greedy = match.reshape(rows, n).mean(0)[drafting]
    return DSparkLoss(loss, *(t.detach() for t in terms.values()), acceptance, greedy)


def expected_accepted_length(acceptance) -> float:
    """τ implied by conditional per-position acceptances ``α_k``: ``1 + Σ_k Π_{i<=k} α_i`` (the bonus
    token included)."""
    tau, survival = 1.0, 1.0
    for a in (acceptance.tolist() if isinstance(acceptance, torch.Tensor) else acceptance):
        survival *= float(a)
        tau += survival
    return tau
