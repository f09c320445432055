"""The DSpark heads on top of the draft backbone, and the draft-vocabulary mapping.

* ``MarkovHead`` (runtime.md §3): the sequential logit correction ``B_k`` that conditions slot k
  on the previous token ``y_{k-1}`` (a target id). ``markov_w1`` indexes the target vocabulary,
  ``markov_w2`` produces draft-vocabulary logits. Head types ``vanilla``, ``gated`` and ``rnn``.
* ``ConfidenceHead`` (runtime.md §4): the pre-sigmoid logit of "draft token k survives given the
  earlier ones did", from ``[h_k ; W1[y_{k-1}]]`` (or ``h_k`` alone).
* Reduced vocabularies (runtime.md §2.8): ``d2t`` holds offsets, ``target_id = draft_id + d2t[draft_id]``;
  ``t2d`` marks the kept target ids.

Head math runs in float32 whatever the weight dtype, as the kernels do (kernels.md §1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels._validate import Checker

__all__ = ["MarkovHead", "ConfidenceHead", "build_vocab_mapping", "check_vocab_mapping", "scatter_vocab"]


class MarkovHead(nn.Module):
    """Markov head with parameters named as in the checkpoints (``markov_head.*``).

    ``markov_w1`` Embedding ``[V_t, r]``; ``markov_w2`` Linear r -> V_d (weight ``[V_d, r]``, no
    bias); gated: ``gate_proj`` Linear H+r -> r; rnn: ``joint_proj`` Linear 2r+H -> 3r.
    """

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, rank: int, head_type: str):
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def forward(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, state: torch.Tensor | None = None):
        """One sequential step for B rows.

        hidden ``[B, H]`` (final-norm backbone hidden of slot k), prev_tokens int ``[B]`` (target ids
        ``y_{k-1}``), state fp32 ``[B, r]`` or None (rnn only; None = zeros, ignored otherwise).
        Returns ``(bias fp32 [B, V_d], state)``: vanilla ``W2 e``, gated ``W2 (g*e)`` with
        ``g = sigmoid(W_g [h; e] + b_g)``, rnn ``W2 tanh(o)`` with ``[g, c, o] = W_j [s; e; h] + b_j``,
        ``s' = sigmoid(g)*s + (1-sigmoid(g))*tanh(c)`` (``e = W1[prev]``).
        """
        e = self.markov_w1(prev_tokens).float()
        if self.head_type == "vanilla":
            x = e
        elif self.head_type == "gated":
            gate = torch.sigmoid(_linear32(self.gate_proj, torch.cat([hidden.float(), e], dim=-1)))
            x = gate * e
        else:
            if state is None:
                state = e.new_zeros(e.shape)
            g, c, o = _linear32(self.joint_proj, torch.cat([state, e, hidden.float()], dim=-1)).chunk(3, dim=-1)
            keep = torch.sigmoid(g)
            state = keep * state + (1 - keep) * torch.tanh(c)
            x = torch.tanh(o)
        return _linear32(self.markov_w2, x), state


class ConfidenceHead(nn.Module):
    """``proj`` Linear H(+r) -> 1 with bias (``confidence_head.proj.{weight,bias}``)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor | None) -> torch.Tensor:
        """hidden ``[..., H]``, markov_embedding ``[..., r]`` (``W1[prev]``; used only with_markov)
        -> fp32 pre-sigmoid logits ``[...]``."""
        x = hidden.float()
        if self.with_markov:
            x = torch.cat([x, markov_embedding.float()], dim=-1)
        return _linear32(self.proj, x).squeeze(-1)


def _linear32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` in float32 whatever the layer's dtype."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x, layer.weight.float(), bias)


def scatter_vocab(x: torch.Tensor, target_ids: torch.Tensor, vocab_size: int, dim: int, fill: float) -> torch.Tensor:
    """Place the draft-vocabulary entries of ``x`` (size V_d along ``dim``) at ``target_ids`` in a
    new tensor of size ``vocab_size`` along ``dim``, ``fill`` elsewhere (same dtype as ``x``)."""
    shape = list(x.shape)
    shape[dim] = vocab_size
    return x.new_full(shape, fill).index_copy_(dim, target_ids, x)


def build_vocab_mapping(target_ids, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [V_d], t2d bool [V_t])`` for the kept target ids (any order, no duplicates).

    The ids are sorted ascending, so draft id i is the i-th smallest kept target id and
    ``d2t = sorted_ids - arange(V_d)`` (EAGLE-3 offsets, runtime.md §2.8).
    """
    c = Checker("build_vocab_mapping")
    ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten().sort().values
    if ids.numel() == 0:
        c.fail("target_ids must hold at least one id, got none")
    c.ids_in_range("target_ids", ids, vocab_size)
    if bool((ids[1:] == ids[:-1]).any()):
        c.fail("target_ids must not repeat an id")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def check_vocab_mapping(fn: str, d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Validate a loaded ``d2t``/``t2d`` pair; returns the int64 target ids ``[V_d]`` of the draft ids."""
    c = Checker(fn)
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        c.fail(f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        c.fail("d2t must map draft ids to strictly increasing target ids (sorted, EAGLE-3 convention)")
    expected = torch.zeros(vocab_size, dtype=torch.bool, device=t2d.device)
    expected[ids.to(t2d.device)] = True
    if not torch.equal(t2d.bool(), expected):
        c.fail(f"t2d marks {int(t2d.sum())} target ids but d2t maps to {ids.numel()}; "
               f"the two disagree at {int((t2d.bool() != expected).sum())} ids")
    return ids
