"""Tree family: the DDTree builder with DSpark confidence and the greedy tree acceptance
(kernels.md §4.4; runtime.md Part II §5.4).

A tree grows from the root (the last accepted token) over the drafter's per-depth candidates: depth
``d`` offers the ``candidate_top_k`` most likely tokens of ``stacked_logits[:, d]`` (the Markov-
corrected logits of step ``d - 1`` along the greedy chain), each scored by its log-softmax plus,
with ``depth_confidence``, the log of the confidence head's survival estimate at that depth. A node
scores its parent's score plus its own; nodes are taken best first -- score descending, then parent
index, candidate slot and token ascending -- until ``verify_size`` nodes (the root included) or no
candidate is left; growth stops at the deepest depth whose prefix survival (the product of the
confidences) is still at least ``survival_threshold`` (0: no limit), and is at least 1.

So far one implementation serves both backends: PyTorch, best-first on the host (it reads each
row's candidates back, a synchronisation); a Triton builder is for the engine's tree mode.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from ._validate import Checker

__all__ = ["TreeBatch", "ddtree_build", "greedy_tree_accept", "MAX_TREE_TOP_K"]

MAX_TREE_TOP_K = 8  # candidates per depth (TensorRT-Edge-LLM's bound)
CONFIDENCE_FLOOR = 1e-20  # log(max(conf, floor)): a zero confidence still orders


@dataclass
class TreeBatch:
    """One token tree per row, ``S = verify_size`` node slots (node 0 = the root; parents before
    children). ``tokens`` int32 ``[B, S]``; ``parents`` int32 ``[B, S]`` (-1: the root, and the
    unused slots after ``num_nodes``); ``depths`` int32 ``[B, S]``; ``ancestors`` bool ``[B, S, S]``
    (``[b, i, j]``: node j is node i or one of its ancestors -- the verify attention mask);
    ``positions`` int32 ``[B, S]`` = base length + depth; ``num_nodes`` int32 ``[B]``;
    ``context_lengths`` int32 ``[B]`` = base length + S; ``scores`` f32 ``[B, S]``."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    positions: torch.Tensor
    num_nodes: torch.Tensor
    context_lengths: torch.Tensor
    scores: torch.Tensor


def ddtree_build(stacked_logits, root_tokens, base_lengths, *, candidate_top_k: int, verify_size: int,
                 depth_confidence=None, survival_threshold: float = 0.0, max_depths=None) -> TreeBatch:
    """Build each row's DDTree (module docstring; kernels.md §4.4).

    ``stacked_logits`` f32 ``[B, P+1, V]`` (row 0 unused: the root's place); ``root_tokens`` int
    ``[B]``; ``base_lengths`` int ``[B]`` (positions before the root); ``candidate_top_k`` in
    ``[1, 8]`` and ``<= V``; ``verify_size`` >= 1 node slots; ``depth_confidence`` f32 ``[B, P]``
    (depth d uses ``[:, d-1]``) or None; ``survival_threshold`` in ``[0, 1)``; ``max_depths`` int
    ``[B]`` >= 1 or None: a deepest depth per row (the engine's context limit; a dspark addition).
    """
    c = Checker("ddtree_build")
    logits = c.tensor("stacked_logits", stacked_logits, dtype=torch.float32, ndim=3)
    batch, rows, vocab = logits.shape
    if rows < 2:
        c.fail(f"stacked_logits must hold the root row and at least one depth, got shape {list(logits.shape)}")
    device, depth_max = logits.device, rows - 1
    k = c.integer("candidate_top_k", candidate_top_k, low=1, high=min(MAX_TREE_TOP_K, vocab))
    size = c.integer("verify_size", verify_size, low=1)
    roots = c.tensor("root_tokens", root_tokens, ndim=1, shape=[batch], device=device)
    base = c.tensor("base_lengths", base_lengths, ndim=1, shape=[batch], device=device)
    threshold = c.real("survival_threshold", survival_threshold, low=0.0)
    if threshold >= 1.0:
        c.fail(f"survival_threshold must be in [0, 1), got {threshold}")
    conf = None
    if depth_confidence is not None:
        conf = c.tensor("depth_confidence", depth_confidence, dtype=torch.float32, shape=[batch, depth_max],
                        device=device)
    # per depth the top-k tokens (stable: the lower token first among equal logits) and log-softmax
    logprobs = torch.log_softmax(logits[:, 1:], dim=-1)
    order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    cand_tokens, cand_logprobs = order.indices[..., :k].tolist(), order.values[..., :k].double()
    bonus = torch.zeros(batch, depth_max, dtype=torch.float64, device=device)
    depth_limit = [depth_max] * batch
    if conf is not None:
        log_conf = conf.double().clamp(min=CONFIDENCE_FLOOR).log()
        bonus = log_conf
        if threshold > 0:
            reach = (log_conf.cumsum(-1) >= math.log(threshold)).sum(-1)  # prefix survival never rises
            depth_limit = [max(1, r) for r in reach.tolist()]
    if max_depths is not None:
        limits = c.tensor("max_depths", max_depths, ndim=1, shape=[batch], device=device).tolist()
        if min(limits, default=1) < 1:
            c.fail(f"max_depths must be >= 1, got {min(limits)}")
        depth_limit = [min(d, m) for d, m in zip(depth_limit, limits)]
    scores_of = (cand_logprobs + bonus[..., None]).tolist()
    out = [_grow(scores_of[b], cand_tokens[b], depth_limit[b], size) for b in range(batch)]
    return _tree_batch(out, roots, base, size, device)


