"""Triton Markov family: one Markov GEMM kernel for every path (greedy steps, FP8 W2,
correction logits, the fused sampled step), FP8 quantisation, finalize and store.

Contracts: the public functions of ``dspark.kernels.markov`` and ``dspark.kernels.sampling``.

The correction ``c[b, v] = base[b, v] + sum_r W2[v, r] * W1[prev_b, r]`` (kernels.md 3.11) is one
skinny GEMM per step that reads W2 once for the whole batch: programs gather their batch block's
``W1[prev]`` rows and stream ``BLOCK_V``-row tiles of W2 through ``W1[prev] @ W2[tile]^T`` (``tl.dot``
on tensor cores, batch-major, the batch padded to at least 16 rows), optionally persistent (a few programs per
SM looping over tiles) and optionally splitting R into ``BLOCK_R`` chunks. FP8 W2 (uint8 e4m3 codes +
fp16 row scales) is decoded to the weights' dtype inside the GEMM and the row scale applied to the
fp32 dot, so it moves half the bytes. What happens to ``c`` is chosen at compile time (epilogues):

* ``ARGMAX`` -- greedy steps: an elementwise running maximum of packed 64-bit keys (kernels.md 3.14;
  padding lanes hold key 0 and never win), reduced per row at the end and merged with one unsigned
  64-bit ``atomic_max``;
* ``WRITE_ROWS`` -- store the rows (correction logits, stacked rows, the sampled step's logits);
* ``STATS`` -- the sampled step: scale by ``invTemp`` and store each tile's softmax partials, so the
  filter starts without another pass over the row; ``GROUPS`` adds the maxima of every ``GROUP``
  entries (the top-k/top-p candidates' first stage).

``markov_config`` is the one place launch parameters are chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import filter_settings, next_pow2
from . import filter as tfilter
from ._shared import ELEMENTWISE_BLOCK, INTERPRET, SENTINEL, claim, dot, greedy_key, merge, multiprocessors, order_key
from ._shared import orderable, tile_stats, unpack_key

__all__ = [
    "build_markov_logits",
    "markov_greedy_fused_step",
    "quantize_markov_w2_fp8",
    "finalize_greedy_draft_tokens",
    "store_draft_step_top1",
    "markov_sample_step",
]


# ----------------------------------------------------------------------------- the Markov GEMM


@triton.jit
def _w1_block(w1_ptr, prev, valid_b, r0, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """``W1[prev_b, r0:r0+BLOCK_R]^T`` as ``[BLOCK_R, BLOCK_B]`` (zeros past R and for padding rows)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    return tl.load(w1_ptr + prev[None, :] * R + offs_r[:, None], mask=(offs_r < R)[:, None] & valid_b[None, :],
                   other=0.0)


