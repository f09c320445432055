"""Triton request-stable uniforms (contract: ``dspark.kernels.rng``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference.rng import mix_int

__all__ = ["request_uniforms"]


@triton.jit
def _mix(x):
    x = x + 0x9E3779B97F4A7C15  # SplitMix64; uint64 makes every >> logical and every op wrap mod 2^64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _request_uniforms_kernel(seeds_ptr, positions_ptr, out_ptr, out_stride, count, first_lane, purpose_mix,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    pos = tl.load(positions_ptr + row).to(tl.int64).to(tl.uint64)
    lane = (first_lane + j).to(tl.uint64)
    per_row = _mix(seed) ^ _mix(pos + 0xD1B54A32D192ED03) ^ purpose_mix.to(tl.uint64)
    bits = _mix(per_row ^ _mix(lane + 0xDB4F0B9175AE2165))
    u = (((bits >> 40) & 0xFFFFFF).to(tl.float32) + 0.5) * 5.9604644775390625e-08
    u = tl.minimum(u, 0.99999994)  # f32 rounds the top code up to 1.0 (see the reference)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + j, u, mask=j < count)


def request_uniforms(seeds, positions, purpose, first_lane, out):
    batch, count = out.shape
    if batch and count:
        block = min(1024, triton.next_power_of_2(count))
        _request_uniforms_kernel[(batch, triton.cdiv(count, block))](
            seeds, positions, out, out.stride(0), count, first_lane, mix_int(purpose), BLOCK=block)
