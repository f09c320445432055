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


def qk_norm_rope_store(q, k, v, positions, slot_ids, cos_sin, k_cache, v_cache, q_norm_weight, k_norm_weight, eps):
    table = cos_sin[positions.long()]                                   # [N, 2, d/2]
    cos = torch.cat([table[:, 0], table[:, 0]], dim=-1).to(k.dtype)[:, None, :]
    sin = torch.cat([table[:, 1], table[:, 1]], dim=-1).to(k.dtype)[:, None, :]
    if k_norm_weight is not None:
        k = _norm(k, k_norm_weight, eps)
    slots, rows = slot_ids.long(), positions.long()
    k_cache[slots, rows] = _rope(k, cos, sin)
    v_cache[slots, rows] = v
    if q is None:
        return None
    if q_norm_weight is not None:
        q = _norm(q, q_norm_weight, eps)
    return _rope(q, cos, sin)


def cached_attention(q, k_cache, v_cache, slot_ids, context_lens, cu_query_lens, max_query_len, causal,
                     window_starts, scale):
    out = torch.zeros_like(q)
    n_q, n_kv = q.shape[1], k_cache.shape[2]
    for b in range(slot_ids.shape[0]):
        lo, hi = int(cu_query_lens[b]), int(cu_query_lens[b + 1])
        if hi == lo:
            continue
        ctx, slot = int(context_lens[b]), int(slot_ids[b])
        start = 0 if window_starts is None else max(0, int(window_starts[b]))
        keys = torch.arange(start, ctx + hi - lo, device=q.device)
        query_pos = ctx + torch.arange(hi - lo, device=q.device)
        visible = keys[None, :] <= query_pos[:, None] if causal else torch.ones(
            hi - lo, keys.numel(), dtype=torch.bool, device=q.device)
        k = k_cache[slot, start:ctx + hi - lo].transpose(0, 1).float()     # [n_kv, keys, d]
        v = v_cache[slot, start:ctx + hi - lo].transpose(0, 1).float()
        k = k.repeat_interleave(n_q // n_kv, dim=0)
        v = v.repeat_interleave(n_q // n_kv, dim=0)
        attn = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1).float(), k, v, attn_mask=visible, scale=scale)
        out[lo:hi] = attn.transpose(0, 1).to(q.dtype)
    return out


def silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
