"""Triton candidate-set drafting step (contract: ``dspark.kernels.candidates``): one program per row.

A row's C + M candidates (a few hundred at most) live in registers: the program appends the previous
token's M successors to its C backbone candidates (writing their ids), masks ids already held by an
earlier lane, gathers the backbone logits and W2 rows, adds ``W2[ids] . W1[prev]`` in ``BLOCK_R``
chunks of the rank, ranks the lanes for top-k / top-p with ``[C + M, C + M]`` pairwise comparisons
(no sort), normalises, stores q and draws the token. It reads ``(C + M) * R`` weights instead of W2
whole, and never synchronises the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import GREEDY_TEMPERATURE as _GREEDY_TEMPERATURE
from .._shared import next_pow2
from ..reference import candidates as reference
from ._shared import MAX_CANDIDATES, NO_HIT, SENTINEL, clamp_uniform, first_hit, key_index, order_key, row_chunk
from .filter import GROUP, _candidate_slots, top_candidates
from .search import NPROBE

__all__ = ["candidate_top_ids", "markov_candidate_sample_step"]

GREEDY_TEMPERATURE = tl.constexpr(_GREEDY_TEMPERATURE)


@triton.jit
def _candidate_logits(logits_ptr, base_row, bias_row, w1_ptr, w2_ptr, prev, ids, valid, V, R: tl.constexpr,
                      BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(backbone[base_row, ids] + bias_row[ids]) + W2[ids] . W1[prev]`` in fp32 (``HAS_BIAS``; else no
    bias), -inf on padding lanes."""
    z = tl.load(logits_ptr + base_row * V + ids, mask=valid, other=float("-inf"))
    if HAS_BIAS:
        z += tl.load(bias_row + ids, mask=valid, other=0.0)
    bias = tl.zeros(ids.shape, tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        in_rank = offs_r < R
        e = tl.load(w1_ptr + prev * R + offs_r, mask=in_rank, other=0.0).to(tl.float32)
        w = tl.load(w2_ptr + ids[:, None] * R + offs_r[None, :], mask=valid[:, None] & in_rank[None, :],
                    other=0.0).to(tl.float32)
        bias += tl.sum(w * e[None, :], axis=1)
    return z + bias


@triton.jit
def _filtered_weights(z, valid, lanes, temperature, top_k, top_p, min_p):
    """Unnormalised q of a sampled row: ``exp(z/T - max)`` after min_p, top-k and top-p (ranks from
    pairwise comparisons; ties to the lower lane)."""
    x = tl.where(valid, z / temperature, float("-inf"))
    w = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    keep = valid & (w >= min_p)
    greater = (x[None, :] > x[:, None]) & valid[None, :]  # [i, j]: x_j > x_i
    count = tl.sum(valid.to(tl.int32), axis=0)
    k = tl.where((top_k > 0) & (top_k < count), top_k, count)
    keep = keep & (tl.sum(greater.to(tl.int32), axis=1) < k)
    w = tl.where(keep, w, 0.0)
    before = greater | ((x[None, :] == x[:, None]) & (lanes[None, :] < lanes[:, None]))
    above = tl.sum(tl.where(before, w[None, :], 0.0), axis=1)
    nucleus = tl.where(top_p >= 1.0, float("inf"), top_p * tl.sum(w, axis=0))  # top_p 1: no nucleus
    return tl.where(keep & (above < nucleus), w, 0.0)


@triton.jit
def _candidate_step_kernel(logits_ptr, bias_ptr, w1_ptr, w2_ptr, first_ptr, ids_ptr, succ_ptr, u_ptr, draft_ptr,
                           probs_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, step, P, V, C, M, logits_stride,
                           logits_offset, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
    """Step ``step`` of row ``program_id``: C backbone candidates, then M successors (M may be 0)."""
    b = tl.program_id(0).to(tl.int64)
    if step == 0:
        prev = tl.load(first_ptr + b)
    else:
        prev = tl.load(draft_ptr + b * P + step - 1)
    prev = tl.minimum(tl.maximum(prev, 0), V - 1).to(tl.int64)
    lanes = tl.arange(0, BLOCK_C)
    width = C + M
    cell = (b * P + step) * width
    successor = (lanes >= C) & (lanes < width)
    succ = tl.load(succ_ptr + prev * M + (lanes - C), mask=successor, other=0)
    tl.store(ids_ptr + cell + lanes, succ, mask=successor)
    ids = tl.where(successor, succ, tl.load(ids_ptr + cell + lanes, mask=lanes < C, other=0))
    ids = tl.minimum(tl.maximum(ids, 0), V - 1).to(tl.int64)
    earlier = (ids[None, :] == ids[:, None]) & (lanes[None, :] < lanes[:, None])  # [i, j]: lane j < i holds it
    valid = (lanes < width) & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    z = _candidate_logits(logits_ptr, b * logits_stride + step + logits_offset, bias_ptr + b * V, w1_ptr, w2_ptr,
                          prev, ids, valid, V, R, BLOCK_R, HAS_BIAS)

    temperature = tl.load(temp_ptr + b)
    top_k = tl.load(top_k_ptr + b).to(tl.int32)
    if (temperature < GREEDY_TEMPERATURE) or (top_k == 1):  # greedy: one-hot at the first largest z
        best = tl.min(tl.where(z == tl.max(z, axis=0), lanes, BLOCK_C), axis=0)
        q = tl.where(lanes == best, 1.0, 0.0)
    else:
        w = _filtered_weights(z, valid, lanes, temperature, top_k, tl.load(top_p_ptr + b), tl.load(min_p_ptr + b))
        q = w / tl.sum(w, axis=0)
    tl.store(probs_ptr + cell + lanes, q, mask=lanes < width)

    # inverse-CDF draw in lane order (kernels.md 2.4): first lane past t, else the last positive one
    t = clamp_uniform(tl.load(u_ptr + b * P + step))
    weights = tl.where(valid & (q > 0.0), q, 0.0)
    hit = first_hit(weights, lanes, 0.0, t)
    last = tl.max(tl.where(weights > 0.0, lanes, 0), axis=0)
    lane = tl.where(hit == NO_HIT, last, hit)
    tl.store(draft_ptr + b * P + step, tl.sum(tl.where(lanes == lane, ids, 0), axis=0).to(tl.int32))


@triton.jit
def _group_max_kernel(x_ptr, bias_ptr, V, stride, group_ptr, n_groups, CHUNK: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    """Per (backbone row, chunk): the largest filter key of every ``GROUP_SIZE`` entries of
    ``x = logits (+ bias[row // stride])``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    x = tl.load(x_ptr + row.to(tl.int64) * V + index, mask=mask, other=float("-inf"))
    if HAS_BIAS:
        x += tl.load(bias_ptr + (row // stride).to(tl.int64) * V + index, mask=mask, other=0.0)
    keys = tl.where(mask, order_key(x, index), SENTINEL)
    group = chunk * (CHUNK // GROUP_SIZE) + tl.arange(0, CHUNK // GROUP_SIZE)
    tl.store(group_ptr + row.to(tl.int64) * n_groups + group,
             tl.max(tl.reshape(keys, [CHUNK // GROUP_SIZE, GROUP_SIZE]), axis=1), mask=group < n_groups)


@triton.jit
def _top_ids_kernel(x_ptr, bias_ptr, V, stride, offset, width, group_ptr, n_groups, ids_ptr, ids_stride, scratch_ptr,
                    count, NG_PAD: tl.constexpr, KT: tl.constexpr, GROUP_SIZE: tl.constexpr, NPROBE_: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """Per slot (b, s): the ids of the ``count`` largest entries of backbone row ``b*stride + s + offset``
    (plus ``bias[b]``) into ``ids[b, s, :count]``, descending (ties to the lower index):
    ``filter.top_candidates`` from the row's group maxima."""
    slot = tl.program_id(0)
    row = (slot // width) * stride + slot % width + offset
    g = tl.arange(0, NG_PAD)
    group_keys = tl.load(group_ptr + row.to(tl.int64) * n_groups + g, mask=g < n_groups, other=SENTINEL)
    top = top_candidates(x_ptr + row.to(tl.int64) * V, bias_ptr + (slot // width).to(tl.int64) * V, V, 1.0,
                         group_keys, n_groups, count, scratch_ptr + slot.to(tl.int64) * KT, KT, GROUP_SIZE,
                         NPROBE_, HAS_BIAS)
    rank = tl.arange(0, KT)
    tl.store(ids_ptr + slot.to(tl.int64) * ids_stride + rank, key_index(top), mask=(top != SENTINEL) & (rank < count))


def candidate_top_ids(backbone_logits, logits_stride, logits_offset, candidate_ids, count, logit_bias):
    """``dspark.kernels.candidate_top_ids`` (via ``markov_candidate_sample``): ``_group_max_kernel``
    stores every row's group maxima (one read of the logits, the bias added there), then one program
    per slot selects its ids; more than ``MAX_CANDIDATES`` candidates take the reference."""
    batch, width, lanes = candidate_ids.shape
    rows, vocab = backbone_logits.shape
    if count > MAX_CANDIDATES or not batch:
        return reference.candidate_top_ids(backbone_logits, logits_stride, logits_offset, candidate_ids, count,
                                           logit_bias)
    chunk = max(row_chunk(vocab), GROUP)
    n_groups, kt = triton.cdiv(vocab, GROUP), _candidate_slots(count)
    groups = torch.empty(rows * n_groups, dtype=torch.int64, device=backbone_logits.device)
    scratch = torch.empty(batch * width * kt, dtype=torch.int64, device=backbone_logits.device)
    bias = backbone_logits if logit_bias is None else logit_bias
    _group_max_kernel[(rows, triton.cdiv(vocab, chunk))](backbone_logits, bias, vocab, logits_stride, groups, n_groups,
                                                         CHUNK=chunk, GROUP_SIZE=GROUP,
                                                         HAS_BIAS=logit_bias is not None, num_warps=4)
    _top_ids_kernel[(batch * width,)](backbone_logits, bias, vocab, logits_stride, logits_offset, width, groups,
                                      n_groups, candidate_ids, lanes, scratch, count, NG_PAD=next_pow2(n_groups),
                                      KT=kt, GROUP_SIZE=GROUP, NPROBE_=NPROBE, HAS_BIAS=logit_bias is not None,
                                      num_warps=8)


def markov_candidate_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, candidate_ids,
                                 successor_ids, proposal_uniforms, draft_token_ids, candidate_probabilities, step,
                                 temperature, top_k, top_p, min_p, logits_stride, logits_offset, logit_bias):
    """``dspark.kernels.markov_candidate_sample_step``: one program per row."""
    batch, width, count = candidate_ids.shape
    if not batch:
        return
    vocab, rank = markov_w1.shape
    successors = 0 if successor_ids is None else successor_ids.shape[1]
    block_c = max(16, next_pow2(count))
    _candidate_step_kernel[(batch,)](
        backbone_logits, backbone_logits if logit_bias is None else logit_bias, markov_w1, markov_w2,
        first_prev_tokens, candidate_ids, candidate_ids if successor_ids is None else successor_ids, proposal_uniforms,
        draft_token_ids, candidate_probabilities, temperature, top_k, top_p, min_p, step, width, vocab,
        count - successors, successors, logits_stride, logits_offset, R=rank, BLOCK_C=block_c,
        BLOCK_R=min(64, next_pow2(rank)), HAS_BIAS=logit_bias is not None,
        num_warps=4 if block_c <= 64 else 8)  # the [C, C] rank comparisons live in registers
