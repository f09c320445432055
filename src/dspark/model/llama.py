"""The target ("verifier") decoder for the engine: Llama-3, Qwen2/2.5 and Qwen3 in one forward.

These families share one pre-norm decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP); they
differ only in per-head q/k RMSNorm (Qwen3), q/k/v biases (Qwen2) and tied embeddings. The forward
runs *flat* tokens of many requests at once over a paged KV cache (``KVCache``) through the
``dspark.kernels.layers`` ops, with merged QKV and gate/up GEMMs, so one decoder layer is nine
launches and a whole step can live in one CUDA graph. Transformers stays the source of configs
(``AutoConfig``, RoPE frequencies) and the numerical oracle in tests; weights are read with
safetensors only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import kernels as K
from ..kernels._validate import Checker
from .layers import KVCache, attention, decoder_layer, rms_norm, rope_inv_freq, swiglu

__all__ = ["AttentionBatch", "CachedTarget", "TargetLM", "SUPPORTED_MODEL_TYPES", "ATTENTION_LAYER_TYPES",
           "declared_layer_types"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# the layer types of softmax attention: whatever else a config declares (linear attention, Mamba,
# convolutions, MLP-only layers) keeps a state or a shape the engine's KV cache does not hold
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class AttentionBatch:
    """Where each request's tokens sit: ``slot_ids`` int32 ``[B]`` cache lines, ``context_lens`` int32
    ``[B]`` cached positions before its first new token, ``cu_query_lens`` int32 ``[B+1]`` its rows
    of the flat token tensor, ``max_query_len`` the largest row count (a Python int)."""

    slot_ids: torch.Tensor
    context_lens: torch.Tensor
    cu_query_lens: torch.Tensor
    max_query_len: int
    window_starts: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None  # int64 [N]: per query, the new tokens it sees (tree verification)


class CachedTarget:
    """What the engine's target runners (``TargetLM``, ``HFTarget``) share: a KV cache of their
    ``shape`` (``num_layers``, ``num_kv_heads``, ``head_dim``) in their ``dtype`` on their ``device``,
    and the copy of a capture layer's input into the draft's buffer."""

    def _capture(self, capture_out, layer: int, hidden: torch.Tensor) -> None:
        """Layer ``layer``'s input ``hidden`` ``[N, H]`` into its columns of ``capture_out`` ``[N, m*H]``."""
        if capture_out is None or layer not in self.capture_layer_ids:
            return
        h = self.shape.hidden_size
        for j, index in enumerate(self.capture_layer_ids):  # an index may repeat
            if index == layer:
                capture_out[..., j * h:(j + 1) * h].copy_(hidden.view(capture_out.shape[:-1] + (h,)))

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """``num_slots`` contiguous lines of ``max_len`` positions."""
        s = self.shape
        return KVCache.contiguous(s.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, self.dtype, self.device)

    def new_paged_cache(self, num_blocks: int, block_size: int, block_table: torch.Tensor) -> KVCache:
        """``num_blocks`` blocks of ``block_size`` positions, lines through ``block_table``."""
        s = self.shape
        return KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.dtype, self.device,
                       block_table)

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return KVCache.bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)


@dataclass(frozen=True)
class _Shape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    qk_norm: bool
    qkv_bias: bool
    tied: bool
    max_positions: int


