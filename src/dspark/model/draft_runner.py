"""The draft model's one forward (runtime.md §2.4-2.6), for inference and training alike.

Over K/V lines (``[lines, rows, n_kv, d]`` per layer) and flat rows, with the ``layers`` pieces:
``write_context`` projects captured target states (``c = hidden_norm(fc(concat h))``) and writes
every layer's context K/V (``RoPE(k_norm(k_proj c))``, ``v_proj c``); ``run_block`` runs blocks
``[anchor, mask, ...]`` (anchor p's at positions ``p .. p+N-1``) through the layers, each writing the
block's K/V and then attending through ``attend``, the one op the mode chooses:

* inference (``DraftRunner``, the engine's batched draft; ``forward_block`` on one line): a paged
  cache, row = position, ``attend`` = ``cached_attention`` (the visibility of ``draft.py``'s step 2).
  Rows a verification rejects may be written: the next block overwrites them before anything reads
  them (vLLM's rule). No host synchronisation, fixed shapes per batch size: CUDA-graph capturable;
* training (``trainer.block_hidden``): a line per token row, its context then its A blocks (rows
  ``S + a*N + k``), ``attend`` = SDPA or FlexAttention under the training mask (§2.5).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .. import kernels as K
from .layers import KVCache, attention, decoder_layer, rms_norm, rope_inv_freq, swiglu

__all__ = ["DraftRunner", "draft_cache", "layer_weights", "write_context", "run_block"]


def layer_weights(layer: torch.nn.Module, mlp) -> dict:
    """The merged weights of a ``DraftLayer`` that the forward reads: norms ``[H]``, ``qkv``
    ``[(n_q + 2 n_kv) d, H]`` (``kv`` its K/V rows), ``o``, ``q_norm``/``k_norm`` ``[d]``, and
    ``mlp(x)``: the layer's MLP (training calls the module, whose forward merges gate/up each call,
    so that FSDP gathers it; inference merges them once)."""
    attn = layer.self_attn
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    return dict(input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                qkv=qkv, kv=qkv[attn.q_proj.weight.shape[0]:], o=attn.o_proj.weight,
                q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight, mlp=mlp)


def write_context(model, weights: list[dict], hidden, positions, lines, k_lines, v_lines, cos_sin,
                  block_table=None) -> None:
    """Write the context K/V of ``M`` tokens: ``hidden`` ``[M, m*H]`` captured target states,
    ``positions`` / ``lines`` int ``[M]`` (RoPE position = row, and line); ``k_lines[i]`` /
    ``v_lines[i]`` layer i's ``[lines, rows, n_kv, d]`` (or blocks through ``block_table``, as
    ``K.qk_norm_rope_store``); ``cos_sin`` from ``K.rope_cos_sin_table``."""
    cfg = model.config
    c = rms_norm(F.linear(hidden.to(model.dtype), model.fc.weight), model.hidden_norm.weight, cfg.rms_norm_eps)
    m, d, kv_size = c.shape[0], cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i, w in enumerate(weights):
        k, v = (t.view(m, cfg.num_key_value_heads, d) for t in F.linear(c, w["kv"]).split(kv_size, 1))
        K.qk_norm_rope_store(None, k, v, positions, lines, cos_sin, k_lines[i], v_lines[i],
                             k_norm_weight=w["k_norm"].to(k.dtype), eps=cfg.rms_norm_eps, block_table=block_table)


def run_block(model, weights: list[dict], ids, positions, lines, k_lines, v_lines, cos_sin, attend,
              rows=None, block_table=None) -> torch.Tensor:
    """Final-norm hidden states ``[R, H]`` of block rows ``ids`` int ``[R]`` at ``positions`` int
    ``[R]`` of lines ``lines`` int ``[R]`` (their K/V written at row ``rows`` int ``[R]``, default the
    position; lines through ``block_table`` as ``write_context``). ``attend(i, q, k_line, v_line)`` ->
    ``[R, n_q, d]``: layer i's attention of the rotated queries ``q`` ``[R, n_q, d]`` over its lines
    (the block's K/V already in them)."""
    cfg = model.config
    h, residual = model.embed_tokens(ids), None
    for i, w in enumerate(weights):
        h, residual = decoder_layer(
            w, h, residual, cfg.rms_norm_eps,
            lambda x, i=i, w=w: attention(w, x, cfg.num_attention_heads, positions, lines, cos_sin, k_lines[i],
                                          v_lines[i], cfg.rms_norm_eps,
                                          lambda q: attend(i, q, k_lines[i], v_lines[i]), rows, block_table),
            w["mlp"])
    x, _ = rms_norm(h, model.norm.weight, cfg.rms_norm_eps, residual=residual)
    return x


def draft_cache(model, num_slots: int = 0, max_len: int = 0,
                paged: tuple[int, int, torch.Tensor] | None = None) -> KVCache:
    """The K/V of a ``DSparkDraftModel``: ``num_slots`` contiguous lines of ``max_len`` positions, or
    ``paged`` = ``(num_blocks, block_size, block_table)`` blocks shared through a block table."""
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    if paged is None:
        return KVCache.contiguous(shape[0], num_slots, max_len, *shape[1:], model.dtype, model.device)
    num_blocks, block_size, table = paged
    return KVCache(shape[0], num_blocks, block_size, *shape[1:], model.dtype, model.device, table)


class DraftRunner:
    """The batched inference forward of a ``DSparkDraftModel`` over a KV cache of lines
    (``draft_cache``; weights shared, merged projections built once)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        """``model``: a ``DSparkDraftModel`` (``draft.py`` builds its caches' runners from this
        module, so it is not imported here)."""
        cfg = model.config
        self.model, self.config = model, cfg
        self.block_size = cfg.block_size
        self.cache = cache
        with torch.no_grad():
            self.layers = [layer_weights(layer, _merged_mlp(layer.mlp)) for layer in model.layers]
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, model.device)
        self.cos_sin = K.rope_cos_sin_table(self.inv_freq, cache.max_len)
        self.block_offsets = torch.arange(self.block_size, dtype=torch.int32, device=model.device)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def grow(self, max_len: int) -> None:
        """Reallocate contiguous cache lines to ``max_len`` positions, keeping what they hold (eager
        use only: a captured graph keeps the old buffers)."""
        old = self.cache
        self.cache = draft_cache(self.model, old.num_slots, max_len)
        keep = min(old.max_len, max_len)
        self.cache.k[:, :, :keep] = old.k[:, :, :keep]
        self.cache.v[:, :, :keep] = old.v[:, :, :keep]
        self.cos_sin = K.rope_cos_sin_table(self.inv_freq, max_len)

    @torch.inference_mode()
    def context(self, hidden: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Write the context K/V of ``M`` tokens: ``hidden`` ``[M, m*H]`` captured target states,
        ``positions`` / ``token_slots`` int ``[M]``."""
        write_context(self.model, self.layers, hidden, positions, token_slots, self.cache.k, self.cache.v,
                      self.cos_sin, self.cache.block_table)

    @torch.inference_mode()
    def block(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states ``[B*N, H]`` (model dtype) of each request's block; ``anchors``,
        ``anchor_positions``, ``slot_ids`` int32 ``[B]``. Row ``b*N + k`` is slot k of request b."""
        cfg = self.config
        batch, n = anchors.shape[0], self.block_size
        ids = torch.full((batch, n), cfg.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = (anchor_positions[:, None] + self.block_offsets).view(-1)
        cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=anchors.device)

        def attend(i, q, k_line, v_line):
            window = cfg.layer_window(i)
            starts = None if window is None else (anchor_positions - window).clamp(min=0)
            return K.cached_attention(q, k_line, v_line, slot_ids, anchor_positions, cu, n,
                                      causal=cfg.layer_is_causal(i), window_starts=starts,
                                      block_table=self.cache.block_table)

        return run_block(self.model, self.layers, ids.view(-1), positions, slot_ids.repeat_interleave(n),
                         self.cache.k, self.cache.v, self.cos_sin, attend, block_table=self.cache.block_table)


def _merged_mlp(mlp: torch.nn.Module):
    """``swiglu`` with the gate/up weights merged once (inference: the weights do not change)."""
    return partial(swiglu, gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), down=mlp.down_proj.weight)
