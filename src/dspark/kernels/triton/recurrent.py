"""Triton recurrent family (contracts: ``dspark.kernels.gated_delta_scan``, ``gated_delta_replay_scan``,
``selective_state_scan``, ``causal_conv_window``).

One program per (request, head, block of the state's rows) holds its slice of the state in
registers over the request's whole window: one read of the state, one write per token into the
token's ring entry. Gated delta rule: ``[dk, BV]`` slices, flash-linear-attention's fused recurrent
layout and op order (``BV`` 8, one warp; its kernel keeps only the final state); the replay form
runs the same steps (``_delta_step``) from its checkpoint, first over the kept inputs of the last
window's accepted prefix, stores the checkpoint, then over its own tokens, the ``i_v == 0`` program
of each (request, head) keeping their ``k``, ``g`` and ``beta`` and every program its ``v`` columns. Mamba-2:
``[BP, d_state]`` slices of ``BP`` head_dim rows.

Causal conv: one program per (request, block of ``BC`` channels) runs the request's tokens in tiles
of ``BT``, every tap of a tile a load (this forward's ``x`` rows or, in the request's first tile,
its ring entries). A prompt chunk longer than the ring overwrites, with its last tokens' inputs,
entries its first tokens read; only this program reads or writes them (the request's line, these
channels), and a CTA barrier between each tile's reads and its writes keeps every read before
them. A long chunk's tiles run in order in its programs (``BT`` grows with the tokens per request).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv_window", "gated_delta_replay_scan", "gated_delta_scan", "selective_state_scan"]

BV = 8  # value columns per program (fla's choice for the fused recurrent kernel)
BP = 16  # Mamba-2 head_dim rows per program (with a d_state of 128: 2,048 f32 of state)
BC = 128  # conv channels per program (Qwen3.5-9B's 8,192: 64 programs per request)
MAX_BT = 32  # conv tokens per tile at most (a [32, 128] f32 sum over 4 warps)


@triton.jit
def _start_state(states_ptr, read_lines_ptr, read_entries_ptr, r, line_stride, entry_stride, in_head, mask):
    """Request ``r``'s slice ``in_head`` of the state it starts from (zero where it reads no entry)."""
    entry = tl.load(read_entries_ptr + r)
    start = tl.load(read_lines_ptr + r) * line_stride + tl.maximum(entry, 0) * entry_stride
    s = tl.load(states_ptr + start + in_head, mask=mask, other=0.0)
    return tl.where(entry >= 0, s, 0.0)


@triton.jit
def _store_state(states_ptr, write_lines_ptr, write_entries_ptr, n, line_stride, entry_stride, in_head, s, mask):
    """The slice ``in_head`` of the state after token ``n`` into that token's ring entry (the replay
    kernel: request ``n``'s checkpoint into its write entry)."""
    to = tl.load(write_lines_ptr + n) * line_stride + tl.load(write_entries_ptr + n) * entry_stride
    tl.store(states_ptr + to + in_head, s, mask=mask)


@triton.jit
def _delta_inputs(k_ptr, v_ptr, g_ptr, beta_ptr, row, o_k, o_v, mask_k, mask_v, DK: tl.constexpr, DV: tl.constexpr):
    """Row ``row`` of ``k`` ``[.., DK]``, ``v`` ``[.., DV]`` (columns ``o_v``), ``g`` and ``beta``, as stored."""
    b_k = tl.load(k_ptr + row * DK + o_k, mask=mask_k, other=0.0)
    b_v = tl.load(v_ptr + row * DV + o_v, mask=mask_v, other=0.0)
    return b_k, b_v, tl.load(g_ptr + row), tl.load(beta_ptr + row)


@triton.jit
def _delta_step(s, b_k, b_v, b_g, b_beta):
    """The state slice ``s`` ``[BK, BV]`` after one token's inputs (``_delta_inputs``), in f32."""
    b_k = b_k.to(tl.float32)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    s = s * tl.exp(b_g)
    u = b_beta.to(tl.float32) * (b_v.to(tl.float32) - tl.sum(s * b_k[:, None], 0))
    return s + b_k[:, None] * u[None, :]


