"""Triton kernels of the greedy DSpark path: Markov steps, FP8 W2, finalize/store, greedy verify.

Arguments arrive validated and normalised by the public functions (``dspark.kernels.markov`` /
``.verify``, see ``_backend``): ``backbone_logits`` and ``base_logits`` are contiguous fp32
``[rows, V]``, ``logits_stride`` is resolved, other tensors are contiguous. Token ids read from
memory are clamped into ``[0, V)`` before they index anything (on the GPU nobody checked them).

Design (kernels.md section 7): NVIDIA's fused step streams all of ``markov_w2`` once per batch row.
Here one launch reads it once for the whole batch: programs (persistent, a few per SM) gather
their batch block's ``W1[prev]`` rows once and stream ``BLOCK_V``-row tiles of W2 through the
skinny GEMM ``W2[tile] @ W1[prev]^T`` (``tl.dot`` on tensor cores, the batch padded to at least 16
columns), add the base logits and keep an elementwise running maximum of packed 64-bit keys
(kernels.md 3.14: orderable value image, then the complemented index, so ties go to the lowest
index and the NaN/+-0 quirks come for free; padding lanes hold key 0 and never win). At the end
each program reduces its keys per row and merges them with one unsigned 64-bit ``atomic_max``.

FP8 W2 (uint8 e4m3 codes + fp16 row scales) is decoded to the weights' dtype inside the GEMM and
the row scale is applied to the fp32 dot, so it moves half the bytes of the fp16 step.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "build_markov_logits",
    "markov_greedy_fused_step",
    "markov_greedy_fused_step_fp8",
    "markov_greedy_round",
    "quantize_markov_w2_fp8",
    "finalize_greedy_draft_tokens",
    "store_draft_step_top1",
    "greedy_accept",
    "build_verify_tokens",
    "fill_proposal_lengths",
]

_SIGN32 = tl.constexpr(0x80000000)
_ELEMENTWISE_BLOCK = 1024
# Triton 3.6's CPU interpreter multiplies the raw uint16 bits of bf16 operands in tl.dot, so under
# the interpreter the GEMM runs on fp32 copies (exact products, same fp32 accumulation).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _orderable(x):
    """uint32 image of fp32 ``x`` whose unsigned order is the float order (high word of 3.14)."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where(u >= _SIGN32, u ^ 0xFFFFFFFF, u | _SIGN32)


