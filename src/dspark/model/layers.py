"""The decoder-layer pieces, one of each, that the target (``llama.TargetLM``) and the draft
(``draft_runner``: the engine's and training's forward) share: on *flat* rows ``[N, ...]``, merged
QKV and gate/up projections, the ``dspark.kernels.layers`` ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels as K

__all__ = ["KVCache", "rope_inv_freq", "rms_norm", "attention", "swiglu", "decoder_layer"]


class KVCache:
    """K and V of every layer in blocks: ``k[layer]`` / ``v[layer]`` ``[num_blocks, block_size, n_kv,
    d]``. Line (slot) ``s`` holds position ``p`` at block ``block_table[s, p // block_size]``, row ``p %
    block_size`` (``block_table`` int32 ``[num_slots, blocks_per_line]``, on the cache's device); the
    engine's lines share one table between the target's and the draft's caches and change it as
    requests take and free blocks. ``KVCache.contiguous``: one block of ``max_len`` rows per line.
    ``states``: a hybrid target's layer states beside the K/V (``hybrid.StatePool``; None: none)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, block_table: torch.Tensor):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table, self.block_size = block_table, block_size
        self.states = None

    @classmethod
    def contiguous(cls, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device) -> "KVCache":
        """``num_slots`` lines of ``max_len`` positions, each its own block (``k`` ``[L, num_slots,
        max_len, n_kv, d]``)."""
        table = torch.arange(num_slots, dtype=torch.int32, device=device)[:, None]
        return cls(num_layers, num_slots, max_len, num_kv_heads, head_dim, dtype, device, table)

    @property
    def num_slots(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def index(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(blocks, rows)`` int64 of positions ``positions`` of lines ``slots`` (int ``[N]``): what
        ``k[layer][blocks, rows]`` reads and writes."""
        positions = positions.long()
        return self.block_table[slots.long(), positions // self.block_size].long(), positions % self.block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Default RoPE frequencies f32 ``[head_dim/2]``: ``theta ** (-2i / head_dim)``, computed as
    transformers does (int64 exponents, then float), so the tables match it bit for bit."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``K.rms_norm`` (fused residual add when ``residual`` is given) with ``x`` first cast to the
    weight's dtype: a no-op at inference; under training's autocast the GEMMs give bf16 rows while
    the parameters, hence the normed rows and the residual stream, stay fp32."""
    return K.rms_norm(x.to(weight.dtype), weight, eps, residual=residual)


def attention(layer: dict, x: torch.Tensor, num_heads: int, positions, lines, cos_sin, k_line, v_line, eps: float,
              attend, rows=None, block_table=None) -> torch.Tensor:
    """Self-attention of rows ``x`` ``[N, H]`` -> ``[N, H]``: the merged projection ``layer["qkv"]``
    (+ ``"qkv_bias"``), per-head q/k RMSNorm (``"q_norm"``/``"k_norm"`` ``[d]``, when present) and
    RoPE (``cos_sin``), the K/V written into ``k_line``/``v_line`` ``[lines, rows, n_kv, d]`` (or
    blocks, through ``block_table``: ``K.qk_norm_rope_store``) at ``lines`` int ``[N]``, row ``rows``
    int ``[N]`` (default: ``positions``); then the mode's ``attend(q [N, n_q, d]) -> [N, n_q, d]``
    and ``layer["o"]``."""
    n, (kv_heads, d) = x.shape[0], k_line.shape[2:]
    q, k, v = F.linear(x, layer["qkv"], layer.get("qkv_bias")).split([num_heads * d, kv_heads * d, kv_heads * d], 1)
    q_norm, k_norm = (None if layer.get(name) is None else layer[name].to(k_line.dtype) for name in ("q_norm", "k_norm"))
    q = K.qk_norm_rope_store(q.view(n, num_heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d), positions, lines,
                             cos_sin, k_line, v_line, q_norm_weight=q_norm, k_norm_weight=k_norm, eps=eps,
                             cache_positions=rows, block_table=block_table)
    return F.linear(attend(q).reshape(n, num_heads * d), layer["o"])


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP ``down(silu(gate x) * up x)`` of rows ``[N, H]`` with the merged ``gate_up``
    ``[2I, H]`` and ``down`` ``[H, I]`` weights."""
    return F.linear(K.silu_and_mul(F.linear(x, gate_up)), down)


def decoder_layer(layer: dict, h: torch.Tensor, residual: torch.Tensor | None, eps: float, attention, mlp,
                  on_input=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer on flat rows (the target's and the draft's): ``(h, residual)`` of the
    previous layer (``residual`` None for the first) -> this layer's. The residual adds are fused into
    the RMSNorms (HF op order; ``layer["input_norm"]``, ``layer["post_norm"]`` ``[H]``);
    ``attention(x)`` and ``mlp(x)`` map the normed rows ``[N, H]`` to ``[N, H]``; ``on_input(hidden)``
    sees the layer's input hidden states (HF ``hidden_states[i]``)."""
    if residual is None:
        residual, x = h, rms_norm(h, layer["input_norm"], eps)
    else:
        x, residual = rms_norm(h, layer["input_norm"], eps, residual=residual)
    if on_input is not None:
        on_input(residual)
    x, residual = rms_norm(attention(x), layer["post_norm"], eps, residual=residual)
    return mlp(x), residual
