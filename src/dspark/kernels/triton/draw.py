"""Triton draw family: SplitMix64 uniforms, inverse-CDF draws (dense rows, the accept's residual and
bonus rows), the per-step stores and the sparse top-k rows (contracts: ``dspark.kernels.sampling``).

NVIDIA draws every token with one thread walking the whole vocabulary row. Here a draw is a parallel
prefix sum: chunk masses over the row, the chunk the threshold falls into, then a block ``cumsum``
inside it. The sums are pairwise, not NVIDIA's sequential fp32 sum, so a uniform within ~1e-6 of a
CDF boundary may get the neighbouring token; otherwise the tokens are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import inv_temperature, next_pow2
from ._shared import NO_HIT, ROW_BLOCK_ENTRIES, TINY, claim, clamp_uniform, first_hit, is_degenerate, positive
from ._shared import row_chunk, tile_stats

__all__ = [
    "fill_uniforms",
    "sample_probability_rows",
    "store_draft_step_probabilities",
    "normalize_top_k_rows",
    "sample_top_k_rows_and_store",
]


# ------------------------------------------------------------------------------ uniforms


@triton.jit(do_not_specialize=["seed", "offset"])  # a seed or offset of 1 would become a constexpr int
def _fill_uniforms_kernel(out_ptr, total, seed, offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    counter = (i + 1).to(tl.uint64)
    x = seed.to(tl.uint64) ^ (offset.to(tl.uint64) + counter * 0xD1B54A32D192ED03)
    x = x + 0x9E3779B97F4A7C15  # SplitMix64; uint64 makes every >> logical and every op wrap mod 2^64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    u = (x >> 40).to(tl.float32) * 5.9604644775390625e-08  # top 24 bits * 2^-24, exact
    tl.store(out_ptr + i, clamp_uniform(u), mask=i < total)


def fill_uniforms(total_elements, philox_seed, philox_offset, device):
    """``dspark.kernels.fill_uniforms``: bit-exact with the reference."""
    out = torch.empty(total_elements, dtype=torch.float32, device=device)
    if total_elements:
        block = 1024
        _fill_uniforms_kernel[(triton.cdiv(total_elements, block),)](out, total_elements, philox_seed, philox_offset,
                                                                      BLOCK=block)
    return out


# ------------------------------------------------------------------------------ inverse-CDF draws


@triton.jit
def _draw_weights(p_ptr, q_ptr, p_off, q_off, index, mask, use_q):
    """The walk's weights of ``[ROWS, N]`` entries, ``max(p - q, 0)`` where ``use_q`` (residual) else
    ``p``, and the plain ``p`` weights (a residual's fallback) from the same load."""
    p = tl.load(p_ptr + p_off[:, None] + index, mask=mask, other=0.0)
    q = tl.load(q_ptr + tl.maximum(q_off, 0)[:, None] + index, mask=mask & use_q[:, None], other=0.0)
    return tl.where(mask, positive(tl.where(use_q[:, None], p - q, p)), 0.0), tl.where(mask, positive(p), 0.0)


@triton.jit
def _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """``(live, p_off, q_off)`` of ``[ROWS]`` draws: offsets from the accept descriptors, or plain rows
    (with ``SEARCHED``, only the rows at state 3, which the filter's select kernel could not draw)."""
    live = rows < n_rows
    if SEARCHED:
        live = live & (tl.load(state_ptr + rows, mask=live, other=0) == 3)
    if DESC:
        p_off = tl.load(desc_ptr + rows * 2, mask=live, other=0)
        q_off = tl.load(desc_ptr + rows * 2 + 1, mask=live, other=-1)
    else:
        p_off = rows.to(tl.int64) * p_stride
        q_off = tl.full(rows.shape, -1, tl.int64)
    return live, p_off, q_off


@triton.jit
def _mass_kernel(p_ptr, q_ptr, n_rows, V, p_stride, desc_ptr, state_ptr, mass_ptr, last_ptr, n_chunks,
                 ROWS: tl.constexpr, CHUNK: tl.constexpr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """Per (``ROWS`` rows, chunk): mass and last positive index of the walk's weights; kind 0 = the
    row's weights (residual where it has a q row), kind 1 = plain p (the residual's fallback)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunk = tl.program_id(1)
    live, p_off, q_off = _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC, SEARCHED)
    index = (chunk * CHUNK + tl.arange(0, CHUNK))[None, :]
    mask = live[:, None] & (index < V)
    slot = rows * 2 * n_chunks + chunk
    w, plain = _draw_weights(p_ptr, q_ptr, p_off, q_off, index, mask, q_off >= 0)
    tl.store(mass_ptr + slot, tl.sum(w, axis=1), mask=live)
    tl.store(last_ptr + slot, tl.max(tl.where(w > 0.0, index, -1), axis=1), mask=live)
    if DESC:
        tl.store(mass_ptr + slot + n_chunks, tl.sum(plain, axis=1), mask=live)
        tl.store(last_ptr + slot + n_chunks, tl.max(tl.where(plain > 0.0, index, -1), axis=1), mask=live)


@triton.jit
def _walk_kernel(p_ptr, q_ptr, n_rows, V, p_stride, desc_ptr, state_ptr, draw_ptr, u_ptr, u_stride, mass_ptr,
                 last_ptr, n_chunks, out_ptr, out_stride, len_ptr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                 NC_PAD: tl.constexpr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """Per ``ROWS`` rows: the chunk where each threshold falls, then a block cumsum inside it.

    With ``DESC`` (probabilistic accept) ``draw[row] = (uniform bits, n)``: the token goes to
    ``out[row, n]`` and ``n + 1`` to ``len[row]``; a residual without mass (``<= 1e-20``) draws from p
    instead, with the unscaled threshold (kernels.md 2.3).
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live, p_off, q_off = _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC, SEARCHED)
    if DESC:
        u = tl.load(draw_ptr + rows * 2, mask=live, other=0).to(tl.float32, bitcast=True)
        n = tl.load(draw_ptr + rows * 2 + 1, mask=live, other=0)
    else:
        u = tl.load(u_ptr + rows.to(tl.int64) * u_stride, mask=live, other=0.0)
        n = tl.zeros([ROWS], tl.int32)
    c = tl.arange(0, NC_PAD)[None, :]
    in_chunks = live[:, None] & (c < n_chunks)
    slot = rows[:, None] * 2 * n_chunks + c
    mass = tl.load(mass_ptr + slot, mask=in_chunks, other=0.0)
    last = tl.load(last_ptr + slot, mask=in_chunks, other=-1)
    t = clamp_uniform(u)
    use_q = q_off >= 0
    if DESC:
        residual_mass = tl.sum(mass, axis=1)
        plain = use_q & (residual_mass <= TINY)
        use_q = use_q & ~plain
        t = tl.where(use_q, t * residual_mass, t)
        mass = tl.where(plain[:, None], tl.load(mass_ptr + slot + n_chunks, mask=in_chunks, other=0.0), mass)
        last = tl.where(plain[:, None], tl.load(last_ptr + slot + n_chunks, mask=in_chunks, other=-1), last)
    incl = tl.cumsum(mass, axis=1)
    owner = tl.min(tl.where((mass > 0.0) & (incl > t[:, None]), c, NC_PAD), axis=1)
    carry = tl.sum(tl.where(c == owner[:, None] - 1, incl, 0.0), axis=1)
    index = owner[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    w, _ = _draw_weights(p_ptr, q_ptr, p_off, q_off, index, live[:, None] & (owner < NC_PAD)[:, None] & (index < V),
                         use_q)
    hit = (w > 0.0) & (carry[:, None] + tl.cumsum(w, axis=1) > t[:, None])
    token = tl.min(tl.where(hit, index, NO_HIT), axis=1)
    # No hit: rounding put t past the owner's sum (its last positive), or past the total (the row's).
    owner_last = tl.sum(tl.where(c == owner[:, None], last, 0), axis=1)
    fallback = tl.where(owner < NC_PAD, owner_last, tl.maximum(tl.max(last, axis=1), 0))
    token = tl.where(token == NO_HIT, fallback, token)
    tl.store(out_ptr + rows.to(tl.int64) * out_stride + n, token, mask=live)
    if DESC:
        tl.store(len_ptr + rows, n + 1, mask=live)


# Launch parameters of the two draw kernels: the entries of a row one program covers (a power of two)
# and the warps of the chunk-mass and walk programs, for plain draws and for accept's residual/bonus
# draws. H200 sweep (``python -m dspark.bench.breakdown --sweep-draws``, docs/bench-sampling.md):
# 2048-entry chunks with 8-warp mass programs; 8-warp walks for plain draws (21.6 µs for 64 rows),
# 4-warp walks for accept (18.9 µs at B = 1; 8 warps: 30.1 µs).
DRAW_LAUNCH = {"chunk": 2048, "mass_warps": 8, "walk_warps": 8, "accept_walk_warps": 4}


def plan(rows: int, vocab: int) -> dict:
    """Scratch of ``draw_rows``: per (row, kind, chunk) the walk's mass and last positive index."""
    n_chunks = triton.cdiv(vocab, row_chunk(vocab, DRAW_LAUNCH["chunk"]))
    return {"draw_mass": (rows * 2 * n_chunks, torch.float32), "draw_last": (rows * 2 * n_chunks, torch.int32)}


def draw_rows(p, rows, vocab, out, out_stride, workspace, *, p_stride=0, u=None, u_stride=0, q=None, desc=None,
              draw=None, lengths=None, searched=None):
    """Inverse-CDF draws over ``rows`` rows (two launches, no serial O(V) loop).

    Plain rows: row ``r`` of ``p`` (row stride ``p_stride``) with uniform ``u[r * u_stride]``, token to
    ``out[r * out_stride]``. Accept mode (``desc``/``draw``/``lengths``, written by the accept kernel):
    ``desc[r] = (p offset, q offset or -1)``, ``draw[r] = (u bits, n)``. ``searched``: the filter's
    row states; only rows at state 3 are drawn. Small vocabularies put several rows in one program.
    """
    chunk = row_chunk(vocab, DRAW_LAUNCH["chunk"])
    n_chunks = triton.cdiv(vocab, chunk)
    per_program = max(1, ROW_BLOCK_ENTRIES // (chunk * next_pow2(n_chunks)))
    with_desc = desc is not None
    buf = claim(workspace, plan(rows, vocab), p.device)
    mass, last = buf["draw_mass"], buf["draw_last"]
    q = p if q is None else q
    desc = mass if desc is None else desc
    draw = mass if draw is None else draw
    u = mass if u is None else u
    lengths = last if lengths is None else lengths
    state = last if searched is None else searched
    grid = triton.cdiv(rows, per_program)
    _mass_kernel[(grid, n_chunks)](p, q, rows, vocab, p_stride, desc, state, mass, last, n_chunks, ROWS=per_program,
                                   CHUNK=chunk, DESC=with_desc, SEARCHED=searched is not None,
                                   num_warps=DRAW_LAUNCH["mass_warps"])
    _walk_kernel[(grid,)](p, q, rows, vocab, p_stride, desc, state, draw, u, u_stride, mass, last, n_chunks, out,
                          out_stride, lengths, ROWS=per_program, CHUNK=chunk, NC_PAD=next_pow2(n_chunks),
                          DESC=with_desc, SEARCHED=searched is not None,
                          num_warps=DRAW_LAUNCH["accept_walk_warps" if with_desc else "walk_warps"])


def sample_probability_rows(probability_scratch, proposal_uniforms, draft_token_ids, step, workspace):
    """``dspark.kernels.sample_probability_rows``."""
    rows, vocab = probability_scratch.shape
    width = draft_token_ids.shape[1]
    if rows:
        draw_rows(probability_scratch, rows, vocab, draft_token_ids[:, step], width, workspace, p_stride=vocab,
                  u=proposal_uniforms[:, step], u_stride=width)


# ------------------------------------------------------------------------------ stores and sparse rows


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, V, dst_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = index < V
    values = tl.load(src_ptr + row.to(tl.int64) * V + index, mask=mask)
    tl.store(dst_ptr + row.to(tl.int64) * dst_stride + index, values, mask=mask)


def store_draft_step_probabilities(probability_scratch, draft_probabilities, step):
    """``dspark.kernels.store_draft_step_probabilities``: a row copy."""
    rows, vocab = probability_scratch.shape
    if rows:
        block = 4096
        _copy_rows_kernel[(rows, triton.cdiv(vocab, block))](probability_scratch, draft_probabilities[:, step], vocab,
                                                             draft_probabilities.shape[1] * vocab, BLOCK=block)


@triton.jit
def _merge_stats(m, s, tile_m, tile_s):
    """Online-softmax merge of two ``(max, sum exp(x - max))`` partials."""
    big = tl.maximum(m, tile_m)
    base = tl.where(big > float("-inf"), big, 0.0)
    return big, s * tl.exp(m - base) + tile_s * tl.exp(tile_m - base)


@triton.jit
def _top_k_rows_kernel(values_ptr, K, inv_temp, probs_ptr, probs_stride, ids_ptr, ids_out_ptr, u_ptr, u_stride,
                       tok_ptr, tok_stride, BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
    """Per row: softmax of ``values * inv_temp`` over K (``1/K`` when degenerate) into ``probs``; with
    ``SAMPLE`` also copy the ids and draw one of them (kernels.md 2.4, 3.20, 3.22)."""
    row = tl.program_id(0).to(tl.int64)
    src = values_ptr + row * K
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    start = 0
    while start < K:
        index = start + tl.arange(0, BLOCK)
        tile_m, tile_s = tile_stats(tl.load(src + index, mask=index < K, other=float("-inf")) * inv_temp, 0)
        m, s = _merge_stats(m, s, tile_m, tile_s)
        start += BLOCK
    degenerate = is_degenerate(s)
    if SAMPLE:
        t = clamp_uniform(tl.load(u_ptr + row * u_stride))
    carry = tl.zeros([], tl.float32)
    hit = tl.full([], NO_HIT, tl.int32)
    last = tl.full([], -1, tl.int32)
    start = 0
    while start < K:
        index = start + tl.arange(0, BLOCK)
        mask = index < K
        x = tl.load(src + index, mask=mask, other=float("-inf")) * inv_temp
        p = tl.where(degenerate, 1.0 / K, tl.exp(x - m) / tl.maximum(s, TINY))
        tl.store(probs_ptr + row * probs_stride + index, p, mask=mask)
        if SAMPLE:
            tl.store(ids_out_ptr + row * probs_stride + index, tl.load(ids_ptr + row * K + index, mask=mask), mask=mask)
            w = tl.where(mask, positive(p), 0.0)
            hit = tl.minimum(hit, first_hit(w, index, carry, t))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, index, -1), axis=0))
            carry += tl.sum(w, axis=0)
        start += BLOCK
    if SAMPLE:
        k = tl.where(hit == NO_HIT, tl.maximum(last, 0), hit)  # fallback: last positive, else ids[0]
        tl.store(tok_ptr + row * tok_stride, tl.load(ids_ptr + row * K + k))


def _top_k_rows(values, temperature, probs, probs_stride, sample=None):
    rows, k = values.shape
    if not rows:
        return
    ids, ids_out, u, u_stride, tok, tok_stride = sample if sample is not None else (values, probs, values, 0, probs, 0)
    _top_k_rows_kernel[(rows,)](values, k, inv_temperature(temperature), probs, probs_stride, ids, ids_out, u,
                                u_stride, tok, tok_stride, BLOCK=min(1024, next_pow2(k)), SAMPLE=sample is not None,
                                num_warps=4)


def normalize_top_k_rows(top_k_values, temperature):
    """``dspark.kernels.normalize_top_k_rows``: one program per row."""
    probs = torch.empty_like(top_k_values)
    _top_k_rows(top_k_values, temperature, probs, top_k_values.shape[1])
    return probs


def sample_top_k_rows_and_store(top_k_values, top_k_indices, proposal_uniforms, draft_token_ids,
                                draft_top_k_probabilities, draft_top_k_indices, step, temperature):
    """``dspark.kernels.sample_top_k_rows_and_store``: normalise, store and draw in one program per row."""
    width, k = draft_top_k_probabilities.shape[1:]
    _top_k_rows(top_k_values, temperature, draft_top_k_probabilities[:, step], width * k,
                sample=(top_k_indices, draft_top_k_indices[:, step], proposal_uniforms[:, step], width,
                        draft_token_ids[:, step], width))