def _grow(scores: list, tokens: list, depth_limit: int, size: int):
    """Best-first growth of one row: nodes as (parent, depth, slot, token, score), root first."""
    nodes = [(-1, 0, 0, -1, 0.0)]
    frontier: list = []

    def offer(parent: int):
        score, depth = nodes[parent][4], nodes[parent][1] + 1
        if depth > depth_limit:
            return
        for slot, (token, gain) in enumerate(zip(tokens[depth - 1], scores[depth - 1])):
            heapq.heappush(frontier, (-(score + gain), parent, slot, token, depth))

    offer(0)
    while frontier and len(nodes) < size:
        neg, parent, slot, token, depth = heapq.heappop(frontier)
        nodes.append((parent, depth, slot, token, -neg))
        offer(len(nodes) - 1)
    return nodes


def _tree_batch(rows: list, roots: torch.Tensor, base: torch.Tensor, size: int, device) -> TreeBatch:
    batch = len(rows)
    tokens = roots.to(torch.int32)[:, None].repeat(1, size).cpu()
    parents = torch.full((batch, size), -1, dtype=torch.int32)
    depths = torch.zeros(batch, size, dtype=torch.int32)
    scores = torch.zeros(batch, size, dtype=torch.float32)
    ancestors = torch.eye(size, dtype=torch.bool).repeat(batch, 1, 1)
    for b, nodes in enumerate(rows):
        for i, (parent, depth, _, token, score) in enumerate(nodes[1:], start=1):
            tokens[b, i], parents[b, i], depths[b, i], scores[b, i] = token, parent, depth, score
            ancestors[b, i] |= ancestors[b, parent]
    num_nodes = torch.tensor([len(n) for n in rows], dtype=torch.int32)
    base32 = base.to(torch.int32).cpu()
    return TreeBatch(tokens.to(device), parents.to(device), depths.to(device), ancestors.to(device),
                     (base32[:, None] + depths).to(device), num_nodes.to(device), (base32 + size).to(device),
                     scores.to(device))


def greedy_tree_accept(target_logits, tree: TreeBatch):
    """The longest root path whose every node is the target's argmax at its parent.

    ``target_logits`` f32 ``[B, S, V]``: the target's logits at each node (row i predicts node i's
    child). Returns ``(accepted int32 [B, D+1], accepted_nodes int32 [B, D+1], accept_length int32
    [B])`` with D the deepest node: row b emits ``accepted[b, :accept_length[b]]`` -- the accepted
    nodes' tokens, then the target's token after the last one -- and ``accepted_nodes[b, :n-1]``
    are those nodes' indices (root excluded; the rest -1), whose KV and hidden states stay.
    """
    c = Checker("greedy_tree_accept")
    logits = c.tensor("target_logits", target_logits, dtype=torch.float32, ndim=3)
    batch, size = tree.tokens.shape
    if tuple(logits.shape[:2]) != (batch, size):
        c.fail(f"target_logits must have shape [{batch}, {size}, V] like the tree, got {list(logits.shape)}")
    best = logits.argmax(-1).tolist()
    tokens, parents, count = tree.tokens.tolist(), tree.parents.tolist(), tree.num_nodes.tolist()
    depth = max(1, int(tree.depths.max()) + 1) if size else 1
    accepted = torch.zeros(batch, depth, dtype=torch.int32)
    nodes = torch.full((batch, depth), -1, dtype=torch.int32)
    lengths = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        children: dict[int, dict[int, int]] = {}
        for i in range(1, count[b]):
            children.setdefault(parents[b][i], {}).setdefault(tokens[b][i], i)
        node, path = 0, []
        while (nxt := children.get(node, {}).get(best[b][node])) is not None:
            path.append(nxt)
            node = nxt
        emitted = [tokens[b][i] for i in path] + [best[b][node]]
        accepted[b, :len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
        if path:
            nodes[b, :len(path)] = torch.tensor(path, dtype=torch.int32)
        lengths[b] = len(emitted)
    device = logits.device
    return accepted.to(device), nodes.to(device), lengths.to(device)