class TargetLM(CachedTarget):
    """A Llama-family causal LM as plain weight tensors (merged QKV and gate/up projections).

    ``capture_layer_ids``: Hugging Face ``output_hidden_states`` indices (0 = embedding output,
    ``a`` = input of decoder layer ``a``) whose rows the forward writes, concatenated, into a
    caller's buffer for the draft model.
    """

    def __init__(self, config, weights: dict[str, torch.Tensor], capture_layer_ids: Sequence[int] = ()):
        c = Checker("TargetLM")
        self.config = config
        self.shape = _shape_of(c, config)
        s = self.shape
        self.capture_layer_ids = [c.integer("capture_layer_ids[]", i, low=0, high=s.num_layers - 1)
                                  for i in capture_layer_ids]
        self.embed = weights["embed"]
        self.layers = weights["layers"]
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]
        self.inv_freq, self.attention_scaling = _rope_frequencies(c, config)
        self.cos_sin = K.rope_cos_sin_table(self.inv_freq.to(self.device), s.max_positions, self.attention_scaling)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, capture_layer_ids: Sequence[int] = (), *, device=None, dtype=None) -> "TargetLM":
        """Load a Hugging Face checkpoint directory (config.json + safetensors, sharded too)."""
        from transformers import AutoConfig

        from .checkpoint import read_json_object

        c = Checker("TargetLM.from_pretrained")
        path = Path(path)
        if not path.is_dir():
            c.fail(f"target must be a checkpoint directory, got {str(path)!r} "
                   f"({'a file' if path.exists() else 'no such path'})")
        if (path / "config.json").is_file():
            read_json_object(path / "config.json")  # a bad file is named, with line and column
        config = AutoConfig.from_pretrained(path)
        dtype = dtype or _config_dtype(config)
        tensors = _read_safetensors(c, path, device or "cpu", dtype)
        return cls(config, _merge(c, config, tensors), capture_layer_ids)

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, capture_layer_ids: Sequence[int] = ()) -> "TargetLM":
        """Share the weights of a loaded Hugging Face model (its device and dtype)."""
        c = Checker("TargetLM.from_hf_model")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        return cls(model.config, _merge(c, model.config, state), capture_layer_ids)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    # ---- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                batch: AttentionBatch, cache: KVCache, *, capture_out: torch.Tensor | None = None,
                logits_rows: torch.Tensor | None = None, cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``N`` flat tokens; returns f32 logits ``[M, V]`` of ``logits_rows`` (int ``[M]``; all
        ``N`` rows when None).

        ``input_ids``, ``positions``, ``token_slots`` int ``[N]`` (token, absolute position, cache
        line); ``batch`` groups them by request (causal attention over each request's line): an
        ``AttentionBatch``, or a list of ``(first row, end row, AttentionBatch)`` over consecutive
        row ranges (one attention launch each). The
        K/V of every token is written into ``cache``. ``capture_out`` ``[N, m*H]`` (or a strided
        view of that shape) receives the hidden states at ``capture_layer_ids``. ``cache_positions``
        int ``[N]`` (tree verification): each token's cache row when it is not its position.
        """
        s = self.shape
        h, residual = F.embedding(input_ids, self.embed), None
        for i, layer in enumerate(self.layers):
            h, residual = decoder_layer(
                layer, h, residual, s.eps,
                lambda x, i=i, layer=layer: attention(layer, x, s.num_heads, positions, token_slots, self.cos_sin,
                                                      cache.k[i], cache.v[i], s.eps,
                                                      self._attend(batch, cache, i), cache_positions,
                                                      cache.block_table),
                lambda x, layer=layer: swiglu(x, layer["gate_up"], layer["down"]),
                on_input=lambda hidden, i=i: self._capture(capture_out, i, hidden))
        x, _ = rms_norm(h, self.norm, s.eps, residual=residual)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        return F.linear(x, self.lm_head).float()

    def _attend(self, batch, cache: KVCache, layer: int):
        """``attend(q)`` over layer ``layer`` of ``cache``: causal, one launch per row group of a list
        (tiles sized for verify or prefill)."""
        if isinstance(batch, AttentionBatch):
            return lambda q: _causal_attention(q, cache, layer, batch)
        return lambda q: torch.cat([_causal_attention(q[lo:hi], cache, layer, g) for lo, hi, g in batch])


def _causal_attention(q, cache: KVCache, layer: int, batch: AttentionBatch) -> torch.Tensor:
    return K.cached_attention(q, cache.k[layer], cache.v[layer], batch.slot_ids, batch.context_lens,
                              batch.cu_query_lens, batch.max_query_len, causal=True, tree_mask=batch.tree_mask,
                              block_table=cache.block_table)


# ------------------------------------------------------------------------------------ config & io


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def declared_layer_types(config) -> list[str]:
    """The sequence mixer of each decoder layer as ``config`` declares it: ``layer_types``, else the
    older ``layers_block_type`` (hybrid families); [] when it declares none."""
    for key in ("layer_types", "layers_block_type"):
        types = getattr(config, key, None)
        if isinstance(types, (list, tuple)) and types:
            return [str(t) for t in types]
    return []


def _shape_of(c: Checker, config) -> _Shape:
    config = _text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        c.fail(f"the engine's target runner supports model types {list(SUPPORTED_MODEL_TYPES)} "
               f"(Llama-3, Qwen2/2.5, Qwen3), got {model_type!r}")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        c.fail(f"targets with sliding-window attention are not supported (use_sliding_window is true, "
               f"sliding_window={config.sliding_window})")
    others = {i: t for i, t in enumerate(declared_layer_types(config)) if t not in ATTENTION_LAYER_TYPES}
    if others:
        c.fail(f"the fused runner runs softmax attention layers only, got layer types "
               f"{sorted(set(others.values()))} (layers {sorted(others)})")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return _Shape(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=config.intermediate_size, eps=float(config.rms_norm_eps),
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=int(config.max_position_embeddings))


def _rope_frequencies(c: Checker, config) -> tuple[torch.Tensor, float]:
    """(inv_freq f32 ``[d/2]``, attention scaling) as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _text_config(config)
    # transformers 5 keeps RoPE settings in rope_parameters, 4.x in rope_scaling (+ rope_theta)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        c.fail(f"RoPE type {rope_type!r} changes its frequencies with the sequence length; "
               "supported: default, linear, llama3, yarn")
    if rope_type == "default":
        s = _shape_of(c, config)
        return rope_inv_freq(s.head_dim, params.get("rope_theta", getattr(config, "rope_theta", 10000.0))), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        c.fail(f"unknown RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(_text_config(config), "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _read_safetensors(c: Checker, path: Path, device, dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (``model.safetensors`` or a sharded index), cast to ``dtype``."""
    from safetensors import SafetensorError, safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            c.fail(f"{index} is not a safetensors index with a weight_map: {exc}")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f"; it holds only pickle weights ({', '.join(pickles)}), which dspark does not load" if pickles else ""
        c.fail(f"{path} has no model.safetensors or model.safetensors.index.json{found}")
    tensors = {}
    for name in files:
        file = path / name
        if not file.is_file():
            c.fail(f"{file} is listed in the checkpoint index but missing")
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    tensors[key] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError, RuntimeError) as exc:
            c.fail(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}")
    return tensors


def _merge(c: Checker, config, state: dict[str, torch.Tensor]) -> dict:
    """Hugging Face parameter names -> merged weights; every tensor checked for presence and shape."""
    s = _shape_of(c, config)
    prefix = "model." if any(k.startswith("model.") for k in state) else ""

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        key = prefix + name if not name.startswith("lm_head") else name
        if key not in state:
            c.fail(f"the target checkpoint has no tensor {key!r}")
        t = state[key]
        if tuple(t.shape) != shape:
            c.fail(f"target tensor {key!r} has shape {list(t.shape)}, expected {list(shape)} from config.json")
        return t

    h, d, inter = s.hidden_size, s.head_dim, s.intermediate_size
    q_size, kv_size = s.num_heads * d, s.num_kv_heads * d
    layers = []
    for i in range(s.num_layers):
        p = f"layers.{i}."
        layer = {
            "input_norm": get(p + "input_layernorm.weight", (h,)),
            "post_norm": get(p + "post_attention_layernorm.weight", (h,)),
            "qkv": torch.cat([get(p + "self_attn.q_proj.weight", (q_size, h)),
                              get(p + "self_attn.k_proj.weight", (kv_size, h)),
                              get(p + "self_attn.v_proj.weight", (kv_size, h))]),
            "o": get(p + "self_attn.o_proj.weight", (h, q_size)),
            "gate_up": torch.cat([get(p + "mlp.gate_proj.weight", (inter, h)), get(p + "mlp.up_proj.weight", (inter, h))]),
            "down": get(p + "mlp.down_proj.weight", (h, inter)),
        }
        if s.qkv_bias:
            layer["qkv_bias"] = torch.cat([get(p + "self_attn.q_proj.bias", (q_size,)),
                                           get(p + "self_attn.k_proj.bias", (kv_size,)),
                                           get(p + "self_attn.v_proj.bias", (kv_size,))])
        if s.qk_norm:
            layer["q_norm"] = get(p + "self_attn.q_norm.weight", (d,))
            layer["k_norm"] = get(p + "self_attn.k_norm.weight", (d,))
        layers.append(layer)
    embed = get("embed_tokens.weight", (s.vocab_size, h))
    lm_head = embed if s.tied and "lm_head.weight" not in state else get("lm_head.weight", (s.vocab_size, h))
    return {"embed": embed, "layers": layers, "norm": get("norm.weight", (h,)), "lm_head": lm_head}