@triton.jit
def _w2_tile(w2_ptr, offs_v, valid_v, r0, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """``W2[offs_v, r0:r0+BLOCK_R]`` as ``[BLOCK_V, BLOCK_R]`` (fp16/bf16, or uint8 codes)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    return tl.load(w2_ptr + offs_v.to(tl.int64)[:, None] * R + offs_r[None, :],
                   mask=valid_v[:, None] & (offs_r < R)[None, :], other=0)


@triton.jit
def _accumulate(w2, w1, acc, FP8: tl.constexpr, INTERPRET_: tl.constexpr):
    """``acc + (W2 tile @ W1 block)^T`` into a batch-major ``[BLOCK_B, BLOCK_V]`` accumulator, FP8
    codes decoded to the weights' dtype first."""
    if FP8:
        w2 = w2.to(tl.float8e4nv, bitcast=True).to(w1.dtype)
    return dot(tl.trans(w1), tl.trans(w2), acc, INTERPRET_)


@triton.jit
def _row_entries(ptr, stride, rows_b, offs_v):
    """Pointers to entries ``(b, v)`` of rows ``rows_b``, batch-major ``[BLOCK_B, BLOCK_V]``."""
    return ptr + rows_b[:, None] * stride + offs_v[None, :]


@triton.jit
def _markov_kernel(
    base_ptr, base_batch_stride,  # fp32 base logit row of (b, step) at base_ptr + b*stride
    w1_ptr, w2_ptr, scales_ptr,  # W1 [V,R]; W2 [V,R] fp16/bf16 or uint8 e4m3 codes + fp16 scales [V]
    prev_ptr, prev_stride,  # previous token of row b: int32 id, or a packed key (PREV_IS_KEY)
    rows_ptr, rows_batch_stride,  # WRITE_ROWS: fp32 rows of c
    key_ptr, key_stride,  # ARGMAX: packed keys, merged with atomic max
    m_ptr, s_ptr, n_tiles,  # STATS: softmax partials [B, n_tiles]
    group_ptr, n_groups,  # GROUPS: int64 filter keys of group maxima [B, n_groups]
    B, V, inv_temp, settings_ptr,  # STATS: c * inv_temp, or each row's inv_temp (ROW_TEMP: settings [B, 3])
    R: tl.constexpr, BLOCK_R: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    PREV_IS_KEY: tl.constexpr, FP8: tl.constexpr,
    ARGMAX: tl.constexpr, WRITE_ROWS: tl.constexpr, STATS: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, NUM_STAGES: tl.constexpr,
    INTERPRET_: tl.constexpr, ROW_TEMP: tl.constexpr,
):
    """``c[b, v]`` over vocabulary tiles ``program_id(0) + i * num_programs(0)``, epilogues as flagged.

    The dot is batch-major (the batch rows are the MMA's rows; the base logits are loaded and the
    rows stored in that orientation, after the dot) and its result is viewed as ``[BLOCK_V,
    BLOCK_B]`` for the epilogues. H200 (docs/kernel-layout.md): as fast or faster than vocabulary-major
    at every benchmarked shape (FP8 W2 up to 1.3x) but the unfiltered sampled round at B = 1, R = 64
    (1.06x); this exact formulation was timed -- the same product written with ``[BLOCK_B, BLOCK_V]``
    epilogues compiled slower.
    Tiles are software-pipelined ``NUM_STAGES`` deep (the R-chunk loop instead, when R is split:
    ``BLOCK_R < R``).
    Keys are kept as an elementwise running max over the tiles (no cross-warp reduction inside the
    loop); one reduction and one atomic max per row and program at the end merge them.
    """
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    valid_b = offs_b < B
    rows_b = offs_b.to(tl.int64)
    prev = tl.load(prev_ptr + rows_b * prev_stride, mask=valid_b, other=0)
    if PREV_IS_KEY:
        prev = unpack_key(prev)
    prev = tl.minimum(tl.maximum(prev.to(tl.int32), 0), V - 1).to(tl.int64)
    if BLOCK_R >= R:  # one chunk covers R: gather W1[prev] once per program
        w1 = _w1_block(w1_ptr, prev, valid_b, 0, R, BLOCK_R)
    if ROW_TEMP:
        temp = tl.load(settings_ptr + rows_b * 3, mask=valid_b, other=1.0)[None, :]
    else:
        temp = inv_temp

    best = tl.zeros([BLOCK_V, BLOCK_B], dtype=tl.uint64)
    for i in tl.range(0, TILES_PER_PROGRAM, num_stages=NUM_STAGES):
        tile = tl.program_id(0) + i * tl.num_programs(0)
        offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        valid_v = offs_v < V
        valid = valid_v[:, None] & valid_b[None, :]
        acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        if BLOCK_R >= R:  # pipelined over tiles
            acc = _accumulate(_w2_tile(w2_ptr, offs_v, valid_v, 0, R, BLOCK_R), w1, acc, FP8, INTERPRET_)
        else:  # R in chunks (pipelined over the chunks)
            for r0 in tl.range(0, R, BLOCK_R, num_stages=NUM_STAGES):
                w1_chunk = _w1_block(w1_ptr, prev, valid_b, r0, R, BLOCK_R)
                acc = _accumulate(_w2_tile(w2_ptr, offs_v, valid_v, r0, R, BLOCK_R), w1_chunk, acc, FP8, INTERPRET_)
        base = tl.trans(tl.load(_row_entries(base_ptr, base_batch_stride, rows_b, offs_v), mask=tl.trans(valid),
                                other=0.0))
        acc = tl.trans(acc)
        if FP8:
            acc = acc * tl.load(scales_ptr + offs_v, mask=valid_v, other=0.0).to(tl.float32)[:, None]
        c = base + acc
        if STATS:
            c = c * temp
        if WRITE_ROWS:
            tl.store(_row_entries(rows_ptr, rows_batch_stride, rows_b, offs_v), tl.trans(c), mask=tl.trans(valid))
        if STATS:
            m, s = tile_stats(tl.where(valid_v[:, None], c, float("-inf")), 0)
            in_range = valid_b & (offs_b * 0 + tile < n_tiles)  # a vector mask: persistent tiles may pass the end
            tl.store(m_ptr + rows_b * n_tiles + tile, m, mask=in_range)
            tl.store(s_ptr + rows_b * n_tiles + tile, s, mask=in_range)
        if GROUPS:
            keys = tl.where(valid, order_key(c, offs_v[:, None]), SENTINEL)
            top = tl.max(tl.reshape(keys, [BLOCK_V // GROUP_SIZE, GROUP_SIZE, BLOCK_B]), axis=1)
            g = tile * (BLOCK_V // GROUP_SIZE) + tl.arange(0, BLOCK_V // GROUP_SIZE)
            tl.store(group_ptr + rows_b[None, :] * n_groups + g[:, None], top,
                     mask=(g < n_groups)[:, None] & valid_b[None, :])
        if ARGMAX:
            best = tl.maximum(best, tl.where(valid, greedy_key(orderable(c), offs_v[:, None]), 0))
    if ARGMAX:
        top_key = tl.max(best, axis=0)
        key_out = key_ptr.to(tl.pointer_type(tl.uint64))
        tl.atomic_max(key_out + rows_b * key_stride, top_key, mask=valid_b & (top_key != 0), sem="relaxed")


def markov_smem_bytes(block_v: int, block_b: int, rank: int, fp8: bool, stages: int) -> int:
    """Shared memory of the Markov kernel: ``stages`` W2 and base-logit tiles plus the W1 block."""
    return stages * block_v * (rank * (1 if fp8 else 2) + block_b * 4) + rank * block_b * 2


def markov_config(batch: int, rank: int, fp8: bool, sampled: bool) -> dict:
    """Launch configuration of the Markov GEMM for a batch size, rank and W2 format; ``sampled`` for
    the softmax-statistics epilogue. Sweep on a GPU: ``python -m dspark.bench.greedy --tune``.

    ``PROGRAMS_PER_SM`` persistent programs per multiprocessor, or 0 for one program per tile. Greedy
    epilogues (H200 sweep): B = 64 with FP8 W2 (whose decoded tiles live in registers) or a small
    rank measured fastest with many short programs; otherwise two persistent programs per SM with the
    largest pipelined tile that lets them share the SM, and one at B = 64 (registers, see below). A
    CUDA-core dot for single rows (no 16-row padding) was measured slower than the padded
    tensor-core GEMM (40.5 vs 30.9 µs at R = 256).
    The sampled step: one program per tile, R in chunks of 64; 256-entry tiles (fewer softmax
    partials for the filter to combine: at B = 1, R = 64 128-entry tiles made the GEMM faster but the
    round slower) except at B = 64, and 8 warps except at R <= 64 for B = 1 and 64 (H200 sweep of the
    batch-major kernel, docs/kernel-layout.md).
    """
    block_b = min(64, max(16, next_pow2(batch)))
    block_r = max(16, next_pow2(rank))  # tl.dot needs dims >= 16
    num_warps = 4 if block_b < 64 else 8
    if sampled:
        four_warps = rank <= 64 and (batch == 1 or block_b >= 64)
        return dict(BLOCK_V=128 if block_b >= 64 else 256, BLOCK_B=block_b, BLOCK_R=min(64, block_r), NUM_STAGES=3,
                    PROGRAMS_PER_SM=0, num_warps=4 if four_warps else 8)
    if block_b >= 64 and (fp8 or rank <= 64):
        return dict(BLOCK_V=64, BLOCK_B=block_b, BLOCK_R=block_r, NUM_STAGES=1, PROGRAMS_PER_SM=0, num_warps=num_warps)
    if fp8:
        return dict(BLOCK_V=64, BLOCK_B=block_b, BLOCK_R=block_r, NUM_STAGES=3, PROGRAMS_PER_SM=2, num_warps=4)
    # B = 64 (8 warps): one persistent program per SM with the whole shared memory for a 3-deep
    # pipeline (the vocabulary-major kernel took 133 registers a thread at R = 256, so two programs
    # did not fit an SM's 65 536 and a two-per-SM grid ran in two waves; kernel-layout.md).
    per_sm, budget = (2, 120_000) if block_b < 64 else (1, 200_000)
    for block_v, stages in ((128, 3), (64, 3), (64, 2), (32, 2)):
        if markov_smem_bytes(block_v, block_b, rank, fp8, stages) <= budget:
            break
    return dict(BLOCK_V=block_v, BLOCK_B=block_b, BLOCK_R=block_r, NUM_STAGES=stages, PROGRAMS_PER_SM=per_sm,
                num_warps=num_warps)


def markov_tiles(vocab: int, config: dict) -> int:
    """Vocabulary tiles of a launch (the sampled step's softmax partials per row)."""
    return triton.cdiv(vocab, config["BLOCK_V"])


def launch_markov(base, logits_stride, w1, w2, scales, prev, prev_is_key=False, *, rows_out=None, keys_out=None,
                  stats=None, groups=None, inv_temp=1.0, row_settings=None, config=None):
    """Run the Markov GEMM over the whole vocabulary for ``prev.shape[0]`` batch rows.

    ``base``: the fp32 logit row of batch row 0 (a view; batch stride ``logits_stride`` rows);
    ``prev``: a 1-D view (any stride) of int32 ids or packed keys (``prev_is_key``). Epilogues:
    ``rows_out`` a ``[B, *]`` fp32 view receiving rows of V values; ``keys_out`` a 1-D int64 view of
    zeroed/older keys; ``stats = (m, s)`` f32 ``[B * tiles]`` partials of ``c * inv_temp`` (each row's
    inv_temp from ``row_settings`` f32 ``[B, 3]`` when given; ``rows_out`` then holds the scaled rows)
    and ``groups`` int64 ``[B * ceil(V / GROUP)]``.
    """
    batch = prev.shape[0]
    vocab, rank = w1.shape
    fp8 = w2.dtype == torch.uint8
    cfg = dict(config or markov_config(batch, rank, fp8, sampled=stats is not None))
    tiles = markov_tiles(vocab, cfg)
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    programs = min(tiles, per_sm * multiprocessors(base.device)) if per_sm else tiles
    m, s = stats if stats is not None else (base, base)
    _markov_kernel[(programs, triton.cdiv(batch, cfg["BLOCK_B"]))](
        base, logits_stride * vocab,
        w1, w2, scales if fp8 else w2,
        prev, prev.stride(0),
        rows_out if rows_out is not None else base, rows_out.stride(0) if rows_out is not None else 0,
        keys_out if keys_out is not None else prev, keys_out.stride(0) if keys_out is not None else 0,
        m, s, tiles, groups if groups is not None else base, triton.cdiv(vocab, tfilter.GROUP),
        batch, vocab, inv_temp, row_settings if row_settings is not None else base,
        R=rank, TILES_PER_PROGRAM=triton.cdiv(tiles, programs), PREV_IS_KEY=prev_is_key, FP8=fp8,
        ARGMAX=keys_out is not None, WRITE_ROWS=rows_out is not None, STATS=stats is not None,
        GROUPS=groups is not None, GROUP_SIZE=tfilter.GROUP, INTERPRET_=INTERPRET,
        ROW_TEMP=row_settings is not None, **cfg,
    )


def _base_row0(backbone_logits: torch.Tensor, step: int, logits_offset: int) -> torch.Tensor:
    """The base logit row of (batch 0, ``step``): rows of later batch entries follow by the stride."""
    return backbone_logits[step + logits_offset]


# ----------------------------------------------------------------------------- greedy path


def build_markov_logits(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, draft_token_ids,
                        step, logits_stride, logits_offset):
    """``dspark.kernels.build_markov_logits``: one GEMM launch writing the rows."""
    batch, vocab = first_prev_tokens.shape[0], markov_w1.shape[0]
    out = torch.empty(batch, vocab, dtype=torch.float32, device=backbone_logits.device)
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    launch_markov(_base_row0(backbone_logits, step, logits_offset), logits_stride, markov_w1, markov_w2,
                  w2_row_scales, prev, rows_out=out)
    return out


def markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, greedy_slots,
                             step, stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """``dspark.kernels.markov_greedy_fused_step`` (and ``_fp8``): one launch, keys merged by atomic max."""
    prev, prev_is_key = (first_prev_tokens, False) if step == 0 else (greedy_slots[:, step - 1], True)
    rows_out = None if stacked_logits is None else stacked_logits[:, stacked_depth_row]
    launch_markov(_base_row0(backbone_logits, step, logits_offset), logits_stride, markov_w1, markov_w2,
                  w2_row_scales, prev, prev_is_key, rows_out=rows_out, keys_out=greedy_slots[:, step])


# ----------------------------------------------------------------------------- FP8 quantisation


@triton.jit
def _e4m3_code(y):
    """Round-to-nearest-even e4m3 code (uint8 bits) of fp32 ``y`` already clamped to [-448, 448]."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal range (|y| >= 2^-6): round the 23-bit mantissa to 3 bits, rebias the exponent 127 -> 7
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # subnormal range: |y| / 2^-9 in [0, 8), rounded half to even (8 becomes the smallest normal)
    units = tl.abs(y) * 512.0
    whole = units.to(tl.uint32)
    frac = units - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    subnormal = whole + up.to(tl.uint32)
    code = tl.where(mag >= (121 << 23), normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_fp8_kernel(w2_ptr, codes_ptr, scales_ptr, V, R: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_R)
    valid = (rows < V)[:, None] & (cols < R)[None, :]
    offs = rows.to(tl.int64)[:, None] * R + cols[None, :]
    w = tl.load(w2_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    abs_max = tl.max(tl.abs(w), axis=1)
    scale = tl.where(abs_max > 0, tl.math.div_rn(abs_max, tl.full(abs_max.shape, 448.0, tl.float32)), 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    y = tl.minimum(tl.maximum(w * inv[:, None], -448.0), 448.0)
    tl.store(codes_ptr + offs, _e4m3_code(y), mask=valid)
    tl.store(scales_ptr + rows, scale.to(tl.float16), mask=rows < V)


def quantize_markov_w2_fp8(markov_w2):
    """``dspark.kernels.quantize_markov_w2_fp8``: one row block per program, correctly rounded divisions."""
    vocab, rank = markov_w2.shape
    codes = torch.empty(vocab, rank, dtype=torch.uint8, device=markov_w2.device)
    scales = torch.empty(vocab, dtype=torch.float16, device=markov_w2.device)
    block_r = next_pow2(rank)
    block_rows = max(1, 4096 // block_r)
    _quantize_fp8_kernel[(triton.cdiv(vocab, block_rows),)](markov_w2, codes, scales, vocab, R=rank,
                                                             BLOCK_ROWS=block_rows, BLOCK_R=block_r)
    return codes, scales


# ----------------------------------------------------------------------------- finalize and store


@triton.jit
def _finalize_kernel(keys_ptr, tokens_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    tl.store(tokens_ptr + offs, unpack_key(tl.load(keys_ptr + offs, mask=valid, other=0)), mask=valid)


def finalize_greedy_draft_tokens(greedy_slots, draft_token_ids):
    """``dspark.kernels.finalize_greedy_draft_tokens`` into ``draft_token_ids`` (no allocation)."""
    n = greedy_slots.numel()
    _finalize_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](greedy_slots, draft_token_ids, n, BLOCK=ELEMENTWISE_BLOCK)
    return draft_token_ids


@triton.jit
def _store_column_kernel(src_ptr, dst_ptr, dst_stride, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    tl.store(dst_ptr + offs * dst_stride, tl.load(src_ptr + offs, mask=valid), mask=valid)


def store_draft_step_top1(top1_indices, draft_token_ids, step):
    """``dspark.kernels.store_draft_step_top1``."""
    column = draft_token_ids[:, step]
    batch = column.shape[0]
    _store_column_kernel[(triton.cdiv(batch, ELEMENTWISE_BLOCK),)](top1_indices, column, column.stride(0), batch,
                                                                   BLOCK=ELEMENTWISE_BLOCK)


# ----------------------------------------------------------------------------- fused sampled step


def sample_step_plan(batch: int, vocab: int, rank: int, fp8: bool, filtered: bool, top_k: int, top_p: float) -> dict:
    """Scratch of ``markov_sample_step``: the GEMM's softmax partials (and group maxima), then the filter's."""
    partials = batch * markov_tiles(vocab, markov_config(batch, rank, fp8, sampled=True))
    plan = {"markov_m": (partials, torch.float32), "markov_s": (partials, torch.float32)}
    if filtered:
        plan["markov_groups"] = (batch * triton.cdiv(vocab, tfilter.GROUP), torch.int64)
    return merge(plan, tfilter.plan(batch, vocab, top_k, top_p, stats_given=True, sample=True))


def markov_sample_step(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, proposal_uniforms,
                       draft_token_ids, draft_probabilities, step, temperature, top_k, top_p, logits_stride,
                       logits_offset, workspace, row_settings=None):
    """``dspark.kernels.markov_sample_step``: Markov GEMM (statistics epilogue) -> filter -> probabilities
    -> draw. ``draft_probabilities[:, step]`` holds the logits first, so no other row buffer is needed;
    no host synchronisation and, once the workspace is sized, no allocation. Unfiltered: two launches.
    ``row_settings`` (f32 ``[B, 3]``): each row's own filter, the temperature applied in the epilogue."""
    batch, width = draft_token_ids.shape
    vocab, rank = markov_w1.shape
    if not batch:
        return
    if row_settings is None:
        inv_temp, k, p = filter_settings(temperature, top_k, top_p, vocab)
    else:
        inv_temp, (k, p) = 1.0, tfilter.ROW_PLAN
    filtered = k > 0 or p < 1.0
    fp8 = markov_w2.dtype == torch.uint8
    buf = claim(workspace, sample_step_plan(batch, vocab, rank, fp8, filtered, k, p), draft_token_ids.device)
    out = draft_probabilities[:, step]
    out_stride = width * vocab
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    config = markov_config(batch, rank, fp8, sampled=True)
    groups = buf["markov_groups"] if filtered else None
    launch_markov(_base_row0(backbone_logits, step, logits_offset), logits_stride, markov_w1, markov_w2,
                  w2_row_scales, prev, rows_out=out, stats=(buf["markov_m"], buf["markov_s"]), groups=groups,
                  inv_temp=inv_temp, row_settings=row_settings, config=config)
    tfilter.probabilities(out, out_stride, out, out_stride, batch, vocab, 1.0, k, p, workspace,
                          stats=(buf["markov_m"], buf["markov_s"], markov_tiles(vocab, config), config["BLOCK_V"]),
                          groups=groups, sample=(proposal_uniforms[:, step], width, draft_token_ids[:, step], width),
                          settings=row_settings, per_row=2)
