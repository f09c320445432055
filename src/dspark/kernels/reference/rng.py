"""Reference request-stable uniforms (contract: ``dspark.kernels.rng``)."""

from __future__ import annotations

import torch

from .._shared import UNIFORM_MAX
from .sampling import _as_int64, _shift_right, splitmix64

__all__ = ["request_uniforms"]

POSITION_SALT = 0xD1B54A32D192ED03
LANE_SALT = 0xDB4F0B9175AE2165


def mix_int(value: int) -> int:
    """SplitMix64 of one unsigned 64-bit int, as an unsigned int."""
    return int(splitmix64(torch.tensor([_as_int64(value % 2**64)], dtype=torch.int64))[0]) % 2**64


def request_uniforms(seeds, positions, purpose, first_lane, out):
    lanes = torch.arange(first_lane, first_lane + out.shape[1], dtype=torch.int64, device=seeds.device)
    per_row = splitmix64(seeds) ^ splitmix64(positions.long() + _as_int64(POSITION_SALT)) ^ _as_int64(mix_int(purpose))
    bits = splitmix64(per_row[:, None] ^ splitmix64(lanes + _as_int64(LANE_SALT))[None, :])
    # (m + 0.5) needs 25 bits: f32 rounds the top code up to 1.0, so clamp to the largest uniform below 1
    out.copy_(((_shift_right(bits, 40).float() + 0.5) * 2.0**-24).clamp(max=UNIFORM_MAX))
