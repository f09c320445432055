"""Triton transformer-layer ops (contracts: ``dspark.kernels.layers``).

Arguments arrive validated and normalised by ``dspark.kernels.layers``: ``x`` and ``residual``
contiguous, q/k/v ``[N, heads, d]`` with dense heads (any row stride), index tensors contiguous.
Every launch depends on shapes only (never on tensor values), allocates nothing but its outputs
(and, for split-K attention, its partials, sized by shapes), and never synchronises with the host,
so all four ops can be captured in CUDA graphs. On the GPU no value is checked (``layers``'s module
docstring), so each kernel clamps or masks its data-dependent indices: a bad slot id, position or
length never addresses memory outside the tensors.

* ``rms_norm``: one program per row (the decode rows are few and wide).
* ``qk_norm_rope_store``: one program per token for all its q, k and v heads; the head dimension is
  handled as its two RoPE halves so that ``rotate_half`` is a swap of two register tiles.
  The elementwise rounding of Hugging Face's op order is reproduced step by step (bf16 products and
  sum of the rotation), so the kernel differs from the reference only in the norm's f32 reduction.
* ``cached_attention``: flash-decoding. A program owns one (request, query block, KV head, key
  split): its tile rows are the ``T_block * (n_q / n_kv)`` (query, GQA head) pairs that read the
  same KV head, so each K/V tile is loaded once for all of them. It walks only its share of the
  request's visible keys ``[window_start, context_len + T)`` with an online f32 softmax. When the
  batch alone cannot fill the GPU, the key range is split over several programs (the split count is
  chosen from shapes; the share of each split from the actual lengths) and a second kernel merges
  the partial outputs by their log-sum-exp.
* ``silu_and_mul``: a 2-D grid over rows and column blocks.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "qk_norm_rope_store", "cached_attention", "silu_and_mul"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
# The CPU interpreter multiplies the raw bits of bf16 operands in tl.dot: there attention's two
# products run on f32 copies of the same (bf16-rounded) values.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------- rounding


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """f32 ``x`` rounded to ``dtype`` (to nearest even, as PyTorch rounds), kept as f32.

    For bf16 by bit arithmetic: the CPU interpreter's f32 -> bf16 cast truncates; on the GPU this is
    the same rounding as the cast. The values are then exact in ``dtype``, so storing them is exact.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _weighted_norm(x, w, inv_rms, dtype: tl.constexpr):
    """Hugging Face's ``weight * (x * inv_rms).to(dtype)`` (f32 in, f32 values exact in ``dtype`` out)."""
    return _rounded(w.to(tl.float32) * _rounded(x * inv_rms, dtype), dtype)


# ---------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, H, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * H
    offs = tl.arange(0, BLOCK_H)
    valid = offs < H
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + offs, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row + offs, mask=valid, other=0.0)
        x = _rounded(x.to(tl.float32) + r.to(tl.float32), dtype)  # the residual stream stays in x's dtype
        tl.store(sum_ptr + row + offs, x.to(dtype), mask=valid)
    x = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    tl.store(y_ptr + row + offs, _weighted_norm(x, w, inv_rms, dtype).to(dtype), mask=valid)


def rms_norm(x, weight, eps, residual):
    n, hidden = x.shape
    y = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    if n:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(n,)](x, residual if residual is not None else x, weight, y,
                               summed if summed is not None else y, hidden, eps,
                               HAS_RESIDUAL=residual is not None, BLOCK_H=block, num_warps=_warps(block))
    return y if residual is None else (y, summed)


def _warps(elements: int) -> int:
    """Warps for a program over ``elements`` values held in registers (Liger-Kernel's rule)."""
    return 16 if elements >= 8192 else 8 if elements >= 2048 else 4


