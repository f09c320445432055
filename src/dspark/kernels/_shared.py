"""Constants and bounds of the kernel contracts (kernels.md), shared by the public functions and both
backends so that each is written once.

``GREEDY_TEMPERATURE`` is public (``dspark.kernels.GREEDY_TEMPERATURE``): callers deciding whether a
temperature means greedy decoding should compare against it rather than repeat the literal.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------------------ token ids and Markov ranks

MAX_TOKEN_ID = 2**31 - 1  # token ids are int32
MAX_FUSED_RANK = 512  # the fused greedy step (fp16/bf16 W2) takes 0 < R <= 512, R % 8 == 0 (kernels.md 3.13)
FP8_RANKS = (16, 32, 64, 128, 256, 512)  # ranks of the FP8 fused greedy step (kernels.md 3.16)
FP8_E4M3_MAX = 448.0  # largest finite E4M3 magnitude: the per-row quantisation scale is absmax / 448

# ------------------------------------------------------------------------------ sampling

GREEDY_TEMPERATURE = 1e-3  # T below it: invTemp(T) = 1 and logits_to_probabilities keeps only the argmax
NUCLEUS_OFF = 1 - 1e-6  # top_p at or above it disables top-p (kernels.md 3.9)
TINY = 1e-20  # the C++ "no mass" threshold of normalisers, ratios and residual sums
UNIFORM_MAX = 0.99999994  # 1 - 2^-24 as fp32 (bits 0x3F7FFFFF): clampUniform's upper bound

# ------------------------------------------------------------------------------ SPS scheduler (kernels.md 3.7)

SPS_DRAFT_COST = 0.50
SPS_VERIFY_BASE_COST = 1.00
SPS_VERIFY_TOKEN_COST = 0.45  # per verified token (verify length L + 1)
SPS_ACCEPT_COST = 0.02  # per proposed token
SPS_MIN_COST = 1e-6  # scores divide by max(cost, 1e-6)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)``."""
    return 1 << max(0, int(n) - 1).bit_length()


def length_bounds(width: int, min_proposal_len: int, max_proposal_len: int) -> tuple[int, int]:
    """``(cMin, cMax)`` of kernels.md 3.6: ``cMin = clamp(min, 1, P)``, ``cMax = max(cMin, min(P, max or P))``
    (``max_proposal_len <= 0`` means P)."""
    c_min = max(1, min(width, min_proposal_len))
    c_max = max(c_min, min(width, width if max_proposal_len <= 0 else max_proposal_len))
    return c_min, c_max


def inv_temperature(temperature: float) -> float:
    """NVIDIA's ``invTemp(T)``: 1 below ``GREEDY_TEMPERATURE``, else the fp32 quotient ``1/T`` (an fp32
    value, exact as a Python float)."""
    if temperature < GREEDY_TEMPERATURE:
        return 1.0
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32))


def filter_settings(temperature: float, top_k: int, top_p: float, vocab: int) -> tuple[float, int, float]:
    """``(inv_temp, k, p)`` of kernels.md 3.9 for a row of ``vocab`` entries: ``k = 0`` means no top-k
    (``top_k`` 0 or ``>= V``; the public functions map ``top_k < 0`` to 0), ``p = 1`` no top-p; a
    temperature below ``GREEDY_TEMPERATURE`` is the one-hot argmax (``k = 1``)."""
    if temperature < GREEDY_TEMPERATURE:
        return 1.0, 1, 1.0
    k = top_k if 0 < top_k < vocab else 0
    return inv_temperature(temperature), k, (top_p if top_p < NUCLEUS_OFF else 1.0)


def row_filter_settings(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """``filter_settings`` of every row at once: f32 ``[rows, 3]`` ``(inv_temp, k, p)`` from ``[rows]``
    temperatures, top-k and top-p, computed with device ops (no host synchronisation; a CUDA graph
    can hold it). ``inv_temp`` is the fp32 quotient ``1/T``, as ``inv_temperature``."""
    t = temperature.float()
    greedy = t < GREEDY_TEMPERATURE
    inv_temp = torch.where(greedy, torch.ones_like(t), torch.div(torch.ones_like(t), t))
    k = top_k.float()
    k = torch.where(greedy, torch.ones_like(k), torch.where((k > 0) & (k < vocab), k, torch.zeros_like(k)))
    p = top_p.float()
    p = torch.where(greedy | (p >= NUCLEUS_OFF), torch.ones_like(p), p)
    return torch.stack([inv_temp, k, p], dim=1)

