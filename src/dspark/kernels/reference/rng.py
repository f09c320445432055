"""Reference request-stable uniforms (contract: ``dspark.kernels.rng``)."""

from __future__ import annotations

import torch

from .sampling import UNIFORM_MAX, _as_int64, _shift_right, splitmix64

__all__ = ["request_uniforms"]

_POSITION_SALT = 0xD1B54A32D192ED03
_LANE_SALT = 0xDB4F0B9175AE2165


def _mix_int(value: int) -> int:
    """SplitMix64 of one unsigned 64-bit int, as an int64 bit pattern."""
    return int(splitmix64(torch.tensor([_as_int64(value)], dtype=torch.int64))[0])


def request_uniforms(seeds, positions, purpose, lane, out):
    pos = positions.long()[:, None] + torch.arange(out.shape[1], device=seeds.device)
    constant = _mix_int(purpose) ^ _mix_int((lane + _LANE_SALT) % 2**64)
    bits = splitmix64(splitmix64(seeds)[:, None] ^ splitmix64(pos + _as_int64(_POSITION_SALT)) ^ constant)
    # (m + 0.5) needs 25 bits: f32 rounds the top code up to 1.0, so clamp to the largest uniform below 1
    out.copy_(((_shift_right(bits, 40).float() + 0.5) * 2.0**-24).clamp(max=UNIFORM_MAX))