@triton.jit
def _key(image, index):
    """Packed uint64 key (kernels.md 3.14) of a uint32 orderable image and an int32 vocabulary index.

    The unsigned order of keys is the value order, equal values ranking the lower index higher;
    0 is below every real key, so it is the floor for padding lanes.
    """
    return (image.to(tl.uint64) << 32) | (index.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (see ``_INTERPRET``)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _unpack_key(key):
    """Token id of a packed key (int64 storage): ``0xFFFFFFFF - low word`` as int32 (0 -> -1)."""
    return key.to(tl.int32) ^ -1


# ----------------------------------------------------------------------------- Markov GEMM kernel


@triton.jit
def _markov_kernel(
    base_ptr, base_batch_stride,  # fp32 base logit row of (b, step) at base_ptr + b*stride
    w1_ptr, w2_ptr, scales_ptr,  # W1 [V,R]; W2 [V,R] fp16/bf16 or uint8 e4m3 codes + fp16 scales [V]
    prev_ptr, prev_stride,  # previous token of row b: int32 id, or a packed key (PREV_IS_KEY)
    out_ptr, out_batch_stride,  # optional fp32 corrected-row output (WRITE_ROWS)
    key_ptr, key_stride,  # optional packed-key output, merged with atomic max (ARGMAX)
    B, V,
    R: tl.constexpr, BLOCK_R: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    PREV_IS_KEY: tl.constexpr, FP8: tl.constexpr, WRITE_ROWS: tl.constexpr, ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``c[b, v] = base[b, v] + sum_r W2[v, r] * W1[prev_b, r]`` over vocabulary tiles ``pid + i*grid``.

    A program gathers its batch block's W1 rows once, then streams its W2 tiles (software-pipelined
    ``NUM_STAGES`` deep) through one GEMM each. Keys are kept as an elementwise running max over the
    tiles (no cross-warp reduction inside the loop); one reduction and one atomic max per row and
    program at the end merge them.
    """
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    valid_b = offs_b < B
    rows_b = offs_b.to(tl.int64)
    prev = tl.load(prev_ptr + rows_b * prev_stride, mask=valid_b, other=0)
    if PREV_IS_KEY:
        prev = _unpack_key(prev)
    prev = tl.minimum(tl.maximum(prev.to(tl.int32), 0), V - 1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    valid_r = offs_r < R
    w1 = tl.load(w1_ptr + prev[None, :] * R + offs_r[:, None], mask=valid_r[:, None] & valid_b[None, :], other=0.0)

    best = tl.zeros([BLOCK_V, BLOCK_B], dtype=tl.uint64)
    for i in tl.range(0, TILES_PER_PROGRAM, num_stages=NUM_STAGES):
        offs_v = (tl.program_id(0) + i * tl.num_programs(0)) * BLOCK_V + tl.arange(0, BLOCK_V)
        valid_v = offs_v < V
        valid = valid_v[:, None] & valid_b[None, :]
        w2 = tl.load(w2_ptr + offs_v.to(tl.int64)[:, None] * R + offs_r[None, :], mask=valid_v[:, None] & valid_r[None, :], other=0)
        base = tl.load(base_ptr + rows_b[None, :] * base_batch_stride + offs_v[:, None], mask=valid, other=0.0)
        if FP8:
            w2 = w2.to(tl.float8e4nv, bitcast=True).to(w1.dtype)
        acc = _dot(w2, w1, tl.zeros([BLOCK_V, BLOCK_B], dtype=tl.float32), INTERPRET)
        if FP8:
            acc = acc * tl.load(scales_ptr + offs_v, mask=valid_v, other=0.0).to(tl.float32)[:, None]
        c = base + acc
        if WRITE_ROWS:
            tl.store(out_ptr + rows_b[None, :] * out_batch_stride + offs_v[:, None], c, mask=valid)
        if ARGMAX:
            best = tl.maximum(best, tl.where(valid, _key(_orderable(c), offs_v[:, None]), 0))
    if ARGMAX:
        top = tl.max(best, axis=0)
        key_out = key_ptr.to(tl.pointer_type(tl.uint64))
        tl.atomic_max(key_out + rows_b * key_stride, top, mask=valid_b & (top != 0), sem="relaxed")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the CPU interpreter, to exercise the loop)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def markov_smem_bytes(block_v: int, block_b: int, rank: int, fp8: bool, stages: int) -> int:
    """Shared memory of the Markov kernel: ``stages`` W2 and base-logit tiles plus the W1 block."""
    return stages * block_v * (rank * (1 if fp8 else 2) + block_b * 4) + rank * block_b * 2


def markov_config(batch: int, rank: int, fp8: bool) -> dict:
    """Launch configuration of the Markov GEMM kernel for a batch size and rank (H200 sweep).

    ``PROGRAMS_PER_SM`` persistent programs per multiprocessor, or 0 for one program per tile:
    B = 64 with FP8 W2 (whose decoded tiles live in registers) or a small rank measured fastest with
    many short programs; otherwise two persistent programs per SM with the largest pipelined tile
    that lets them share the SM (one at B = 64). A CUDA-core dot for single rows (no 16-column
    padding) was measured slower than the padded tensor-core GEMM (40.5 vs 30.9 µs at R = 256).
    """
    block_b = min(64, max(16, _next_pow2(batch)))
    num_warps = 4 if block_b < 64 else 8
    if block_b >= 64 and (fp8 or rank <= 64):
        return dict(BLOCK_V=64, BLOCK_B=block_b, NUM_STAGES=1, PROGRAMS_PER_SM=0, num_warps=num_warps)
    if fp8:
        return dict(BLOCK_V=64, BLOCK_B=block_b, NUM_STAGES=3, PROGRAMS_PER_SM=2, num_warps=4)
    budget = 120_000 if block_b < 64 else 150_000
    for block_v, stages in ((128, 3), (64, 3), (64, 2), (32, 2)):
        if markov_smem_bytes(block_v, block_b, rank, fp8, stages) <= budget:
            break
    return dict(BLOCK_V=block_v, BLOCK_B=block_b, NUM_STAGES=stages, PROGRAMS_PER_SM=2, num_warps=num_warps)


def _launch_markov(base, logits_stride, w1, w2, scales, prev, prev_is_key, *, rows_out=None, keys_out=None, config=None):
    """Run the Markov GEMM over the whole vocabulary for ``prev.shape[0]`` batch rows.

    ``base`` is the fp32 logit row of batch row 0 (a view; batch stride ``logits_stride`` rows);
    ``prev`` a 1-D view (any stride) of int32 ids or packed keys; ``rows_out`` a ``[B, *]`` fp32
    view receiving rows of V corrected logits; ``keys_out`` a 1-D int64 view of zeroed/older keys.
    """
    batch = prev.shape[0]
    vocab, rank = w2.shape
    fp8 = w2.dtype == torch.uint8
    cfg = dict(config or markov_config(batch, rank, fp8))
    tiles = triton.cdiv(vocab, cfg["BLOCK_V"])
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    programs = min(tiles, per_sm * _multiprocessors(base.device)) if per_sm else tiles
    grid = (programs, triton.cdiv(batch, cfg["BLOCK_B"]))
    _markov_kernel[grid](
        base, logits_stride * vocab,
        w1, w2, scales if fp8 else w2,
        prev, prev.stride(0),
        rows_out if rows_out is not None else base, rows_out.stride(0) if rows_out is not None else 0,
        keys_out if keys_out is not None else prev, keys_out.stride(0) if keys_out is not None else 0,
        batch, vocab,
        R=rank, BLOCK_R=max(16, _next_pow2(rank)), TILES_PER_PROGRAM=triton.cdiv(tiles, programs),  # tl.dot: dims >= 16
        PREV_IS_KEY=prev_is_key, FP8=fp8, WRITE_ROWS=rows_out is not None, ARGMAX=keys_out is not None,
        INTERPRET=_INTERPRET, **cfg,
    )


def _base_row0(backbone_logits: torch.Tensor, step: int, logits_offset: int) -> torch.Tensor:
    """The base logit row of (batch 0, ``step``): rows of later batch entries follow by the stride."""
    return backbone_logits[step + logits_offset]


def build_markov_logits(backbone_logits, markov_w1, markov_w2, first_prev_tokens, draft_token_ids, step, logits_stride, logits_offset):
    """Markov-corrected logits of one draft step (kernels.md 3.11), one W2 pass for the whole batch.

    ``backbone_logits`` f32 ``[rows, V]``; ``markov_w1``/``markov_w2`` fp16 or bf16 ``[V, R]``;
    ``first_prev_tokens`` int32 ``[B]``; ``draft_token_ids`` int32 ``[B, P]`` (column ``step - 1``
    holds the previous tokens when ``step > 0``). Returns f32 ``[B, V]``.
    """
    batch, vocab = first_prev_tokens.shape[0], markov_w2.shape[0]
    out = torch.empty(batch, vocab, dtype=torch.float32, device=backbone_logits.device)
    prev = first_prev_tokens if step == 0 else draft_token_ids[:, step - 1]
    base = _base_row0(backbone_logits, step, logits_offset)
    _launch_markov(base, logits_stride, markov_w1, markov_w2, None, prev, False, rows_out=out)
    return out


def _fused_step(backbone_logits, markov_w1, w2, w2_row_scales, first_prev_tokens, greedy_slots, step,
                stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """One fused greedy step: ``greedy_slots[:, step] = max(key(c_v, v))`` (+ the stacked row)."""
    prev, prev_is_key = (first_prev_tokens, False) if step == 0 else (greedy_slots[:, step - 1], True)
    rows_out = None if stacked_logits is None else stacked_logits[:, stacked_depth_row]
    base = _base_row0(backbone_logits, step, logits_offset)
    _launch_markov(base, logits_stride, markov_w1, w2, w2_row_scales, prev, prev_is_key,
                   rows_out=rows_out, keys_out=greedy_slots[:, step])


def markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, greedy_slots, step,
                             stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """Fused Markov correction + exact argmax of one greedy step (kernels.md 3.14); returns None.

    ``markov_w1``/``markov_w2`` fp16 or bf16 ``[V, R]``; ``first_prev_tokens`` int32 ``[B]``;
    ``greedy_slots`` int64 ``[B, P]`` (unsigned key bit patterns; column ``step`` must be zero or an
    older key: it is merged with an atomic max); ``stacked_logits`` optional f32 ``[B, P+1, V]``
    whose row ``stacked_depth_row`` receives the corrected logits.
    """
    _fused_step(backbone_logits, markov_w1, markov_w2, None, first_prev_tokens, greedy_slots, step,
                stacked_logits, stacked_depth_row, logits_stride, logits_offset)


def markov_greedy_fused_step_fp8(backbone_logits, markov_w1, w2_fp8, w2_row_scales, first_prev_tokens, greedy_slots, step,
                                 stacked_logits, stacked_depth_row, logits_stride, logits_offset):
    """The fused greedy step with FP8 W2 (kernels.md 3.16); returns None.

    ``w2_fp8`` uint8 ``[V, R]`` e4m3 codes, ``w2_row_scales`` fp16 ``[V]``:
    ``c_v = logits + scale_v * sum_r fp8(q[v, r]) * W1[prev, r]``. Other arguments as the fp16 step.
    """
    _fused_step(backbone_logits, markov_w1, w2_fp8, w2_row_scales, first_prev_tokens, greedy_slots, step,
                stacked_logits, stacked_depth_row, logits_stride, logits_offset)


def markov_greedy_round(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_len, w2_row_scales,
                        logits_stride, logits_offset, greedy_slots, draft_token_ids, stacked_logits):
    """A whole greedy drafting round: zero the slots, ``proposal_len`` fused steps, finalize.

    ``markov_w2`` fp16/bf16 ``[V, R]``, or uint8 e4m3 codes with ``w2_row_scales`` fp16 ``[V]`` (FP8
    steps). ``greedy_slots`` int64 ``[B, P]`` and ``draft_token_ids`` int32 ``[B, P]`` are the
    caller's buffers: nothing is allocated and the host never waits, so the round can be captured
    in a CUDA graph. ``stacked_logits`` optional f32 ``[B, P+1, V]`` receives the corrected logits
    of step ``s`` in row ``s + 1``. Returns ``draft_token_ids``.
    """
    greedy_slots.zero_()
    for step in range(proposal_len):
        _fused_step(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, greedy_slots, step,
                    stacked_logits, step + 1, logits_stride, logits_offset)
    _launch_finalize(greedy_slots, draft_token_ids)
    return draft_token_ids


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
def _quantize_fp8_kernel(w2_ptr, codes_ptr, scales_ptr, V, R: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
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
    """Per-row FP8 E4M3 quantisation of W2 (kernels.md 3.15).

    ``markov_w2`` fp16 or bf16 ``[V, R]`` -> ``(w2_fp8 uint8 [V, R], w2_row_scales fp16 [V])`` with
    ``scale = absmax / 448`` (1 for a zero row), codes ``rne(w * (1 / scale))`` saturated to +-448.
    """
    vocab, rank = markov_w2.shape
    codes = torch.empty(vocab, rank, dtype=torch.uint8, device=markov_w2.device)
    scales = torch.empty(vocab, dtype=torch.float16, device=markov_w2.device)
    block_r = _next_pow2(rank)
    block_rows = max(1, 4096 // block_r)
    _quantize_fp8_kernel[(triton.cdiv(vocab, block_rows),)](markov_w2, codes, scales, vocab, R=rank, BLOCK_ROWS=block_rows, BLOCK_R=block_r)
    return codes, scales


# ----------------------------------------------------------------------------- tiny per-step kernels


@triton.jit
def _finalize_kernel(keys_ptr, tokens_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    tl.store(tokens_ptr + offs, _unpack_key(tl.load(keys_ptr + offs, mask=valid, other=0)), mask=valid)


def _launch_finalize(greedy_slots, draft_token_ids):
    n = greedy_slots.numel()
    _finalize_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](greedy_slots, draft_token_ids, n, BLOCK=_ELEMENTWISE_BLOCK)


def finalize_greedy_draft_tokens(greedy_slots):
    """Unpack greedy keys (kernels.md 3.17): int64 ``[B, P]`` -> int32 ``[B, P]`` (a zero key -> -1)."""
    tokens = torch.empty(greedy_slots.shape, dtype=torch.int32, device=greedy_slots.device)
    _launch_finalize(greedy_slots, tokens)
    return tokens


@triton.jit
def _store_column_kernel(src_ptr, dst_ptr, dst_stride, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    tl.store(dst_ptr + offs * dst_stride, tl.load(src_ptr + offs, mask=valid), mask=valid)


def store_draft_step_top1(top1_indices, draft_token_ids, step):
    """``draft_token_ids[:, step] = top1_indices`` (kernels.md 3.21); int32 ``[B]`` into ``[B, P]``."""
    column = draft_token_ids[:, step]
    batch = column.shape[0]
    _store_column_kernel[(triton.cdiv(batch, _ELEMENTWISE_BLOCK),)](top1_indices, column, column.stride(0), batch, BLOCK=_ELEMENTWISE_BLOCK)


@triton.jit
def _build_verify_kernel(last_ptr, draft_ptr, draft_stride, out_ptr, N, VERIFY_LEN, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    b = offs // VERIFY_LEN
    j = offs % VERIFY_LEN
    last = tl.load(last_ptr + b, mask=valid & (j == 0))
    draft = tl.load(draft_ptr + b * draft_stride + j - 1, mask=valid & (j > 0))
    tl.store(out_ptr + offs, tl.where(j == 0, last, draft), mask=valid)


def build_verify_tokens(last_accepted_tokens, draft_token_ids, verify_proposal_len):
    """``[last, draft[:, :P_v]]`` (kernels.md 3.2): int32 ``[B]`` + ``[B, S]`` -> int32 ``[B, P_v + 1]``."""
    batch, draft_stride = draft_token_ids.shape
    verify_len = verify_proposal_len + 1
    out = torch.empty(batch, verify_len, dtype=torch.int32, device=draft_token_ids.device)
    n = batch * verify_len
    _build_verify_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](last_accepted_tokens, draft_token_ids, draft_stride, out, n, verify_len, BLOCK=_ELEMENTWISE_BLOCK)
    return out


@triton.jit
def _fill_kernel(out_ptr, value, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], value, tl.int32), mask=offs < N)


def fill_proposal_lengths(batch_size, proposal_len, device):
    """int32 ``[B]`` filled with ``proposal_len`` (kernels.md 3.4)."""
    out = torch.empty(batch_size, dtype=torch.int32, device=device)
    if batch_size:
        _fill_kernel[(triton.cdiv(batch_size, _ELEMENTWISE_BLOCK),)](out, proposal_len, batch_size, BLOCK=_ELEMENTWISE_BLOCK)
    return out


# ----------------------------------------------------------------------------- greedy accept


@triton.jit
def _row_argmax_partial_kernel(logits_ptr, partial_ptr, V, NUM_SPLITS, BLOCK: tl.constexpr):
    """Packed key of the argmax of one ``BLOCK`` slice of one row (NaN as -inf, -0 == +0)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = split * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(logits_ptr + row * V + offs, mask=valid, other=0.0)
    x = tl.where(x != x, float("-inf"), x)
    image = tl.where(x == 0.0, _SIGN32, _orderable(x))
    key = tl.max(tl.where(valid, _key(image, offs), 0), axis=0)
    tl.store(partial_ptr.to(tl.pointer_type(tl.uint64)) + row * NUM_SPLITS + split, key)


@triton.jit
def _greedy_accept_kernel(
    partial_ptr, NUM_SPLITS, draft_ptr, draft_stride, lengths_ptr, accepted_ptr, accept_length_ptr,
    VERIFY_PROPOSAL_LEN, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per batch row: merge the slice keys into the argmax of each verify row, then walk the draft."""
    b = tl.program_id(0)
    verify_len = VERIFY_PROPOSAL_LEN + 1
    pos = tl.arange(0, BLOCK_L)
    splits = tl.arange(0, BLOCK_S)
    in_row = pos < verify_len
    partial = partial_ptr.to(tl.pointer_type(tl.uint64)) + (b * verify_len + pos)[:, None] * NUM_SPLITS + splits[None, :]
    keys = tl.load(partial, mask=in_row[:, None] & (splits < NUM_SPLITS)[None, :], other=0)
    target = _unpack_key(tl.max(keys, axis=1))

    row_p = tl.maximum(1, tl.minimum(VERIFY_PROPOSAL_LEN, tl.load(lengths_ptr + b)))
    walked = pos < row_p
    draft = tl.load(draft_ptr + b * draft_stride + pos, mask=walked, other=0)
    mismatch = ~(walked & (draft == target))
    n = tl.min(tl.where(mismatch, pos, BLOCK_L), axis=0)
    accepted = tl.where(pos < n, draft, tl.where(pos == n, target, 0))
    tl.store(accepted_ptr + b * verify_len + pos, accepted, mask=in_row)
    tl.store(accept_length_ptr + b, n + 1)


def greedy_accept_config(vocab: int) -> dict:
    """Slice length and warps of the argmax pass (a plain fp32 stream; tuned on an H200)."""
    return dict(BLOCK=min(2048, _next_pow2(vocab)), num_warps=4)


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len):
    """Greedy verification (kernels.md 3.3) in two launches: sliced row argmax, then the walk.

    ``base_logits`` f32 ``[B * (P_v + 1), V]``; ``draft_token_ids`` int32 ``[B, S]``;
    ``proposal_lengths`` int32 ``[B]``. Returns ``(accepted_token_ids int32 [B, P_v + 1],
    accept_length int32 [B])``; entries past ``accept_length`` are 0 (dspark zeroes them).
    """
    batch, draft_stride = draft_token_ids.shape
    rows, vocab = base_logits.shape
    device = base_logits.device
    cfg = greedy_accept_config(vocab)
    splits = triton.cdiv(vocab, cfg["BLOCK"])
    partial = torch.empty(rows, splits, dtype=torch.int64, device=device)
    _row_argmax_partial_kernel[(rows, splits)](base_logits, partial, vocab, splits, **cfg)
    verify_len = verify_proposal_len + 1
    accepted = torch.empty(batch, verify_len, dtype=torch.int32, device=device)
    accept_length = torch.empty(batch, dtype=torch.int32, device=device)
    _greedy_accept_kernel[(batch,)](
        partial, splits, draft_token_ids, draft_stride, proposal_lengths, accepted, accept_length, verify_proposal_len,
        BLOCK_L=_next_pow2(verify_len), BLOCK_S=_next_pow2(splits),
    )
    return accepted, accept_length
