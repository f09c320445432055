"""Mamba-1 mixers on the engine's flat ragged tokens, exactly as transformers runs them: pure Mamba
(``MambaMixer``), FalconMamba (``FalconMambaMixer``: weightless RMS norms on dt, B and C) and
Jamba's Mamba layers (``JambaMambaMixer``: RMS norms with weights on dt, B and C).

A Mamba-1 layer is a short causal conv1d over the expanded channels, then a selective scan whose
state is ``[intermediate_size, d_state]`` per line (a ``d_state`` vector per channel, unlike
Mamba-2's per-head scalar decay). Its states live in ``hybrid``'s rings like every other stateful
mixer's (``hybrid.causal_conv`` for the conv inputs, ``hybrid.state_scan`` for the state after each
position), so rollback is the engine choosing its anchor, as there. The step is the modeling file's
``mamba_selective_state_update`` -- transformers' own recurrent step, which it maps to mamba-ssm's
``selective_state_update`` kernel where that is installed; elsewhere its PyTorch reference.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import hybrid

__all__ = ["MAMBA1", "MAMBA1_MIXERS", "mamba1"]

MAMBA1 = "Mamba-1"
# the Mamba-1 mixer classes run here (by class name, as ``hybrid`` registers mixers)
MAMBA1_MIXERS = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")


def mamba1(module, hidden: torch.Tensor, states: "hybrid.LayerStates", current: "hybrid.Forward") -> torch.Tensor:
    """A Mamba-1 mixer on ``hidden`` ``[N, H]`` (its forward, less the cache): ``in_proj`` -> conv input
    | gate; the conv on the engine's states and the activation; ``x_proj`` -> dt | B | C (FalconMamba,
    Jamba: each RMS-normed); dt through ``dt_proj``'s weight (its bias goes into the step, as
    transformers passes it); the selective state update position by position, with the ``D`` skip
    and the SiLU gate; ``out_proj``. Returns ``[N, H]`` in ``hidden``'s dtype."""
    x, gate = module.in_proj(hidden).chunk(2, dim=-1)
    x = module.act(hybrid.causal_conv(x, module.conv1d, states.conv, current))
    size = module.ssm_state_size
    dt, b, c = module.x_proj(x).split([module.time_step_rank, size, size], dim=-1)
    if hasattr(module, "dt_layernorm"):  # FalconMamba, Jamba
        dt, b, c = module.dt_layernorm(dt), module.b_layernorm(b), module.c_layernorm(c)
    dt = F.linear(dt, module.dt_proj.weight)
    a = -torch.exp(module.A_log.float())
    dt_bias = None if module.dt_proj.bias is None else module.dt_proj.bias.float()
    update = sys.modules[type(module).__module__].mamba_selective_state_update

    def step(state, x_t, dt_t, b_t, c_t, gate_t):
        after = state.clone()  # updated in place
        out = update(after, x_t, dt_t, a, b_t, c_t, module.D, z=gate_t, dt_bias=dt_bias, dt_softplus=True)
        return out, after

    scan = hybrid.state_scan(step, (x, dt, b, c, gate), states.recurrent, current)
    return module.out_proj(scan.to(hidden.dtype))
