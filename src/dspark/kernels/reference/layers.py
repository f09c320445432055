"""Reference transformer-layer ops (contracts: ``dspark.kernels.layers``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "qk_norm_rope_store", "cached_attention", "silu_and_mul"]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm(x, weight, eps, residual):
    if residual is None:
        return _norm(x, weight, eps)
    summed = x + residual
    return _norm(summed, weight, eps), summed


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _cache_index(k_cache, block_table, slots: torch.Tensor, rows: torch.Tensor):
    """Index of (line ``slots``, position ``rows``) into a contiguous cache, or into a paged one
    through ``block_table`` (contracts: ``dspark.kernels.layers``)."""
    if block_table is None:
        return slots, rows
    size = k_cache.shape[1]
    return block_table.long()[slots, rows // size], rows % size


def _lines(cache, block_table, slots: torch.Tensor, width: int) -> torch.Tensor:
    """Positions ``0 .. width-1`` of lines ``slots`` int64 ``[B]``: ``[B, width, n_kv, d]``."""
    if block_table is None:
        return cache[slots, :width]
    size = cache.shape[1]
    return cache[block_table.long()[slots, :-(-width // size)]].flatten(1, 2)[:, :width]


def qk_norm_rope_store(q, k, v, positions, cache_positions, slot_ids, cos_sin, k_cache, v_cache, q_norm_weight,
                       k_norm_weight, eps, block_table=None):
    table = cos_sin[positions.long()]                                   # [N, 2, d/2]
    cos = torch.cat([table[:, 0], table[:, 0]], dim=-1).to(k.dtype)[:, None, :]
    sin = torch.cat([table[:, 1], table[:, 1]], dim=-1).to(k.dtype)[:, None, :]
    if k_norm_weight is not None:
        k = _norm(k, k_norm_weight, eps)
    index = _cache_index(k_cache, block_table, slot_ids.long(), cache_positions.long())
    k_cache[index] = _rope(k, cos, sin)
    v_cache[index] = v
    if q is None:
        return None
    if q_norm_weight is not None:
        q = _norm(q, q_norm_weight, eps)
    return _rope(q, cos, sin)


def cached_attention(q, k_cache, v_cache, slot_ids, context_lens, cu_query_lens, max_query_len, causal,
                     window_starts, sliding_window, tree_mask, scale, block_table=None):
    n_q, n_kv = q.shape[1], k_cache.shape[2]
    counts = (cu_query_lens[1:] - cu_query_lens[:-1]).long()
    # requests without queries (padding seats of a step) are dropped: on the CPU the padded layout
    # below costs in proportion to the requests it holds
    asking = (counts > 0).nonzero().flatten()
    if asking.numel() == 0 or q.shape[0] == 0:
        return torch.zeros_like(q)
    if asking.numel() == 1 and window_starts is None and sliding_window is None and tree_mask is None:
        b = int(asking[0])  # a batch-1 decode or verify step, latency-bound on the CPU
        slot, width = slot_ids[b:b + 1].long(), int(context_lens[b]) + q.shape[0]
        return _one_request_attention(q, _lines(k_cache, block_table, slot, width)[0],
                                      _lines(v_cache, block_table, slot, width)[0], int(context_lens[b]), causal, scale)
    slots, ctx, counts = slot_ids.long()[asking], context_lens.long()[asking], counts[asking]
    width = int((ctx + counts).max())
    # queries padded to [B, max_q]: row b, query t sits at flat row cu[b] + t
    t = torch.arange(int(counts.max()), device=q.device)
    valid_q = t[None, :] < counts[:, None]
    flat = (cu_query_lens[:-1].long()[asking][:, None] + t[None, :]).clamp(max=q.shape[0] - 1)
    queries = q[flat].float()                                                # [B, Tq, n_q, d]
    keys = torch.arange(width, device=q.device)
    start = torch.zeros_like(ctx) if window_starts is None else window_starts.long()[asking].clamp(min=0)
    query_pos = ctx[:, None] + t[None, :]                                    # [B, Tq]
    last = query_pos if causal else (ctx + counts)[:, None] - 1
    visible = (keys[None, None, :] >= start[:, None, None]) & (keys[None, None, :] <= last[:, :, None])
    visible = visible & valid_q[:, :, None]
    if sliding_window is not None:
        visible = visible & (keys[None, None, :] > query_pos[:, :, None] - sliding_window)
    if tree_mask is not None:  # new key j visible iff bit j of the query's mask (ancestors and itself)
        rel = keys[None, None, :] - ctx[:, None, None]
        bits = tree_mask.long()[flat][:, :, None]
        ancestor = ((bits >> rel.clamp(0, 63)) & 1) == 1
        visible = visible & ((rel < 0) | ancestor)
    # SDPA (GQA without repeating K/V; f32 math) -- a few fused ops where the step is latency-bound on the CPU
    k = _lines(k_cache, block_table, slots, width).float().transpose(1, 2)   # [B, n_kv, L, d]
    v = _lines(v_cache, block_table, slots, width).float().transpose(1, 2)
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=n_q != n_kv).transpose(1, 2)
    out = out.nan_to_num(0.0)                                                 # a query that sees nothing: 0
    result = torch.zeros_like(q)
    result[flat[valid_q]] = out[valid_q].to(q.dtype)
    return result


def _one_request_attention(q, k_line, v_line, context_len: int, causal: bool, scale: float):
    """``cached_attention`` of one request with no window or tree (a decode or verify step at batch 1):
    its ``N`` queries ``[N, n_q, d]`` over cache line positions ``[0, context_len + N)``
    (``[>= context_len + N, n_kv, d]``), without the padded batch layout -- a CPU step at batch 1 is latency-bound."""
    n, n_q, n_kv = q.shape[0], q.shape[1], k_line.shape[1]
    width = context_len + n
    k, v = (line[:width].float().transpose(0, 1) for line in (k_line, v_line))   # [n_kv, L, d]
    # query t (position context_len + t) sees keys up to its own position: a bottom-right causal mask
    mask = torch.ones(n, width, dtype=torch.bool, device=q.device).tril(context_len) if causal and n > 1 else None
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=n_q != n_kv)
    return out.transpose(0, 1).to(q.dtype).contiguous()


def silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
