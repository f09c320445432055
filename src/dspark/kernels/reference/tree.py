"""Reference tree family: the DDTree builder's best-first growth (contract: ``dspark.kernels.ddtree_build``)."""

from __future__ import annotations

import math

import torch

__all__ = ["ddtree_grow"]


def ddtree_grow(cand_tokens, gains, limit, roots, size):
    """Best-first growth of every row at once, one node per iteration, on the tensors' device (no
    host synchronisation). A candidate is (node, slot): the node's score plus the slot's gain at
    the child depth; the best valid one -- the first in (node, slot) order among equal scores, which
    is the spec's parent, slot, token order since slots rank tokens -- becomes the next node of its
    row; a row without a valid candidate stops growing.

    ``cand_tokens`` int32 ``[B, P, K]`` / ``gains`` f64 ``[B, P, K]``: depth ``d + 1``'s candidates
    and their gains at ``[:, d]``; ``limit`` int64 ``[B]``: the deepest depth; ``roots`` int32 ``[B]``.
    Returns ``(tokens int32, parents int32, depths int32, ancestor_bits int64, scores f64)`` of shape
    ``[B, size]`` and ``num_nodes`` int32 ``[B]``; unused slots hold the root token, depth 0, parent
    -1, their own bit and score 0.
    """
    batch, _, k = gains.shape
    device = gains.device
    rows, ids = torch.arange(batch, device=device), torch.arange(size, device=device)
    score = torch.full((batch, size), -math.inf, dtype=torch.float64, device=device)
    score[:, 0] = 0.0
    depth = torch.zeros(batch, size, dtype=torch.int64, device=device)
    parent = torch.full((batch, size), -1, dtype=torch.int64, device=device)
    token = roots[:, None].repeat(1, size)
    bits = (torch.ones(size, dtype=torch.int64, device=device) << ids).repeat(batch, 1)
    taken = torch.zeros(batch, size * k, dtype=torch.bool, device=device)
    count = torch.ones(batch, dtype=torch.int64, device=device)
    last_depth = gains.shape[1] - 1
    for n in range(1, size):
        open_ = (ids[None, :] < count[:, None]) & (depth < limit[:, None])
        gain = gains[rows[:, None], depth.clamp(max=last_depth)]  # [B, S, K]: a node's children's gains
        candidate = (score[..., None] + gain).view(batch, size * k)
        valid = open_[..., None].expand(batch, size, k).reshape(batch, size * k) & ~taken
        best = torch.where(valid, candidate, -math.inf).argmax(-1)  # the first of the highest
        best = torch.where(valid.gather(1, best[:, None])[:, 0], best, valid.int().argmax(-1))  # all -inf
        grows = valid.any(-1)
        node, slot = best // k, best % k
        node_depth = depth.gather(1, node[:, None])[:, 0]
        score[:, n] = torch.where(grows, candidate.gather(1, best[:, None])[:, 0], score[:, n])
        depth[:, n] = torch.where(grows, node_depth + 1, depth[:, n])
        parent[:, n] = torch.where(grows, node, parent[:, n])
        token[:, n] = torch.where(grows, cand_tokens[rows, node_depth.clamp(max=last_depth), slot], token[:, n])
        bits[:, n] = torch.where(grows, bits.gather(1, node[:, None])[:, 0] | bits[:, n], bits[:, n])
        taken.scatter_(1, best[:, None], taken.gather(1, best[:, None]) | grows[:, None])
        count += grows.long()
    score = torch.where(ids[None, :] < count[:, None], score, 0.0)
    return token, parent.to(torch.int32), depth.to(torch.int32), bits, score, count.to(torch.int32)
