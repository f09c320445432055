"""Transformer-layer family: the few fused ops a decoder step needs besides GEMMs.

Used by the engine's target runner and by the batched draft forward. Every op works on *flat*
tokens: the tokens of many requests are the rows of one ``[N, ...]`` tensor, request ``b`` owning
rows ``cu_query_lens[b] .. cu_query_lens[b+1]-1``. A request reads and writes one cache *line* of
``max_len`` positions, named by its slot id; rolling back to an accepted prefix is only a length
change. The lines are either contiguous (``[num_slots, max_len, n_kv, d]`` per layer) or paged: with
a ``block_table`` int32 ``[num_slots, blocks_per_line]`` the cache is ``[num_blocks, block_size, n_kv,
d]`` and position ``p`` of line ``s`` lives at block ``block_table[s, p // block_size]``, row ``p %
block_size`` -- lines of ``blocks_per_line * block_size`` positions whose blocks requests may share
(prefix caching) and that need no memory reserved per slot.

* ``rms_norm(x, weight, eps, residual=None)`` -- (fused residual add +) RMSNorm, HF op order;
* ``qk_norm_rope_store(q, k, v, ...)`` -- optional per-head q/k RMSNorm, RoPE from a cos/sin table,
  K/V written into the cache at each token's (slot, position);
* ``cached_attention(q, k_cache, v_cache, ...)`` -- each request's queries over its own cache line:
  context keys before the request's first query position, then its own new keys (causal or
  bidirectional), optionally only keys at or after a per-request window start;
* ``silu_and_mul(x)`` -- SwiGLU activation of a merged gate/up projection.

With a gradient to carry, ``rms_norm``, ``qk_norm_rope_store`` and ``silu_and_mul`` run their PyTorch
reference, which autograd differentiates (training runs the engine's draft forward, ``model.draft_runner``).

Values are not checked on CUDA tensors (that would need a host sync and break CUDA-graph capture):
slot ids, positions and lengths there must come from the engine, which owns them.
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._validate import HALF_DTYPES, Checker

__all__ = ["rms_norm", "qk_norm_rope_store", "cached_attention", "silu_and_mul", "rope_cos_sin_table"]

_FLOAT = (torch.float32,) + HALF_DTYPES
_INDEX = (torch.int32, torch.int64)


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm of ``x`` (``[N, H]`` f32/f16/bf16), optionally after adding ``residual`` (same shape).

    Hugging Face's op order: ``s = x + residual`` in ``x.dtype``; ``y = weight * (s.float() *
    rsqrt(mean(s.float()^2) + eps)).to(x.dtype)``. Returns ``y``, or ``(y, s)`` when ``residual`` is
    given (``s`` is the next residual). ``weight`` ``[H]`` in ``x.dtype``.
    """
    c = Checker("rms_norm")
    x = c.tensor("x", x, dtype=_FLOAT, ndim=2)
    weight = c.tensor("weight", weight, dtype=x.dtype, shape=[x.shape[1]], device=x.device)
    eps = c.real("eps", eps, low=0.0)
    if residual is not None:
        c.tensor("residual", residual, dtype=x.dtype, shape=list(x.shape), device=x.device)
        residual = residual.contiguous()
    return implementation("rms_norm", x.device, x, weight, residual)(x.contiguous(), weight.contiguous(), eps, residual)


