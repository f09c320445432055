"""Triton recurrent family (contracts: ``dspark.kernels.gated_delta_scan``, ``selective_state_scan``).

One program per (request, head, block of the state's rows) holds its slice of the state in
registers over the request's whole window: one read of the state, one write per token into the
token's ring entry. Gated delta rule: ``[dk, BV]`` slices, flash-linear-attention's fused recurrent
layout and op order (``BV`` 8, one warp; its kernel keeps only the final state). Mamba-2:
``[BP, d_state]`` slices of ``BP`` head_dim rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gated_delta_scan", "selective_state_scan"]

BV = 8  # value columns per program (fla's choice for the fused recurrent kernel)
BP = 16  # Mamba-2 head_dim rows per program (with a d_state of 128: 2,048 f32 of state)


@triton.jit
def _start_state(states_ptr, read_lines_ptr, read_entries_ptr, r, line_stride, entry_stride, in_head, mask):
    """Request ``r``'s slice ``in_head`` of the state it starts from (zero where it reads no entry)."""
    entry = tl.load(read_entries_ptr + r)
    start = tl.load(read_lines_ptr + r) * line_stride + tl.maximum(entry, 0) * entry_stride
    s = tl.load(states_ptr + start + in_head, mask=mask, other=0.0)
    return tl.where(entry >= 0, s, 0.0)


@triton.jit
def _store_state(states_ptr, write_lines_ptr, write_entries_ptr, n, line_stride, entry_stride, in_head, s, mask):
    """The slice ``in_head`` of the state after token ``n`` into that token's ring entry."""
    to = tl.load(write_lines_ptr + n) * line_stride + tl.load(write_entries_ptr + n) * entry_stride
    tl.store(states_ptr + to + in_head, s, mask=mask)


@triton.jit
def _gated_delta_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, states_ptr, read_lines_ptr,
                             read_entries_ptr, first_ptr, count_ptr, write_lines_ptr, write_entries_ptr, scale,
                             line_stride, entry_stride, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BK: tl.constexpr, BV_: tl.constexpr):
    pid = tl.program_id(0)
    nv = tl.cdiv(DV, BV_)
    i_v, i_rh = pid % nv, pid // nv
    r, h = i_rh // HV, i_rh % HV
    o_k = tl.arange(0, BK)
    o_v = i_v * BV_ + tl.arange(0, BV_)
    mask_k, mask_v = o_k < DK, o_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    in_head = h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    s = _start_state(states_ptr, read_lines_ptr, read_entries_ptr, r, line_stride, entry_stride, in_head, mask_s)
    first = tl.load(first_ptr + r)
    count = tl.load(count_ptr + r)
    for t in range(0, count):
        n = first + t
        b_q = tl.load(q_ptr + (n * HV + h) * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + (n * HV + h) * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + (n * HV + h) * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_g = tl.load(g_ptr + n * HV + h)
        b_beta = tl.load(beta_ptr + n * HV + h).to(tl.float32)
        s = s * tl.exp(b_g)
        u = b_beta * (b_v - tl.sum(s * b_k[:, None], 0))
        s = s + b_k[:, None] * u[None, :]
        o = tl.sum(s * b_q[:, None], 0)
        tl.store(out_ptr + (n * HV + h) * DV + o_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)
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