@triton.jit
def _read_out(s, q_ptr, out_ptr, row, scale, o_k, o_v, mask_k, mask_v, DK: tl.constexpr, DV: tl.constexpr):
    """Row ``row`` of ``out`` (columns ``o_v``): ``s^T q`` of that row's normalised, scaled ``q``."""
    b_q = tl.load(q_ptr + row * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    o = tl.sum(s * b_q[:, None], 0)
    tl.store(out_ptr + row * DV + o_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _delta_program(HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV_: tl.constexpr):
    """This program's request ``r``, value head ``h`` and slice of the state's columns: the key
    offsets ``o_k``, the value offsets ``o_v``, their masks and the ``[BK, BV_]`` state mask."""
    pid = tl.program_id(0)
    nv = tl.cdiv(DV, BV_)
    i_v, i_rh = pid % nv, pid // nv
    o_k = tl.arange(0, BK)
    o_v = i_v * BV_ + tl.arange(0, BV_)
    mask_k, mask_v = o_k < DK, o_v < DV
    return i_rh // HV, i_rh % HV, o_k, o_v, mask_k, mask_v, mask_k[:, None] & mask_v[None, :]


@triton.jit
def _gated_delta_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, states_ptr, read_lines_ptr,
                             read_entries_ptr, first_ptr, count_ptr, write_lines_ptr, write_entries_ptr, scale,
                             line_stride, entry_stride, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BK: tl.constexpr, BV_: tl.constexpr):
    r, h, o_k, o_v, mask_k, mask_v, mask_s = _delta_program(HV, DK, DV, BK, BV_)
    in_head = h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    s = _start_state(states_ptr, read_lines_ptr, read_entries_ptr, r, line_stride, entry_stride, in_head, mask_s)
    first = tl.load(first_ptr + r)
    count = tl.load(count_ptr + r)
    for t in range(0, count):
        n = first + t
        b_k, b_v, b_g, b_beta = _delta_inputs(k_ptr, v_ptr, g_ptr, beta_ptr, n * HV + h, o_k, o_v, mask_k, mask_v,
                                              DK, DV)
        s = _delta_step(s, b_k, b_v, b_g, b_beta)
        _read_out(s, q_ptr, out_ptr, n * HV + h, scale, o_k, o_v, mask_k, mask_v, DK, DV)
        _store_state(states_ptr, write_lines_ptr, write_entries_ptr, n, line_stride, entry_stride, in_head, s, mask_s)


def gated_delta_scan(q, k, v, g, beta, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                     write_entries, scale):
    n, heads, dk = q.shape
    dv = v.shape[2]
    out = torch.empty_like(v)
    requests = read_lines.shape[0]
    if requests == 0 or n == 0:
        return out
    grid = (requests * heads * triton.cdiv(dv, BV),)
    _gated_delta_scan_kernel[grid](q, k, v, g, beta, out, states, read_lines, read_entries, first_tokens,
                                   token_counts, write_lines, write_entries, scale, states.stride(0),
                                   states.stride(1), HV=heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV_=BV,
                                   num_warps=1)
    return out


@triton.jit
def _gated_delta_replay_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, checkpoints_ptr, kept_k_ptr,
                                    kept_v_ptr, kept_g_ptr, kept_beta_ptr, lines_ptr, read_entries_ptr,
                                    replay_entries_ptr, replay_counts_ptr, write_entries_ptr, keep_entries_ptr,
                                    first_ptr, count_ptr, snapshot_counts_ptr, snapshot_entries_ptr, scale, slots,
                                    entries, HV: tl.constexpr, DK: tl.constexpr,
                                    DV: tl.constexpr, BK: tl.constexpr, BV_: tl.constexpr):
    r, h, o_k, o_v, mask_k, mask_v, mask_s = _delta_program(HV, DK, DV, BK, BV_)
    line = tl.load(lines_ptr + r)
    in_head = h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    line_stride = slots * (HV * DK * DV)
    s = _start_state(checkpoints_ptr, lines_ptr, read_entries_ptr, r, line_stride, HV * DK * DV, in_head, mask_s)
    replayed = line * entries + tl.load(replay_entries_ptr + r)  # the line's first replayed kept token
    snapshot = tl.load(snapshot_counts_ptr + r)  # the state after this many replayed tokens to a block end's entry
    if snapshot == 0:
        _store_state(checkpoints_ptr, lines_ptr, snapshot_entries_ptr, r, line_stride, HV * DK * DV, in_head, s,
                     mask_s)
    for t in range(0, tl.load(replay_counts_ptr + r)):
        b_k, b_v, b_g, b_beta = _delta_inputs(kept_k_ptr, kept_v_ptr, kept_g_ptr, kept_beta_ptr,
                                              (replayed + t) * HV + h, o_k, o_v, mask_k, mask_v, DK, DV)
        s = _delta_step(s, b_k, b_v, b_g, b_beta)
        if t + 1 == snapshot:
            _store_state(checkpoints_ptr, lines_ptr, snapshot_entries_ptr, r, line_stride, HV * DK * DV, in_head, s,
                         mask_s)
    _store_state(checkpoints_ptr, lines_ptr, write_entries_ptr, r, line_stride, HV * DK * DV, in_head, s, mask_s)
    kept = line * entries + tl.load(keep_entries_ptr + r)  # where the line keeps this window's first token
    first = tl.load(first_ptr + r)
    count = tl.load(count_ptr + r)
    # one program per (request, head) keeps the k, g and beta that all its programs load
    lead = tl.program_id(0) % tl.cdiv(DV, BV_) == 0
    keep_k = o_k < tl.where(lead, DK, 0)  # (mask_k & lead: the interpreter refuses a vector & scalar mask)
    for t in range(0, count):
        row, at = (first + t) * HV + h, (kept + t) * HV + h
        b_k, b_v, b_g, b_beta = _delta_inputs(k_ptr, v_ptr, g_ptr, beta_ptr, row, o_k, o_v, mask_k, mask_v, DK, DV)
        tl.store(kept_k_ptr + at * DK + o_k, b_k, mask=keep_k)
        tl.store(kept_v_ptr + at * DV + o_v, b_v, mask=mask_v)
        tl.store(kept_g_ptr + at, b_g, mask=lead)
        tl.store(kept_beta_ptr + at, b_beta, mask=lead)
        s = _delta_step(s, b_k, b_v, b_g, b_beta)
        _read_out(s, q_ptr, out_ptr, row, scale, o_k, o_v, mask_k, mask_v, DK, DV)


