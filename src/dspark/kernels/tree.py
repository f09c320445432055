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

The candidates are PyTorch ops on the tensors' device; the best-first growth is the backend's
``ddtree_grow`` (the reference: tensor ops over every row at once, one iteration per node; Triton:
one program per row); the walks are PyTorch ops, one iteration per depth. Nothing synchronises with
the host, so the engine captures all of it in its CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._backend import implementation
from ._validate import Checker

__all__ = ["TreeBatch", "ddtree_build", "greedy_tree_accept", "sampled_tree_accept", "MAX_TREE_TOP_K", "MAX_TREE_NODES"]

MAX_TREE_TOP_K = 8  # candidates per depth (TensorRT-Edge-LLM's bound)
MAX_TREE_NODES = 64  # node slots per tree: ancestor masks are int64 bitmasks
CONFIDENCE_FLOOR = 1e-20  # log(max(conf, floor)): a zero confidence still orders


@dataclass
class TreeBatch:
    """One token tree per row, ``S = verify_size`` node slots (node 0 = the root; parents before
    children). ``tokens`` int32 ``[B, S]``; ``parents`` int32 ``[B, S]`` (-1: the root, and the
    unused slots after ``num_nodes``); ``depths`` int32 ``[B, S]``; ``ancestors`` bool ``[B, S, S]``
    (``[b, i, j]``: node j is node i or one of its ancestors -- the verify attention mask);
    ``positions`` int32 ``[B, S]`` = base length + depth; ``num_nodes`` int32 ``[B]``;
    ``context_lengths`` int32 ``[B]`` = base length + S; ``scores`` f32 ``[B, S]``; ``ancestor_bits``
    int64 ``[B, S]``: ``ancestors`` as bitmasks (bit j of node i), what ``cached_attention``'s
    ``tree_mask`` takes (S <= 64)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    positions: torch.Tensor
    num_nodes: torch.Tensor
    context_lengths: torch.Tensor
    scores: torch.Tensor
    ancestor_bits: torch.Tensor | None = None


def ddtree_build(stacked_logits, root_tokens, base_lengths, *, candidate_top_k: int, verify_size: int,
                 depth_confidence=None, survival_threshold: float = 0.0, max_depths=None) -> TreeBatch:
    """Build each row's DDTree (module docstring; kernels.md §4.4).

    ``stacked_logits`` f32 ``[B, P+1, V]`` (row 0 unused: the root's place); ``root_tokens`` int
    ``[B]``; ``base_lengths`` int ``[B]`` (positions before the root); ``candidate_top_k`` in
    ``[1, 8]`` and ``<= V``; ``verify_size`` in ``[1, 64]`` node slots; ``depth_confidence`` f32 ``[B, P]``
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
    size = c.integer("verify_size", verify_size, low=1, high=MAX_TREE_NODES)
    roots = c.tensor("root_tokens", root_tokens, ndim=1, shape=[batch], device=device)
    base = c.tensor("base_lengths", base_lengths, ndim=1, shape=[batch], device=device)
    threshold = c.real("survival_threshold", survival_threshold, low=0.0)
    if threshold >= 1.0:
        c.fail(f"survival_threshold must be in [0, 1), got {threshold}")
    conf = None
    if depth_confidence is not None:
        conf = c.tensor("depth_confidence", depth_confidence, dtype=torch.float32, shape=[batch, depth_max],
                        device=device)
    logprobs = torch.log_softmax(logits[:, 1:], dim=-1)
    tokens = _top_k_tokens(logprobs, k)
    gains = logprobs.gather(-1, tokens.long()).double()
    limit = torch.full((batch,), depth_max, dtype=torch.int64, device=device)
    if conf is not None:
        log_conf = conf.double().clamp(min=CONFIDENCE_FLOOR).log()
        gains = gains + log_conf[..., None]
        if threshold > 0:  # prefix survival never rises: the depths that keep it above the floor, at least 1
            limit = (log_conf.cumsum(-1) >= math.log(threshold)).sum(-1).clamp(min=1)
    if max_depths is not None:
        depths = c.tensor("max_depths", max_depths, ndim=1, shape=[batch], device=device)
        limit = torch.minimum(limit, depths.long().clamp(min=1))
    grown = implementation("ddtree_grow", device)(tokens.contiguous(), gains.contiguous(), limit.contiguous(),
                                                  roots.to(torch.int32).contiguous(), size)
    token, parent, depth, bits, score, count = grown
    ids = torch.arange(size, device=device)
    base32 = base.to(torch.int32)
    return TreeBatch(token, parent, depth, ((bits[..., None] >> ids) & 1).bool(), base32[:, None] + depth, count,
                     base32 + size, score.float(), bits)


def _top_k_tokens(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[..., k]``: each row's ``k`` largest entries, the lower token first among equal ones
    (a stable descending sort's first ``k``), by ``topk`` on exact int64 keys (order-preserving f32
    bits, then the complemented index) instead of sorting all V."""
    vocab = logprobs.shape[-1]
    bits = (logprobs + 0.0).contiguous().view(torch.int32)  # + 0.0: -0 -> +0, which compare equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order = the floats' order
    index = torch.arange(vocab, device=logprobs.device)
    keys = (ordered.long() << 32) | (vocab - 1 - index)
    return (vocab - 1 - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)).to(torch.int32)


def greedy_tree_accept(target_logits, tree: TreeBatch, *, max_depth: int | None = None):
    """The longest root path whose every node is the target's argmax at its parent.

    ``target_logits`` f32 ``[B, S, V]``: the target's logits at each node (row i predicts node i's
    child). Returns ``(accepted int32 [B, S], accepted_nodes int32 [B, S], accept_length int32
    [B])``: row b emits ``accepted[b, :accept_length[b]]`` -- the accepted nodes' tokens, then the
    target's token after the last one -- and ``accepted_nodes[b, :n-1]`` are those nodes' indices
    (root excluded; the rest -1), whose KV and hidden states stay. ``max_depth`` (default ``S - 1``)
    bounds the walk (the trees' deepest depth). On the tensors' device, without host
    synchronisation; the lowest index wins among siblings with one token.
    """
    logits, walk = _walk(Checker("greedy_tree_accept"), "target_logits", target_logits, tree, max_depth)
    best = logits.argmax(-1)  # [B, S]: the target's token after each node
    for step in range(walk.steps):
        match = walk.children() & (walk.tokens == best.gather(1, walk.node[:, None]))
        walk.walking &= match.any(-1)
        walk.move(step, walk.walking, match.int().argmax(-1))  # the first matching sibling
    return walk.finish(best.gather(1, walk.node[:, None])[:, 0])


def sampled_tree_accept(target_probs, tree: TreeBatch, uniforms, *, max_depth: int | None = None):
    """Lossless sampled tree verification (a dspark addition; TensorRT-Edge-LLM refuses sampling in
    tree mode): each emitted token is distributed exactly as the target's at its node.

    From the root, a node's children are tested in index order (their rank among the drafter's
    candidates): child ``c`` is accepted with probability ``p'(c)``, where ``p'`` is the target's
    distribution at the node with the children already rejected removed and renormalised. An
    accepted child's token is emitted and the walk goes on from it; when every child is rejected,
    one token is drawn from the last ``p'`` and the walk ends; at a leaf (or ``max_depth``) the
    token after it is drawn from the target's distribution there. Testing fixed candidates this way
    is sampling from ``p`` one outcome at a time: ``P(c_i) = p(c_i)``, and ``P(x) = p(x)`` for a
    token outside the candidates.

    ``target_probs`` f32 ``[B, S, V]`` (the target's probabilities after temperature / top-k / top-p
    at each node); ``uniforms`` f32 ``[B, D + 1, K + 1]`` with ``D = max_depth`` (default ``S - 1``):
    row ``d`` holds depth ``d``'s sibling tests (``[:, d, :K]``, K >= the most children of a node)
    and its draw (``[:, d, K]``). Returns what ``greedy_tree_accept`` returns. On the tensors'
    device, without host synchronisation.
    """
    c = Checker("sampled_tree_accept")
    probs, walk = _walk(c, "target_probs", target_probs, tree, max_depth)
    batch, size, vocab = probs.shape
    u = c.tensor("uniforms", uniforms, dtype=torch.float32, ndim=3, device=probs.device)
    if u.shape[0] != batch or u.shape[1] < walk.steps + 1 or u.shape[2] < 2:
        c.fail(f"uniforms must have shape [{batch}, >= {walk.steps + 1}, K + 1 >= 2], got {list(u.shape)}")
    k, device = u.shape[2] - 1, probs.device
    rows = torch.arange(batch, device=device)
    final = torch.zeros(batch, dtype=torch.int64, device=device)
    for step in range(walk.steps + 1):
        p = probs[rows, walk.node].double()  # [B, V]: the target at the current node
        siblings = walk.children() if step < walk.steps else torch.zeros_like(walk.child_of)
        order = torch.where(siblings, walk.ids[None, :], size).sort(-1).values[:, :k]  # the children, in index order
        remaining = torch.ones(batch, dtype=torch.float64, device=device)
        excluded = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        chosen = torch.full((batch,), -1, dtype=torch.int64, device=device)
        for j in range(order.shape[1]):
            child = order[:, j]
            present = (child < size) & (chosen < 0)
            token = walk.tokens.gather(1, child.clamp(max=size - 1)[:, None])[:, 0]
            mass = p.gather(1, token[:, None])[:, 0]
            take = present & (u[:, step, j].double() * remaining < mass)
            chosen = torch.where(take, child, chosen)
            rejected = present & ~take
            remaining = torch.where(rejected, remaining - mass, remaining)
            excluded[rows, token] |= rejected
        moves = walk.walking & (chosen >= 0)
        residual = torch.where(excluded, 0.0, p)
        cdf = residual.cumsum(-1)
        drawn = torch.searchsorted(cdf, (u[:, step, k].double() * cdf[:, -1])[:, None], right=True)[:, 0]
        drawn = torch.where(cdf[:, -1] > 0, drawn.clamp(max=vocab - 1), p.argmax(-1))  # no mass left (rounding)
        final = torch.where(walk.walking & ~moves, drawn, final)
        if step < walk.steps:
            walk.move(step, moves, chosen.clamp(min=0))
        walk.walking = moves
    return walk.finish(final)


@dataclass
class _Walk:
    """What both tree walks keep per row: the current node, whether it still walks, the emitted
    tokens, the accepted path and its length (``greedy_tree_accept``'s outputs)."""

    steps: int
    ids: torch.Tensor
    child_of: torch.Tensor  # [B, S]: the node slots that are real non-root nodes
    tokens: torch.Tensor
    parents: torch.Tensor
    node: torch.Tensor
    walking: torch.Tensor
    accepted: torch.Tensor
    nodes: torch.Tensor
    length: torch.Tensor

    def children(self) -> torch.Tensor:
        return self.child_of & (self.parents == self.node[:, None])

    def move(self, step: int, moves: torch.Tensor, child: torch.Tensor) -> None:
        """Rows ``moves`` accept node ``child`` at path position ``step``."""
        token = self.tokens.gather(1, child[:, None])[:, 0].to(torch.int32)
        self.accepted[:, step] = torch.where(moves, token, self.accepted[:, step])
        self.nodes[:, step] = torch.where(moves, child.to(torch.int32), self.nodes[:, step])
        self.node = torch.where(moves, child, self.node)
        self.length += moves.long()

    def finish(self, last: torch.Tensor):
        """The token after the path, then ``(accepted, accepted_nodes, accept_length)``."""
        self.accepted.scatter_(1, self.length[:, None], last[:, None].to(torch.int32))
        return self.accepted, self.nodes, (self.length + 1).to(torch.int32)


def _walk(c: Checker, name: str, values, tree: TreeBatch, max_depth: int | None):
    """``values`` f32 ``[B, S, V]`` checked against the tree, and a walk from every root."""
    values = c.tensor(name, values, dtype=torch.float32, ndim=3)
    batch, size = tree.tokens.shape
    if tuple(values.shape[:2]) != (batch, size):
        c.fail(f"{name} must have shape [{batch}, {size}, V] like the tree, got {list(values.shape)}")
    steps = size - 1 if max_depth is None else min(c.integer("max_depth", max_depth, low=0), size - 1)
    device = values.device
    ids = torch.arange(size, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return values, _Walk(
        steps, ids, (ids[None, :] >= 1) & (ids[None, :] < tree.num_nodes.to(device)[:, None]),
        tree.tokens.to(device).long(), tree.parents.to(device).long(), torch.zeros(batch, **i64),
        torch.ones(batch, dtype=torch.bool, device=device), torch.zeros(batch, size, dtype=torch.int32, device=device),
        torch.full((batch, size), -1, dtype=torch.int32, device=device), torch.zeros(batch, **i64))
