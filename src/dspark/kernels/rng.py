"""Request-stable randomness (TensorRT-Edge-LLM's ``requestStableRng.h``, runtime.md).

Every uniform is derived from the request alone -- its seed, the absolute position of the token
being decided and the draw's purpose -- never from its batch slot or the round. The same request
and seed therefore give the same tokens alone or inside any batch, a CUDA-graph replay draws fresh
uniforms (seeds and positions are device tensors), and a rollback re-draws the same uniforms for
the same positions::

    mix(x) = SplitMix64 finaliser (mod 2^64)
    bits   = mix(mix(seed) ^ mix(pos + 0xD1B54A32D192ED03) ^ mix(purpose) ^ mix(lane + 0xDB4F0B9175AE2165))
    u      = (((bits >> 40) & 0xFFFFFF) + 0.5) * 2^-24          in (0, 1), never 0 or 1

In f32 the top code rounds to 1.0; it is clamped to 1 - 2^-24 (the largest f32 below 1).
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._validate import Checker

__all__ = ["request_uniforms", "PURPOSE_TARGET_SAMPLE", "PURPOSE_PROPOSAL", "PURPOSE_ACCEPT",
           "PURPOSE_RESIDUAL", "PURPOSE_BONUS", "PURPOSE_TREE"]

PURPOSE_TARGET_SAMPLE = 0xD6E8FEB86659FD93
PURPOSE_PROPOSAL = 0xA0761D6478BD642F
PURPOSE_ACCEPT = 0xE7037ED1A0B428DB
PURPOSE_RESIDUAL = 0x8EBC6AF09C88C6E3
PURPOSE_BONUS = 0x589965CC75374CC3
PURPOSE_TREE = 0x1D8E4E27C47D124F  # sampled tree verification: the sibling tests and the residual draws


def request_uniforms(seeds, positions, purpose: int, count: int, *, first_lane: int = 0, out=None):
    """f32 ``[B, count]``: ``out[b, j] = u(seeds[b], positions[b], purpose, first_lane + j)``.

    ``seeds`` int64 ``[B]`` (the bit pattern of each request's unsigned 64-bit seed), ``positions``
    int32/int64 ``[B]`` each request's absolute position that keys the draws (the engine uses the
    round's anchor position, so no uniform is ever drawn twice); ``purpose`` an unsigned 64-bit int
    (the ``PURPOSE_*`` constants); lanes ``first_lane ..`` separate the draws of one purpose at one
    position (e.g. the draft steps). ``out``: an optional f32 ``[B, count]`` buffer (row stride
    free, unit column stride) written in place, e.g. columns of a larger uniform buffer.
    """
    c = Checker("request_uniforms")
    seeds = c.tensor("seeds", seeds, dtype=torch.int64, ndim=1)
    batch = seeds.shape[0]
    positions = c.tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=[batch], device=seeds.device)
    purpose = c.integer("purpose", purpose, low=0, high=2**64 - 1)
    first_lane = c.integer("first_lane", first_lane, low=0, high=2**63 - 1)
    count = c.integer("count", count, low=0)
    if out is None:
        out = torch.empty(batch, count, dtype=torch.float32, device=seeds.device)
    else:
        c.tensor("out", out, dtype=torch.float32, shape=[batch, count], device=seeds.device)
        if count > 1 and out.stride(1) != 1:
            c.fail(f"out must have unit column stride, got strides {list(out.stride())}")
    implementation("request_uniforms", seeds.device)(seeds.contiguous(), positions.contiguous(), purpose, first_lane, out)
    return out