def gated_delta_replay_scan(q, k, v, g, beta, checkpoints, kept_k, kept_v, kept_g, kept_beta, lines, read_entries,
                            replay_entries, replay_counts, write_entries, keep_entries, first_tokens, token_counts,
                            snapshot_counts, snapshot_entries, scale):
    heads, dk = q.shape[1:]
    dv = v.shape[2]
    out = torch.empty_like(v)
    requests = lines.shape[0]
    if requests == 0:  # (not on N == 0: a request without tokens still writes its checkpoint)
        return out
    grid = (requests * heads * triton.cdiv(dv, BV),)
    _gated_delta_replay_scan_kernel[grid](q, k, v, g, beta, out, checkpoints, kept_k, kept_v, kept_g, kept_beta, lines,
                                          read_entries, replay_entries, replay_counts, write_entries, keep_entries,
                                          first_tokens, token_counts, snapshot_counts, snapshot_entries, scale,
                                          checkpoints.shape[1], kept_k.shape[1],
                                          HV=heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV_=BV, num_warps=1)
    return out


@triton.jit
def _selective_state_scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, states_ptr, read_lines_ptr,
                                 read_entries_ptr, first_ptr, count_ptr, write_lines_ptr, write_entries_ptr,
                                 line_stride, entry_stride, HEADS: tl.constexpr, GROUPS: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, SIZE: tl.constexpr, BP_: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    np_ = tl.cdiv(HEAD_DIM, BP_)
    i_p, i_rh = pid % np_, pid // np_
    r, h = i_rh // HEADS, i_rh % HEADS
    group = h // (HEADS // GROUPS)
    o_p = i_p * BP_ + tl.arange(0, BP_)
    o_n = tl.arange(0, BN)
    mask_p, mask_n = o_p < HEAD_DIM, o_n < SIZE
    mask_s = mask_p[:, None] & mask_n[None, :]
    in_head = h * HEAD_DIM * SIZE + o_p[:, None] * SIZE + o_n[None, :]
    s = _start_state(states_ptr, read_lines_ptr, read_entries_ptr, r, line_stride, entry_stride, in_head, mask_s)
    a = tl.load(a_ptr + h)
    d = tl.load(d_ptr + h).to(tl.float32)
    first = tl.load(first_ptr + r)
    count = tl.load(count_ptr + r)
    for t in range(0, count):
        n = first + t
        x = tl.load(x_ptr + (n * HEADS + h) * HEAD_DIM + o_p, mask=mask_p, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + n * HEADS + h).to(tl.float32)
        b = tl.load(b_ptr + (n * GROUPS + group) * SIZE + o_n, mask=mask_n, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + (n * GROUPS + group) * SIZE + o_n, mask=mask_n, other=0.0).to(tl.float32)
        s = tl.exp(dt * a) * s + (dt * b)[None, :] * x[:, None]
        y = tl.sum(s * c[None, :], 1) + d * x
        tl.store(out_ptr + (n * HEADS + h) * HEAD_DIM + o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p)
        _store_state(states_ptr, write_lines_ptr, write_entries_ptr, n, line_stride, entry_stride, in_head, s, mask_s)


