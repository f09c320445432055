"""The draft model's forward for many requests at once, over a per-slot KV cache.

The draft's one inference forward (runtime.md §2.4-2.6), batched and flat, through the
``dspark.kernels.layers`` ops with merged QKV / gate-up projections; ``DSparkDraftModel.forward_block``
(one request, the tests' and the trainer's reference) runs it on one cache line:

* ``context(hidden, positions, token_slots)`` projects captured target hidden states
  (``c = hidden_norm(fc(concat h))``) and writes every layer's context K/V (``RoPE(k_norm(k_proj c))``,
  ``v_proj c``) at each token's (slot, position). Rows the verification later rejects may be written
  too: they sit at or after the request's next anchor, where the next block overwrites them before
  anything reads them (vLLM's rule);
* ``block(anchors, anchor_positions, slot_ids)`` runs each request's ``[anchor, mask, ...]`` block at
  positions ``p .. p+N-1``: its K/V are written at those positions and its queries attend to the
  context ``< p`` (on sliding layers only ``>= p - W``) and to the block (bidirectional, or causal on
  sliding layers unless ``sliding_window_non_causal``). Returns the final-norm hidden states.

No host synchronisation, fixed shapes per batch size: both calls can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels as K
from .llama import KVCache, decoder_layer

__all__ = ["DraftRunner"]


class DraftRunner:
    """Batched forward of a ``DSparkDraftModel`` (weights shared, merged projections built once)."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int):
        """``model``: a ``DSparkDraftModel`` (``draft.py`` builds its caches' runners from this
        module, so it is not imported here)."""
        cfg = model.config
        self.model, self.config = model, cfg
        self.block_size = cfg.block_size
        self.cache = KVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                             model.dtype, model.device)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            self.layers.append(dict(
                input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=qkv, kv=qkv[self.q_size:], o=attn.o_proj.weight.detach(),
                q_norm=attn.q_norm.weight.detach(), k_norm=attn.k_norm.weight.detach(),
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), down=mlp.down_proj.weight.detach()))
        head_dim = cfg.head_dim
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=model.device).float() / head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** exponent)
        self.cos_sin = K.rope_cos_sin_table(self.inv_freq, max_len)
        self.block_offsets = torch.arange(self.block_size, dtype=torch.int32, device=model.device)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def grow(self, max_len: int) -> None:
        """Reallocate the cache lines to ``max_len`` positions, keeping what they hold (eager use only:
        a captured graph keeps the old buffers)."""
        cfg, old = self.config, self.cache
        self.cache = KVCache(cfg.num_hidden_layers, old.num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                             old.k.dtype, old.k.device)
        keep = min(old.max_len, max_len)
        self.cache.k[:, :, :keep] = old.k[:, :, :keep]
        self.cache.v[:, :, :keep] = old.v[:, :, :keep]
        self.cos_sin = K.rope_cos_sin_table(self.inv_freq, max_len)

    @torch.inference_mode()
    def context(self, hidden: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Write the context K/V of ``M`` tokens: ``hidden`` ``[M, m*H]`` captured target states,
        ``positions`` / ``token_slots`` int ``[M]``."""
        model, cfg = self.model, self.config
        c = model.hidden_norm(model.fc(hidden.to(model.dtype)))
        m, d = c.shape[0], cfg.head_dim
        for i, layer in enumerate(self.layers):
            kv = F.linear(c, layer["kv"])
            k = kv[:, :self.kv_size].view(m, cfg.num_key_value_heads, d)
            v = kv[:, self.kv_size:].view(m, cfg.num_key_value_heads, d)
            K.qk_norm_rope_store(None, k, v, positions, token_slots, self.cos_sin, self.cache.k[i], self.cache.v[i],
                                 k_norm_weight=layer["k_norm"], eps=cfg.rms_norm_eps)

    def _attention(self, i: int, layer: dict, x, positions, token_slots, anchor_positions, slot_ids, cu):
        """Layer ``i``'s attention of the block rows ``x``: their K/V into the cache, then the queries over
        the context (``< p``, or the window) and the block (causal on causal layers)."""
        cfg, d, n = self.config, self.config.head_dim, self.block_size
        qkv = F.linear(x, layer["qkv"])
        q = qkv[:, :self.q_size].view(-1, cfg.num_attention_heads, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(-1, cfg.num_key_value_heads, d)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, cfg.num_key_value_heads, d)
        q = K.qk_norm_rope_store(q, k, v, positions, token_slots, self.cos_sin, self.cache.k[i], self.cache.v[i],
                                 q_norm_weight=layer["q_norm"], k_norm_weight=layer["k_norm"], eps=cfg.rms_norm_eps)
        window = cfg.layer_window(i)
        starts = None if window is None else (anchor_positions - window).clamp(min=0)
        out = K.cached_attention(q, self.cache.k[i], self.cache.v[i], slot_ids, anchor_positions, cu, n,
                                 causal=cfg.layer_is_causal(i), window_starts=starts)
        return F.linear(out.view(-1, self.q_size), layer["o"])

    @torch.inference_mode()
    def block(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states ``[B*N, H]`` (model dtype) of each request's block; ``anchors``,
        ``anchor_positions``, ``slot_ids`` int32 ``[B]``. Row ``b*N + k`` is slot k of request b."""
        model, cfg = self.model, self.config
        batch, n = anchors.shape[0], self.block_size
        ids = torch.full((batch, n), cfg.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = (anchor_positions[:, None] + self.block_offsets).view(-1)
        token_slots = slot_ids.repeat_interleave(n)
        cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=anchors.device)
        h, residual = model.embed_tokens(ids.view(-1)), None
        for i, layer in enumerate(self.layers):
            h, residual = decoder_layer(layer, h, residual, cfg.rms_norm_eps,
                                        lambda x, i=i, layer=layer: self._attention(i, layer, x, positions, token_slots,
                                                                                    anchor_positions, slot_ids, cu))
        x, _ = K.rms_norm(h, model.norm.weight, cfg.rms_norm_eps, residual=residual)
        return x
