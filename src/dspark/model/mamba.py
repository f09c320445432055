"""Mamba-1 mixers on the engine's flat ragged tokens, exactly as transformers runs them: pure Mamba
(``MambaMixer``), FalconMamba (``FalconMambaMixer``: weightless RMS norms on dt, B and C) and
Jamba's Mamba layers (``JambaMambaMixer``: RMS norms with weights on dt, B and C).

A Mamba-1 layer is a short causal conv1d over the expanded channels, then a selective scan whose
state is ``[intermediate_size, d_state]`` per line (a ``d_state`` vector per channel, unlike
Mamba-2's per-head scalar decay). Its states live in ``hybrid``'s rings like every other stateful
mixer's (``hybrid.causal_conv`` for the conv inputs, ``hybrid.state_scan`` for the state after each
position), so rollback is the engine choosing its anchor, as there. The step is the modeling file's
``mamba_selective_state_update`` -- transformers' own recurrent step, which it maps to mamba-ssm's
``selective_state_update`` kernel where that is installed; elsewhere its PyTorch reference. Prompt
chunks are scanned whole by ``selective_chunk_scan`` (PyTorch on every device: mamba-ssm's
``selective_scan_fn`` starts from a zero state, and a chunk continues its line's state): runs of
``SCAN_RUN`` positions, each a Hillis-Steele scan of (decay, input) pairs.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

__all__ = ["MAMBA1", "MAMBA1_MIXERS", "SCAN_RUN", "mamba1", "selective_chunk_scan"]

MAMBA1 = "Mamba-1"
# the Mamba-1 mixer classes run here (by class name, as ``hybrid`` registers mixers)
MAMBA1_MIXERS = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")

# after the names ``hybrid`` reads while it is imported (it imports this module first)
from . import hybrid  # noqa: E402
# positions the chunked selective scan combines at once (log2 of it rounds over [R, SCAN_RUN, channels,
# d_state] each): on this CPU 16 ran a 512-token scan in half the time of 256 (memory traffic)
SCAN_RUN = 16
# a decay factor of at most this counts as 0 in the chunked selective scan (``_negligible_as_zero``)
NEGLIGIBLE_DECAY = 2.0 ** -60


def mamba1(module, hidden: torch.Tensor, states: "hybrid.LayerStates", current: "hybrid.Forward") -> torch.Tensor:
    """A Mamba-1 mixer on ``hidden`` ``[N, H]`` (its forward, less the cache): ``in_proj`` -> conv input
    | gate; the conv on the engine's states and the activation; ``x_proj`` -> dt | B | C (FalconMamba,
    Jamba: each RMS-normed); dt through ``dt_proj``, then softplus (as transformers' step computes
    them); the selective scan with the ``D`` skip and the SiLU gate -- the selective state update
    position by position, prompt chunks by ``selective_chunk_scan`` (``hybrid.CHUNKED_PROMPTS``);
    ``out_proj``. Returns ``[N, H]`` in ``hidden``'s dtype."""
    x, gate = module.in_proj(hidden).chunk(2, dim=-1)
    x = module.act(hybrid.causal_conv(x, module.conv1d, states.conv, current))
    size = module.ssm_state_size
    dt, b, c = module.x_proj(x).split([module.time_step_rank, size, size], dim=-1)
    if hasattr(module, "dt_layernorm"):  # FalconMamba, Jamba
        dt, b, c = module.dt_layernorm(dt), module.b_layernorm(b), module.c_layernorm(c)
    dt = F.linear(dt, module.dt_proj.weight)
    if module.dt_proj.bias is not None:
        dt = dt + module.dt_proj.bias.to(dt.dtype)
    # before the scan, as transformers' step computes it: a padded prompt position (dt = 0) keeps the state
    dt = F.softplus(dt)
    a = -torch.exp(module.A_log.float())
    update = sys.modules[type(module).__module__].mamba_selective_state_update

    def step(state, x_t, dt_t, b_t, c_t, gate_t):
        after = state.clone()  # updated in place
        out = update(after, x_t, dt_t, a, b_t, c_t, module.D, z=gate_t)
        return out, after

    def chunked(state, x_t, dt_t, b_t, c_t, gate_t):  # whole prompt chunks [R, T, ...]
        return selective_chunk_scan(state, x_t, dt_t, a, b_t, c_t, module.D, gate_t)

    scan = hybrid.state_scan(step, (x, dt, b, c, gate), states.recurrent, current,
                             chunked if hybrid.CHUNKED_PROMPTS else None)
    return module.out_proj(scan.to(hidden.dtype))


def selective_chunk_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         c: torch.Tensor, d: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-1 selective scan of whole sequences from ``state`` f32 ``[R, D, S]`` (``D`` channels,
    ``S`` = d_state): ``h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t``, ``y_t = (h_t C_t + d x_t) silu(gate_t)``
    -- the step's arithmetic (f32 decays and inputs, as ``mamba_selective_state_update``), reassociated:
    ``SCAN_RUN`` positions at a time, within which the pairs (decay, input) are combined by
    a Hillis-Steele scan (products of decays, never an exponential of a sum that could overflow), the
    state carried from run to run. ``x``, ``dt`` (after bias and softplus), ``gate`` ``[R, T, D]``;
    ``b``, ``c`` ``[R, T, S]``; ``a`` f32 ``[D, S]``; ``d`` ``[D]``. Returns ``(y [R, T, D] in x's dtype,
    the state after the last position f32 [R, D, S])``. (mamba-ssm's ``selective_scan_fn`` takes no
    initial state, so it cannot continue a line's earlier chunks.)"""
    outputs = []
    for lo in range(0, x.shape[1], SCAN_RUN):
        part = slice(lo, lo + SCAN_RUN)
        dt_part = dt[:, part].float()[..., None]  # [R, L, D, 1]
        # exponents floored below the negligible ones (their factors then zeroed): no subnormal results
        decay = _negligible_as_zero(torch.exp((dt_part * a).clamp(min=math.log(NEGLIGIBLE_DECAY) - 1)))
        inputs = dt_part * b[:, part].float()[:, :, None, :] * x[:, part].float()[..., None]
        inputs[:, 0] += decay[:, 0] * state
        states = _linear_recurrence(decay, inputs)  # [R, L, D, S]
        state = states[:, -1]
        outputs.append((states.to(c.dtype) @ c[:, part, :, None])[..., 0])
    y = torch.cat(outputs, dim=1) + x * d
    return (y * F.silu(gate)).to(x.dtype), state


def _negligible_as_zero(decay: torch.Tensor) -> torch.Tensor:
    """``decay`` with factors of at most ``NEGLIGIBLE_DECAY`` set to 0, in place: each changes a state by
    under 1e-18 of the earlier state it scales (the sequential step keeps it), and the products of the
    others stay normal numbers -- the CPU computes with subnormal ones tens of times slower."""
    return decay.masked_fill_(decay <= NEGLIGIBLE_DECAY, 0.0)


def _linear_recurrence(decay: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``h_t = decay_t h_{t-1} + inputs_t`` from ``h_{-1} = 0`` along dim 1 of ``[R, L, ...]``, all ``t`` at
    once: log2(L) rounds, round ``k`` folding each position's pair into the one ``2^k`` positions later
    (``inputs`` and ``decay`` are overwritten)."""
    shift = 1
    while shift < decay.shape[1]:
        inputs[:, shift:] = decay[:, shift:] * inputs[:, :-shift] + inputs[:, shift:]  # the right side first
        decay[:, shift:] = _negligible_as_zero(decay[:, shift:] * decay[:, :-shift])
        shift *= 2
    return inputs