def rope_cos_sin_table(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> torch.Tensor:
    """f32 ``[max_positions, 2, d/2]`` cos/sin of ``position * inv_freq`` (times ``attention_scaling``),
    the table ``qk_norm_rope_store`` reads; ``inv_freq`` f32 ``[d/2]`` (any RoPE variant's frequencies,
    e.g. from transformers' ``ROPE_INIT_FUNCTIONS``)."""
    c = Checker("rope_cos_sin_table")
    inv_freq = c.tensor("inv_freq", inv_freq, dtype=torch.float32, ndim=1)
    max_positions = c.integer("max_positions", max_positions, low=1)
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.stack([freqs.cos(), freqs.sin()], dim=1) * attention_scaling


def qk_norm_rope_store(q, k, v, positions, slot_ids, cos_sin, k_cache, v_cache, *, q_norm_weight=None,
                       k_norm_weight=None, eps: float = 1e-6, cache_positions=None, block_table=None):
    """Normalise and rotate queries and keys, store keys and values into the cache.

    ``q`` ``[N, n_q, d]`` or None (context-only tokens), ``k``/``v`` ``[N, n_kv, d]`` (views of a
    merged QKV projection are fine: rows may be strided, heads and ``d`` must be dense), all in the
    cache dtype. ``positions`` int ``[N]`` absolute positions (RoPE angle and cache row);
    ``slot_ids`` int ``[N]`` the cache line of each token; ``cos_sin`` f32 ``[max_pos, 2, d/2]`` from
    ``rope_cos_sin_table``. ``k_cache``/``v_cache`` ``[num_slots, max_len, n_kv, d]``.
    ``q_norm_weight``/``k_norm_weight`` ``[d]`` (Qwen3) apply a per-head RMSNorm (HF order) before
    RoPE; None skips it (Llama). RoPE is Hugging Face's ``rotate_half`` convention with cos/sin cast
    to the cache dtype first. Writes ``k_cache[slot, pos] = rope(norm(k))``, ``v_cache[slot, pos] = v``;
    returns the rotated queries ``[N, n_q, d]`` (None when ``q`` is None). ``cache_positions`` int
    ``[N]`` (default: ``positions``) puts a token's K/V at another cache row than its RoPE position
    (tree nodes: row base + node index, angle base + depth). ``block_table`` int32 ``[num_slots,
    blocks_per_line]``: the caches are paged (``[num_blocks, block_size, n_kv, d]``, module docstring).
    """
    c = Checker("qk_norm_rope_store")
    k_cache = c.tensor("k_cache", k_cache, dtype=_FLOAT, ndim=4, contiguous=True)
    num_slots, max_len, block_table = _lines(c, k_cache, block_table)
    n_kv, d = k_cache.shape[2:]
    dtype, device = k_cache.dtype, k_cache.device
    c.tensor("v_cache", v_cache, dtype=dtype, shape=list(k_cache.shape), device=device, contiguous=True)
    k = _heads(c, "k", k, n_kv, d, dtype, device)
    n = k.shape[0]
    v = _heads(c, "v", v, n_kv, d, dtype, device, rows=n)
    if q is not None:
        q = _heads(c, "q", q, None, d, dtype, device, rows=n)
        if q.shape[1] % n_kv:
            c.fail(f"q's {q.shape[1]} heads must be a multiple of the cache's {n_kv} KV heads")
    if d % 2:
        c.fail(f"the head dimension must be even for RoPE, got {d}")
    positions = c.tensor("positions", positions, dtype=_INDEX, shape=[n], device=device)
    slot_ids = c.tensor("slot_ids", slot_ids, dtype=_INDEX, shape=[n], device=device)
    cos_sin = c.tensor("cos_sin", cos_sin, dtype=torch.float32, ndim=3, device=device)
    if cos_sin.shape[1:] != (2, d // 2):
        c.fail(f"cos_sin must have shape [max_pos, 2, {d // 2}], got {list(cos_sin.shape)}")
    if cache_positions is None:
        _in_range(c, "positions", positions, min(max_len, cos_sin.shape[0]))
        cache_positions = positions
    else:
        _in_range(c, "positions", positions, cos_sin.shape[0])
        cache_positions = c.tensor("cache_positions", cache_positions, dtype=_INDEX, shape=[n], device=device)
        _in_range(c, "cache_positions", cache_positions, max_len)
    _in_range(c, "slot_ids", slot_ids, num_slots)
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            c.tensor(name, w, dtype=dtype, shape=[d], device=device)
    eps = c.real("eps", eps, low=0.0)
    return implementation("qk_norm_rope_store", device, q, k, v, q_norm_weight, k_norm_weight)(
        q, k, v, positions.contiguous(), cache_positions.contiguous(), slot_ids.contiguous(), cos_sin.contiguous(),
        k_cache, v_cache, q_norm_weight, k_norm_weight, eps, block_table)


def cached_attention(q, k_cache, v_cache, slot_ids, context_lens, cu_query_lens, max_query_len: int, *,
                     causal: bool, window_starts=None, sliding_window: int | None = None, tree_mask=None,
                     scale: float | None = None, block_table=None):
    """Attention of each request's new queries over its cache line; returns ``[N, n_q, d]`` (q's dtype).

    ``q`` ``[N, n_q, d]``: request ``b``'s queries are rows ``cu_query_lens[b] ..
    cu_query_lens[b+1]-1`` (int ``[B+1]``, non-decreasing, last = N), at positions
    ``context_lens[b] + t``; ``max_query_len`` >= every request's query count (a Python int: it
    sizes the launch). Their keys/values are already in ``k_cache``/``v_cache``
    ``[num_slots, max_len, n_kv, d]`` at line ``slot_ids[b]``: positions ``< context_lens[b]`` are
    context (all visible), positions ``context_lens[b] + t'`` are the request's own new tokens,
    visible when ``t' <= t`` (``causal``) or always (bidirectional). With ``window_starts`` (int
    ``[B]``) keys before ``window_starts[b]`` are hidden. With ``sliding_window`` W (an int >= 1) each
    query sees only the keys of the last W positions up to its own (Hugging Face's sliding window:
    key ``k`` is visible to the query at position ``p`` iff ``p - W < k``). GQA: query head ``h`` reads KV head
    ``h // (n_q / n_kv)``. Softmax in f32; ``scale`` defaults to ``d ** -0.5``. A request with no
    queries is skipped. ``tree_mask`` int64 ``[N]`` (with ``causal``; tree verification, at most 64
    new tokens per request): of a request's own new tokens, query ``t`` sees ``t'`` only when bit
    ``t'`` of its mask is set (its ancestors and itself); context positions stay visible.
    ``block_table`` int32 ``[num_slots, blocks_per_line]``: the caches are paged (``[num_blocks,
    block_size, n_kv, d]``, module docstring).
    """
    c = Checker("cached_attention")
    k_cache = c.tensor("k_cache", k_cache, dtype=_FLOAT, ndim=4, contiguous=True)
    num_slots, max_len, block_table = _lines(c, k_cache, block_table)
    n_kv, d = k_cache.shape[2:]
    device = k_cache.device
    c.tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=list(k_cache.shape), device=device, contiguous=True)
    q = _heads(c, "q", q, None, d, k_cache.dtype, device)
    if q.shape[1] % n_kv:
        c.fail(f"q's {q.shape[1]} heads must be a multiple of the cache's {n_kv} KV heads")
    slot_ids = c.tensor("slot_ids", slot_ids, dtype=_INDEX, ndim=1, device=device)
    batch = slot_ids.shape[0]
    context_lens = c.tensor("context_lens", context_lens, dtype=_INDEX, shape=[batch], device=device)
    cu_query_lens = c.tensor("cu_query_lens", cu_query_lens, dtype=_INDEX, shape=[batch + 1], device=device)
    max_query_len = c.integer("max_query_len", max_query_len, low=0)
    if window_starts is not None:
        window_starts = c.tensor("window_starts", window_starts, dtype=_INDEX, shape=[batch], device=device)
        window_starts = window_starts.contiguous()
    if not isinstance(causal, bool):
        c.fail(f"causal must be a bool, got {type(causal).__name__}", TypeError)
    if sliding_window is not None:
        sliding_window = c.integer("sliding_window", sliding_window, low=1)
    if tree_mask is not None:
        if not causal or sliding_window is not None or max_query_len > 64:
            c.fail(f"tree_mask needs causal attention without a sliding window and at most 64 new tokens per "
                   f"request (causal={causal}, sliding_window={sliding_window}, max_query_len={max_query_len})")
        tree_mask = c.tensor("tree_mask", tree_mask, dtype=torch.int64, shape=[q.shape[0]], device=device).contiguous()
    scale = d ** -0.5 if scale is None else c.real("scale", scale, low=0.0)
    if device.type == "cpu":
        _check_layout(c, q.shape[0], slot_ids, context_lens, cu_query_lens, max_query_len, num_slots, max_len)
    return implementation("cached_attention", device)(
        q, k_cache, v_cache, slot_ids.contiguous(), context_lens.contiguous(), cu_query_lens.contiguous(),
        max_query_len, causal, window_starts, sliding_window, tree_mask, scale, block_table)


def silu_and_mul(x):
    """SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[N, 2I]`` (merged gate/up
    projection) -> ``[N, I]`` in ``x.dtype`` (computed in f32, rounded once)."""
    c = Checker("silu_and_mul")
    x = c.tensor("x", x, dtype=_FLOAT, ndim=2)
    if x.shape[1] % 2:
        c.fail(f"x must have an even number of columns (gate and up halves), got {x.shape[1]}")
    return implementation("silu_and_mul", x.device, x)(x.contiguous())


# ---------------------------------------------------------------------------------------- helpers


def _lines(c: Checker, k_cache: torch.Tensor, block_table) -> tuple[int, int, torch.Tensor | None]:
    """``(num_slots, max_len, block_table)`` of a contiguous cache ``[num_slots, max_len, ...]`` or of
    a paged one (``block_table`` int32 ``[num_slots, blocks_per_line]`` of blocks ``[num_blocks,
    block_size, ...]``; its block ids are checked on CPU tensors only)."""
    if block_table is None:
        return k_cache.shape[0], k_cache.shape[1], None
    block_table = c.tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=k_cache.device).contiguous()
    _in_range(c, "block_table", block_table, k_cache.shape[0])
    return block_table.shape[0], block_table.shape[1] * k_cache.shape[1], block_table