def selective_state_scan(x, dt, a, b, c, d, states, read_lines, read_entries, first_tokens, token_counts,
                         write_lines, write_entries):
    n, heads, head_dim = x.shape
    groups, size = b.shape[1:]
    out = torch.empty_like(x)
    requests = read_lines.shape[0]
    if requests == 0 or n == 0:
        return out
    grid = (requests * heads * triton.cdiv(head_dim, BP),)
    _selective_state_scan_kernel[grid](x, dt, a, b, c, d, out, states, read_lines, read_entries, first_tokens,
                                       token_counts, write_lines, write_entries, states.stride(0), states.stride(1),
                                       HEADS=heads, GROUPS=groups, HEAD_DIM=head_dim, SIZE=size, BP_=BP,
                                       BN=triton.next_power_of_2(size), num_warps=2)
    return out


@triton.jit
def _causal_conv_window_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, states_ptr, read_lines_ptr, read_entries_ptr,
                               first_ptr, count_ptr, write_lines_ptr, write_entries_ptr, channels, line_stride,
                               entry_stride, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                               BC_: tl.constexpr):
    pid = tl.program_id(0)
    nc = tl.cdiv(channels, BC_)
    i_c, r = pid % nc, pid // nc
    o_c = i_c * BC_ + tl.arange(0, BC_)
    mask_c = o_c < channels
    line = tl.load(read_lines_ptr + r)
    first = tl.load(first_ptr + r)
    count = tl.load(count_ptr + r)
    for start in range(0, count, BT):
        t = start + tl.arange(0, BT)  # the tile's tokens: their index among the request's
        rows = t < count
        mask = rows[:, None] & mask_c[None, :]
        at = (first + t)[:, None] * channels + o_c[None, :]
        acc = tl.zeros([BT, BC_], dtype=tl.float32)
        for i in tl.static_range(K - 1):  # the inputs before each token's own, oldest first
            back = K - 1 - i
            inside = rows & (t >= back)  # an earlier token of this forward, else the ring (t < back: first tile)
            u = tl.load(x_ptr + at - back * channels, mask=inside[:, None] & mask_c[None, :], other=0.0)
            ringed = rows & (t < back)
            entry = tl.load(read_entries_ptr + r * (K - 1) + i + t, mask=ringed, other=-1)  # position t - back
            cached = tl.load(states_ptr + line * line_stride + tl.maximum(entry, 0)[:, None] * entry_stride
                             + o_c[None, :], mask=(entry >= 0)[:, None] & mask_c[None, :], other=0.0)
            u = tl.where(inside[:, None], u, cached)
            w = tl.load(w_ptr + o_c * K + i, mask=mask_c, other=0.0).to(tl.float32)
            acc += u.to(tl.float32) * w[None, :]
        own = tl.load(x_ptr + at, mask=mask, other=0.0)
        w = tl.load(w_ptr + o_c * K + K - 1, mask=mask_c, other=0.0).to(tl.float32)
        acc += own.to(tl.float32) * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # this tile's ring reads before any of its writes (module docstring)
        to_line = tl.load(write_lines_ptr + first + t, mask=rows, other=0)
        to_entry = tl.load(write_entries_ptr + first + t, mask=rows, other=0)
        tl.store(states_ptr + (to_line * line_stride + to_entry * entry_stride)[:, None] + o_c[None, :], own,
                 mask=mask)


def causal_conv_window(x, weight, bias, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                       write_entries):
    n, channels = x.shape
    out = torch.empty_like(x)
    requests = read_lines.shape[0]
    if requests == 0 or n == 0:
        return out
    # tiles of about a request's tokens (a round's window: one tile; a prompt chunk: up to MAX_BT a tile)
    tile = min(MAX_BT, max(8, triton.next_power_of_2(triton.cdiv(n, requests))))
    grid = (requests * triton.cdiv(channels, BC),)
    _causal_conv_window_kernel[grid](x, weight, x if bias is None else bias, out, states, read_lines, read_entries,
                                     first_tokens, token_counts, write_lines, write_entries, channels,
                                     states.stride(0), states.stride(1), K=weight.shape[1], HAS_BIAS=bias is not None,
                                     BT=tile, BC_=BC, num_warps=4)
    return out