# ------------------------------------------------------------------------ q/k norm + RoPE + store


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, offs_j, valid_j, eps, D: tl.constexpr, HALF: tl.constexpr,
               NORM: tl.constexpr, dtype: tl.constexpr):
    """Rows ``[x1 | x2]`` (the two halves of each head) -> optional RMSNorm, then RoPE.

    ``rope(x) = x * cos + rotate_half(x) * sin`` in ``dtype``: each product and the sum rounded as
    PyTorch rounds them (``rotate_half(x) = [-x2 | x1]``).
    """
    if NORM:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        x1 = _weighted_norm(x1, tl.load(w_ptr + offs_j, mask=valid_j, other=0.0)[None, :], inv_rms, dtype)
        x2 = _weighted_norm(x2, tl.load(w_ptr + HALF + offs_j, mask=valid_j, other=0.0)[None, :], inv_rms, dtype)
    else:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    out1 = _rounded(_rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype), dtype)
    out2 = _rounded(_rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), dtype)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, row_ptr, slot_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr,
                               q_out_ptr, q_w_ptr, k_w_ptr, table_ptr, stride_q, stride_k, stride_v, n_q, n_kv,
                               num_slots, max_len, max_pos, block_size, eps, D: tl.constexpr, HALF: tl.constexpr,
                               BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                               HAS_Q: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr, PAGED: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dtype = k_cache_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    row = tl.load(row_ptr + tok).to(tl.int64)  # the cache row (the position, except for tree nodes)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # a token whose cache row is out of range stores no head (a scalar select: the interpreter
    # cannot AND a scalar mask into a tensor mask)
    in_range = (row >= 0) & (row < max_len) & (slot >= 0) & (slot < num_slots)
    stored_heads = tl.where(in_range, n_kv, 0)
    if PAGED:  # the line's block that holds the row (an out-of-range token reads entry 0 and stores nothing)
        entry = tl.where(in_range, slot * (max_len // block_size) + row // block_size, 0)
        cache_row = tl.load(table_ptr + entry).to(tl.int64) * block_size + row % block_size
    else:
        cache_row = slot * max_len + row
    angle = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # bad positions read a valid table row
    offs_j = tl.arange(0, BLOCK_HALF)
    valid_j = offs_j < HALF
    table = cos_sin_ptr + angle * (2 * HALF) + offs_j
    cos = _rounded(tl.load(table, mask=valid_j, other=0.0), dtype)[None, :]
    sin = _rounded(tl.load(table + HALF, mask=valid_j, other=0.0), dtype)[None, :]

    heads = tl.arange(0, BLOCK_KH)
    tile = heads[:, None] * D + offs_j[None, :]
    valid = (heads < n_kv)[:, None] & valid_j[None, :]
    stored = (heads < stored_heads)[:, None] & valid_j[None, :]
    line = cache_row * n_kv * D + tile
    k1 = tl.load(k_ptr + tok * stride_k + tile, mask=valid, other=0.0)
    k2 = tl.load(k_ptr + tok * stride_k + HALF + tile, mask=valid, other=0.0)
    k1, k2 = _norm_rope(k1, k2, k_w_ptr, cos, sin, offs_j, valid_j, eps, D, HALF, K_NORM, dtype)
    tl.store(k_cache_ptr + line, k1, mask=stored)
    tl.store(k_cache_ptr + line + HALF, k2, mask=stored)
    v1 = tl.load(v_ptr + tok * stride_v + tile, mask=valid, other=0.0)
    v2 = tl.load(v_ptr + tok * stride_v + HALF + tile, mask=valid, other=0.0)
    tl.store(v_cache_ptr + line, v1, mask=stored)
    tl.store(v_cache_ptr + line + HALF, v2, mask=stored)

    if HAS_Q:
        heads = tl.arange(0, BLOCK_QH)
        tile = heads[:, None] * D + offs_j[None, :]
        valid = (heads < n_q)[:, None] & valid_j[None, :]
        q1 = tl.load(q_ptr + tok * stride_q + tile, mask=valid, other=0.0)
        q2 = tl.load(q_ptr + tok * stride_q + HALF + tile, mask=valid, other=0.0)
        q1, q2 = _norm_rope(q1, q2, q_w_ptr, cos, sin, offs_j, valid_j, eps, D, HALF, Q_NORM, dtype)
        out = q_out_ptr + tok * n_q * D + tile
        tl.store(out, q1, mask=valid)
        tl.store(out + HALF, q2, mask=valid)


def qk_norm_rope_store(q, k, v, positions, cache_positions, slot_ids, cos_sin, k_cache, v_cache, q_norm_weight,
                       k_norm_weight, eps, block_table=None):
    num_slots, max_len, block_size = _line_shape(k_cache, block_table)
    n_kv, d = k_cache.shape[2:]
    n = k.shape[0]
    n_q = q.shape[1] if q is not None else 0
    q_out = torch.empty((n, n_q, d), dtype=k.dtype, device=k.device) if q is not None else None
    if n:
        half = d // 2
        block_half = triton.next_power_of_2(half)
        block_qh = triton.next_power_of_2(max(n_q, 1))
        block_kh = triton.next_power_of_2(n_kv)
        _qk_norm_rope_store_kernel[(n,)](
            q if q is not None else k, k, v, positions, cache_positions, slot_ids, cos_sin, k_cache, v_cache,
            q_out if q is not None else k,
            q_norm_weight if q_norm_weight is not None else k_cache,
            k_norm_weight if k_norm_weight is not None else k_cache,
            block_table if block_table is not None else slot_ids,
            q.stride(0) if q is not None else 0, k.stride(0), v.stride(0), n_q, n_kv,
            num_slots, max_len, cos_sin.shape[0], block_size, eps, D=d, HALF=half, BLOCK_HALF=block_half,
            BLOCK_QH=block_qh, BLOCK_KH=block_kh, HAS_Q=q is not None,
            Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None, PAGED=block_table is not None,
            num_warps=_warps(2 * block_half * max(block_qh, block_kh)))
    return q_out


# ---------------------------------------------------------------------------------- attention


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` accumulated in f32: tensor cores for f16/bf16, exact products for f32 (not tf32)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_probabilities(p, v, INTERPRET: tl.constexpr):
    """``p @ v`` with the f32 probabilities ``p`` rounded to ``v``'s dtype first."""
    if INTERPRET:
        return _dot(_rounded(p, v.dtype), v, INTERPRET)
    else:
        return _dot(p.to(v.dtype), v, INTERPRET)


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ctx_ptr, cu_ptr, window_ptr, tree_ptr, table_ptr,
                      out_ptr, part_out_ptr, part_lse_ptr, stride_q, n_rows, num_slots, max_len, block_size, n_kv,
                      q_blocks, qk_scale, sliding_window, REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr,
                      PAGED: tl.constexpr, INTERPRET: tl.constexpr):
    """One (request ``b``, query block, KV head, key split); ``qk_scale`` includes ``log2(e)``."""
    b = tl.program_id(0) // q_blocks
    t0 = (tl.program_id(0) % q_blocks) * BLOCK_T
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_row = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), n_rows)
    count = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), first_row), n_rows) - first_row
    if t0 >= count:
        return
    ctx = tl.load(ctx_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # keys of this query block: [start, end), clipped to the slot's cache line
    if CAUSAL:
        end = ctx + tl.minimum(count, t0 + BLOCK_T)
    else:
        end = ctx + count
    end = tl.where((slot >= 0) & (slot < num_slots) & (ctx >= 0), tl.minimum(end, max_len), 0)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(tl.load(window_ptr + b), 0)
    if SLIDING:  # the block's first query sees no key at or before its position - W
        start = tl.maximum(start, ctx + t0 - sliding_window + 1)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(end - start, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, end)

    offs_m = tl.arange(0, BLOCK_M)
    t = t0 + offs_m // REP
    head = kv_head * REP + offs_m % REP
    valid_m = (offs_m < BLOCK_T * REP) & (t < count)
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < D
    rows = (first_row + t).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q + head[:, None] * D + offs_d[None, :],
                mask=valid_m[:, None] & valid_d[None, :], other=0.0)
    query_pos = ctx + t
    if TREE:  # per query: bit j set = the request's new key j (an ancestor or itself) is visible
        bits = tl.load(tree_ptr + rows, mask=valid_m, other=0)
    key_stride = n_kv * D
    line = (slot * max_len * n_kv + kv_head) * D
    blocks_per_line = max_len // block_size

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        valid_n = keys < hi
        if PAGED:  # each key's row in its block (keys past the line's end read entry 0, masked)
            block = tl.load(table_ptr + slot * blocks_per_line + keys // block_size, mask=valid_n, other=0)
            cache_rows = block.to(tl.int64) * block_size + keys % block_size
            kv_offs = (cache_rows[:, None] * n_kv + kv_head) * D + offs_d[None, :]
        else:
            kv_offs = line + keys[:, None].to(tl.int64) * key_stride + offs_d[None, :]
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), INTERPRET) * qk_scale
        visible = valid_n[None, :]
        if TREE:
            rel = keys[None, :] - ctx
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            visible = visible & ((rel < 0) | (((bits[:, None] >> shift) & 1) != 0))
        elif CAUSAL:
            visible = visible & (keys[None, :] <= query_pos[:, None])
        if SLIDING:
            visible = visible & (keys[None, :] > query_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot_probabilities(p, v, INTERPRET)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key gives 0
    row_head = rows * (n_kv * REP) + head
    mask = valid_m[:, None] & valid_d[None, :]
    if SPLITS == 1:
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + row_head[:, None] * D + offs_d[None, :], _rounded(out, dtype).to(dtype), mask=mask)
    else:
        part = row_head * SPLITS + split
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], out, mask=mask)
        lse = m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0))
        tl.store(part_lse_ptr + part, tl.where(l_i > 0, lse, float("-inf")), mask=valid_m)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (row, query head): the splits' partial outputs weighted by their share of the softmax."""
    row_head = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    valid_s = offs_s < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < D
    part = row_head * SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=valid_s, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(part_out_ptr + part[:, None] * D + offs_d[None, :], mask=valid_s[:, None] & valid_d[None, :],
                    other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row_head * D + offs_d, _rounded(out, dtype).to(dtype), mask=valid_d)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small, so that small test shapes exercise both split paths


def _attention_config(device, dtype, batch: int, n_kv: int, rep: int, d: int, max_len: int,
                      max_query_len: int) -> dict:
    """Tile sizes and split count, from shapes only (a CUDA graph replays them for any lengths)."""
    key_bytes = d * dtype.itemsize
    block_n = (64 if key_bytes <= 256 else 32) if device.type == "cuda" else 16  # K/V tiles of 16 KB
    rows_cap = 128 if max_query_len * rep > 64 else 64  # prefill: taller tiles
    block_t = min(triton.next_power_of_2(max_query_len), max(1, rows_cap // triton.next_power_of_2(rep)))
    block_m = max(16, triton.next_power_of_2(block_t * rep))  # tl.dot needs >= 16 rows
    q_blocks = triton.cdiv(max_query_len, block_t)
    programs, sms = batch * q_blocks * n_kv, _sm_count(device)
    # split the keys only when the batch leaves SMs idle; then aim at two programs per SM. Prompt
    # tiles never split: their query blocks fill the SMs for any long prompt, and a split count that
    # followed the number of prompts in a step would compile a kernel per count while serving.
    splits = 1 if programs >= sms or rows_cap == 128 else \
        min(_MAX_SPLITS, triton.cdiv(2 * sms, programs), triton.cdiv(max_len, block_n))
    return dict(BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
                SPLITS=max(1, splits), q_blocks=q_blocks, num_warps=8 if block_m >= 128 else 4)


def _line_shape(k_cache: torch.Tensor, block_table) -> tuple[int, int, int]:
    """``(num_slots, max_len, block_size)`` of a contiguous cache (one block per line) or a paged one."""
    if block_table is None:
        return k_cache.shape[0], k_cache.shape[1], k_cache.shape[1]
    return block_table.shape[0], block_table.shape[1] * k_cache.shape[1], k_cache.shape[1]


def cached_attention(q, k_cache, v_cache, slot_ids, context_lens, cu_query_lens, max_query_len, causal,
                     window_starts, sliding_window, tree_mask, scale, block_table=None):
    n, n_q, d = q.shape
    num_slots, max_len, block_size = _line_shape(k_cache, block_table)
    n_kv = k_cache.shape[2]
    batch = slot_ids.shape[0]
    out = torch.empty((n, n_q, d), dtype=q.dtype, device=q.device)
    if n == 0 or batch == 0 or max_query_len == 0:
        return out
    rep = n_q // n_kv
    cfg = _attention_config(q.device, q.dtype, batch, n_kv, rep, d, max_len, max_query_len)
    splits, q_blocks = cfg.pop("SPLITS"), cfg.pop("q_blocks")
    num_warps = cfg.pop("num_warps")
    if splits > 1:  # partials of the split-K pass: [N, n_q, splits, d] and their log2-sum-exp
        part_out = torch.empty((n, n_q, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, n_q, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    _attention_kernel[(batch * q_blocks, n_kv, splits)](
        q, k_cache, v_cache, slot_ids, context_lens, cu_query_lens,
        window_starts if window_starts is not None else context_lens,
        tree_mask if tree_mask is not None else context_lens, block_table if block_table is not None else slot_ids,
        out, part_out, part_lse, q.stride(0), n, num_slots, max_len, block_size, n_kv, q_blocks, scale * _LOG2E,
        sliding_window or 0, REP=rep, D=d, SPLITS=splits, CAUSAL=causal, HAS_WINDOW=window_starts is not None,
        SLIDING=sliding_window is not None, TREE=tree_mask is not None, PAGED=block_table is not None,
        INTERPRET=_INTERPRET, num_warps=num_warps, **cfg)
    if splits > 1:
        _combine_kernel[(n * n_q,)](part_out, part_lse, out, D=d, BLOCK_D=cfg["BLOCK_D"], SPLITS=splits,
                                    BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return out


# ------------------------------------------------------------------------------------- SwiGLU


_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=valid, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * inter + offs, _rounded(gate / (1.0 + tl.exp(-gate)) * up, dtype).to(dtype), mask=valid)


def silu_and_mul(x):
    n, width = x.shape
    inter = width // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n and inter:
        block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](x, out, inter, BLOCK=block, num_warps=_warps(block))
    return out