def _heads(c: Checker, name, t, heads, d, dtype, device, rows=None) -> torch.Tensor:
    """``[N, heads, d]`` with dense heads (row stride free), in the cache dtype."""
    c.tensor(name, t, dtype=dtype, ndim=3, device=device)
    if t.shape[2] != d or heads is not None and t.shape[1] != heads:
        want = f"[*, {'*' if heads is None else heads}, {d}]"
        c.fail(f"{name} must have shape {want} (the cache's KV heads and head dim), got {list(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        c.fail(f"{name} must have {rows} rows like k, got {t.shape[0]}")
    if t.stride(2) != 1 or t.stride(1) != d:
        t = t.contiguous()
    return t


def _in_range(c: Checker, name: str, t: torch.Tensor, high: int) -> None:
    if t.device.type == "cpu" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= high:
            c.fail(f"{name} holds {lo if lo < 0 else hi}, outside [0, {high})")


def _check_layout(c, n, slot_ids, context_lens, cu_query_lens, max_query_len, num_slots, max_len) -> None:
    """The batch layout is consistent (CPU tensors only; see the module docstring)."""
    _in_range(c, "slot_ids", slot_ids, num_slots)
    counts = cu_query_lens[1:] - cu_query_lens[:-1]
    if int(cu_query_lens[0]) != 0 or int(cu_query_lens[-1]) != n or bool((counts < 0).any()):
        c.fail(f"cu_query_lens must rise from 0 to the {n} query rows, got {cu_query_lens.tolist()}")
    if counts.numel() and int(counts.max()) > max_query_len:
        c.fail(f"max_query_len {max_query_len} is below a request's {int(counts.max())} queries")
    ends = context_lens + counts
    if bool((context_lens < 0).any()) or ends.numel() and int(ends.max()) > max_len:
        c.fail(f"context_lens + queries must lie in [0, {max_len}] (the cache length), got ends {ends.tolist()}")
