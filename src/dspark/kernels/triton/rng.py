"""Triton request-stable uniforms (contract: ``dspark.kernels.rng``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference.rng import _mix_int, _LANE_SALT

__all__ = ["request_uniforms"]


@triton.jit
def _mix(x):
    x = x + 0x9E3779B97F4A7C15  # SplitMix64; uint64 makes every >> logical and every op wrap mod 2^64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _request_uniforms_kernel(seeds_ptr, positions_ptr, out_ptr, out_stride, count, constant,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    pos = (tl.load(positions_ptr + row).to(tl.int64) + j).to(tl.uint64)
    bits = _mix(_mix(seed) ^ _mix(pos + 0xD1B54A32D192ED03) ^ constant.to(tl.uint64))
    u = (((bits >> 40) & 0xFFFFFF).to(tl.float32) + 0.5) * 5.9604644775390625e-08
    u = tl.minimum(u, 0.99999994)  # f32 rounds the top code up to 1.0 (see the reference)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + j, u, mask=j < count)


def request_uniforms(seeds, positions, purpose, lane, out):
    batch, count = out.shape
    if batch and count:
        constant = (_mix_int(purpose) ^ _mix_int((lane + _LANE_SALT) % 2**64)) % 2**64
        block = min(1024, triton.next_power_of_2(count))
        _request_uniforms_kernel[(batch, triton.cdiv(count, block))](
            seeds, positions, out, out.stride(0), count, constant, BLOCK=block)
