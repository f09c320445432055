"""Triton tree family: the DDTree builder's best-first growth (contract: ``dspark.kernels.ddtree_build``).

One program per row grows its whole tree: the node slots and the (node, slot) candidates live in
registers (at most 64 nodes x 8 slots), each step one masked max and one masked min pick the best
valid candidate -- the first in (node, slot) order among equal scores, as the reference -- and the
new node's own candidates open. The reference's loop is some fifteen tensor ops per node (a few
microseconds each, graphed or not); here a node costs a few register reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import next_pow2

__all__ = ["ddtree_grow"]


@triton.jit
def _grow_kernel(tok_in_ptr, gain_ptr, limit_ptr, root_ptr, tok_ptr, par_ptr, dep_ptr, bits_ptr, score_ptr, count_ptr,
                 P, K, S, SP: tl.constexpr, CK: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.arange(0, SP)
    c = tl.arange(0, CK)  # candidate c: node c // K, slot c % K
    cnode, cslot = c // K, c % K
    in_range = c < S * K
    # scalars enter the masks as vectors (the interpreter mis-types a bool vector & a scalar test)
    limit = tl.zeros([CK], tl.int64) + tl.load(limit_ptr + row)
    root = tl.load(root_ptr + row)
    base = row.to(tl.int64) * P * K
    score = tl.where(ids == 0, 0.0, float("-inf")).to(tl.float64)
    depth = tl.zeros([SP], tl.int64)
    parent = tl.full([SP], -1, tl.int64)
    token = tl.full([SP], 0, tl.int32) + root
    bits = tl.full([SP], 1, tl.int64) << ids.to(tl.int64)
    opening = in_range & (cnode == 0) & (limit > 0)  # the root's children (depth 1)
    zero = tl.zeros([CK], tl.float64)
    cscore = tl.where(opening, zero + tl.load(gain_ptr + base + cslot, mask=opening, other=0.0), float("-inf"))
    cvalid = opening
    count = 1
    for n in range(1, S):
        masked = tl.where(cvalid, cscore, float("-inf"))
        top = tl.max(masked, axis=0)
        best = tl.min(tl.where(cvalid & (masked == top), c, CK), axis=0)
        grows = (tl.zeros([CK], tl.int32) + best) < CK
        bnode, bslot = best // K, best % K
        bdepth = tl.sum(tl.where(ids == bnode, depth, 0), axis=0)
        bbits = tl.sum(tl.where(ids == bnode, bits, 0), axis=0)
        new_score = tl.sum(tl.where(c == best, cscore, 0.0), axis=0)
        # without a candidate bdepth is 0 and bslot < K: an address in the row, the token unused
        new_token = tl.load(tok_in_ptr + base + bdepth * K + bslot)
        here = (ids == n) & ((tl.zeros([SP], tl.int32) + best) < CK)
        score = tl.where(here, new_score, score)
        depth = tl.where(here, bdepth + 1, depth)
        parent = tl.where(here, bnode.to(tl.int64), parent)
        token = tl.where(here, new_token, token)
        bits = tl.where(here, bbits | (tl.full([], 1, tl.int64) << n), bits)
        cvalid = cvalid & (c != best)
        opening = in_range & (cnode == n) & grows & (bdepth + 1 < limit)
        gain = tl.load(gain_ptr + base + (bdepth + 1) * K + cslot, mask=opening, other=0.0)
        cscore = tl.where(opening, new_score + gain, cscore)
        cvalid = cvalid | opening
        count += tl.where(best < CK, 1, 0)
    live = ids < S
    out = row.to(tl.int64) * S + ids
    tl.store(tok_ptr + out, token, mask=live)
    tl.store(par_ptr + out, parent.to(tl.int32), mask=live)
    tl.store(dep_ptr + out, depth.to(tl.int32), mask=live)
    tl.store(bits_ptr + out, bits, mask=live)
    tl.store(score_ptr + out, tl.where(ids < count, score, 0.0), mask=live)
    tl.store(count_ptr + row, count)


def ddtree_grow(cand_tokens, gains, limit, roots, size):
    """``dspark.kernels.reference.tree.ddtree_grow`` (its contract), one program per row."""
    batch, depths, k = gains.shape
    device = gains.device
    outs = [torch.empty(batch, size, dtype=dtype, device=device)
            for dtype in (torch.int32, torch.int32, torch.int32, torch.int64, torch.float64)]
    count = torch.empty(batch, dtype=torch.int32, device=device)
    if batch:
        _grow_kernel[(batch,)](cand_tokens, gains, limit, roots, *outs, count, depths, k, size,
                               SP=next_pow2(size), CK=next_pow2(size * k), num_warps=2)
    return (*outs, count)
