"""The target ("verifier") decoder for the engine: Llama-3, Qwen2/2.5 and Qwen3 in one forward.

These families share one pre-norm decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP); they
differ only in per-head q/k RMSNorm (Qwen3), q/k/v biases (Qwen2) and tied embeddings. The forward
runs *flat* tokens of many requests at once over a paged KV cache (``KVCache``) through the
``dspark.kernels.layers`` ops, with merged QKV and gate/up GEMMs, so one decoder layer is nine
launches and a whole step can live in one CUDA graph. Transformers stays the source of configs
(``AutoConfig``, RoPE frequencies) and the numerical oracle in tests; weights are read with
safetensors only.

Under tensor parallelism (``tp``: a ``parallel.TensorParallel`` of size > 1) a ``TargetLM`` holds one
rank's shard -- its attention heads, MLP features and vocabulary rows, read from the checkpoint as
slices (no rank reads the whole model) -- and its forward adds the ranks' partial sums after each
attention and MLP and gathers the logits' vocabulary columns, so that every rank returns the full
logits (``parallel``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import kernels as K
from ..kernels._validate import Checker
from .layers import KVCache, attention, decoder_layer, rms_norm, rope_inv_freq, swiglu
from .parallel import SINGLE_RANK, TensorParallel

__all__ = ["AttentionBatch", "CachedTarget", "TargetLM", "TensorSource", "SUPPORTED_MODEL_TYPES",
           "ATTENTION_LAYER_TYPES", "declared_layer_types"]

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
    and the copy of a capture layer's input into the draft's buffer. ``tp``: the tensor-parallel rank
    whose shard it holds (its cache holds that rank's K/V heads)."""

    tp: TensorParallel = SINGLE_RANK

    @property
    def cache_kv_heads(self) -> int:
        """K/V heads per position in this rank's cache."""
        return self.shape.num_kv_heads // self.tp.size

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
        return KVCache.contiguous(s.num_layers, num_slots, max_len, self.cache_kv_heads, s.head_dim, self.dtype,
                                  self.device)

    def new_paged_cache(self, num_blocks: int, block_size: int, block_table: torch.Tensor) -> KVCache:
        """``num_blocks`` blocks of ``block_size`` positions, lines through ``block_table``."""
        s = self.shape
        return KVCache(s.num_layers, num_blocks, block_size, self.cache_kv_heads, s.head_dim, self.dtype, self.device,
                       block_table)

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return KVCache.bytes_per_token(s.num_layers, self.cache_kv_heads, s.head_dim, self.dtype)


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
    caller's buffer for the draft model. ``weights``: ``_merge``'s, the shard of rank ``tp``.
    """

    def __init__(self, config, weights: dict[str, torch.Tensor], capture_layer_ids: Sequence[int] = (),
                 tp: TensorParallel = SINGLE_RANK):
        c = Checker("TargetLM")
        self.config, self.tp = config, tp
        self.shape = _shape_of(c, config)
        s = self.shape
        self.num_heads = s.num_heads // tp.size  # this rank's query heads
        self.vocab_lo = tp.vocab_part(s.vocab_size)[0]  # the first token id of this rank's embedding rows
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
    def from_pretrained(cls, path, capture_layer_ids: Sequence[int] = (), *, device=None, dtype=None,
                        tp: TensorParallel = SINGLE_RANK) -> "TargetLM":
        """Load a Hugging Face checkpoint directory (config.json + safetensors, sharded too); under
        tensor parallelism only rank ``tp``'s slices of its tensors are read."""
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
        with _SafetensorsSource(c, path, device or "cpu", dtype) as tensors:
            return cls(config, _merge(c, config, tensors, tp), capture_layer_ids, tp)

    @classmethod
    def from_tensor_source(cls, config, source: "TensorSource", capture_layer_ids: Sequence[int] = (), *,
                           tp: TensorParallel = SINGLE_RANK) -> "TargetLM":
        """Rank ``tp``'s shard of the model ``config`` describes, its tensors read from ``source``."""
        return cls(config, _merge(Checker("TargetLM"), config, source, tp), capture_layer_ids, tp)

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, capture_layer_ids: Sequence[int] = (), *,
                      tp: TensorParallel = SINGLE_RANK, device=None) -> "TargetLM":
        """Share the weights of a loaded Hugging Face model (its device and dtype); under tensor
        parallelism, copies of rank ``tp``'s slices (on ``device``, default the model's)."""
        c = Checker("TargetLM.from_hf_model")
        state = TensorSource({k: v.detach() for k, v in model.state_dict().items()}, device)
        return cls(model.config, _merge(c, model.config, state, tp), capture_layer_ids, tp)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

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
        s, tp = self.shape, self.tp
        h, residual = self._embed(input_ids), None
        for i, layer in enumerate(self.layers):
            h, residual = decoder_layer(
                layer, h, residual, s.eps,
                lambda x, i=i, layer=layer: tp.all_reduce(attention(
                    layer, x, self.num_heads, positions, token_slots, self.cos_sin, cache.k[i], cache.v[i], s.eps,
                    self._attend(batch, cache, i), cache_positions, cache.block_table)),
                lambda x, layer=layer: tp.all_reduce(swiglu(x, layer["gate_up"], layer["down"])),
                on_input=lambda hidden, i=i: self._capture(capture_out, i, hidden))
        x, _ = rms_norm(h, self.norm, s.eps, residual=residual)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        return tp.gather_vocab(F.linear(x, self.lm_head), s.vocab_size).float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows ``[N, H]`` of ``input_ids``: under tensor parallelism each rank's own
        vocabulary rows (zeros for the others' ids), summed over the ranks."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_lo
        mine = (local >= 0) & (local < self.embed.shape[0])  # the padding rows past the vocabulary are zeros
        rows = F.embedding(torch.where(mine, local, 0), self.embed)
        return self.tp.all_reduce(rows * mine[:, None].to(rows.dtype))

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


class TensorSource:
    """Where ``TargetLM`` reads its weights from, by Hugging Face name (``keys()``, ``in``): here a
    loaded model's state dict; a checkpoint's files or a benchmark's random weights subclass it.
    ``shape(key)``: the tensor's full shape; ``read(key, split)``
    -- the whole tensor (shared, unless ``device`` moves it), or a copy of its rows / columns
    ``split = (dim, lo, hi)`` (on ``device``; None: where the tensor is)."""

    def __init__(self, state: dict[str, torch.Tensor], device=None):
        self.state, self.device = state, device

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def keys(self):
        return self.state.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def read(self, key: str, split: tuple[int, int, int] | None = None) -> torch.Tensor:
        t = self.state[key]
        if split is None:
            return t if self.device is None else t.to(self.device)
        return t.narrow(split[0], split[1], split[2] - split[1]).to(self.device or t.device, copy=True)


class _SafetensorsSource(TensorSource):
    """The tensors of a checkpoint directory (``model.safetensors`` or a sharded index), opened
    (a context manager) and read one at a time, each cast to ``dtype`` on ``device``: a split reads
    only its slice of the file."""

    def __init__(self, c: Checker, path: Path, device, dtype):
        super().__init__({})
        self.c, self.path, self.device, self.dtype = c, path, device, dtype
        self.files = contextlib.ExitStack()

    def __enter__(self) -> "_SafetensorsSource":
        from safetensors import safe_open

        try:
            for name in self._file_names():
                file = self.path / name
                if not file.is_file():
                    self.c.fail(f"{file} is listed in the checkpoint index but missing")
                handle = self._guarded(file, lambda file=file: self.files.enter_context(
                    safe_open(str(file), framework="pt", device=str(self.device))))
                for key in self._guarded(file, handle.keys):
                    self.state[key] = (file, handle)
        except BaseException:
            self.files.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.files.close()

    def _file_names(self) -> list[str]:
        path, c = self.path, self.c
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                c.fail(f"{index} is not a safetensors index with a weight_map: {exc}")
            return sorted(set(weight_map.values()))
        if (path / "model.safetensors").is_file():
            return ["model.safetensors"]
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f"; it holds only pickle weights ({', '.join(pickles)}), which dspark does not load" if pickles else ""
        c.fail(f"{path} has no model.safetensors or model.safetensors.index.json{found}")

    def _guarded(self, file: Path, read):
        from safetensors import SafetensorError

        try:
            return read()
        except (SafetensorError, OSError, RuntimeError) as exc:
            self.c.fail(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}")

    def shape(self, key: str) -> tuple[int, ...]:
        file, handle = self.state[key]
        return tuple(self._guarded(file, lambda: handle.get_slice(key).get_shape()))

    def read(self, key: str, split: tuple[int, int, int] | None = None) -> torch.Tensor:
        file, handle = self.state[key]
        if split is None:
            t = self._guarded(file, lambda: handle.get_tensor(key))
        else:
            dim, lo, hi = split
            t = self._guarded(file, lambda: handle.get_slice(key)[(slice(None),) * dim + (slice(lo, hi),)])
        return t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)


def _merge(c: Checker, config, tensors: TensorSource, tp: TensorParallel = SINGLE_RANK) -> dict:
    """Hugging Face parameter names -> merged weights of rank ``tp``'s shard (``parallel``); every
    tensor checked for presence and its full shape before its slice is read."""
    s = _shape_of(c, config)
    prefix = "model." if any(k.startswith("model.") for k in tensors.keys()) else ""
    h, d, inter = s.hidden_size, s.head_dim, s.intermediate_size
    q_size, kv_size = s.num_heads * d, s.num_kv_heads * d
    if tp.size > 1:  # a rank holds whole heads: check they split (the errors name the heads, not the rows)
        tp.part(s.num_heads, "attention heads")
        tp.part(s.num_kv_heads, "key/value heads")
    # (dim, lo, hi) of each split kind: this rank's heads' rows, its MLP features, its vocabulary rows
    q_rows, kv_rows = tp.part(q_size, "query rows"), tp.part(kv_size, "key/value rows")
    features = tp.part(inter, "MLP intermediate features (intermediate_size)")
    vocab_lo, vocab_hi, vocab_rows = tp.vocab_part(s.vocab_size)

    def get(name: str, shape: tuple[int, ...], split: tuple[int, tuple[int, int]] | None = None) -> torch.Tensor:
        key = prefix + name if not name.startswith("lm_head") else name
        if key not in tensors:
            c.fail(f"the target checkpoint has no tensor {key!r}")
        if tensors.shape(key) != shape:
            c.fail(f"target tensor {key!r} has shape {list(tensors.shape(key))}, expected {list(shape)} "
                   "from config.json")
        if tp.size == 1 or split is None:
            return tensors.read(key)
        dim, (lo, hi) = split
        return tensors.read(key, (dim, lo, hi))

    def vocab(name: str) -> torch.Tensor:
        rows = get(name, (s.vocab_size, h), (0, (vocab_lo, vocab_hi)))
        if rows.shape[0] == vocab_rows:
            return rows
        return torch.cat([rows, rows.new_zeros(vocab_rows - rows.shape[0], h)])  # the last shard's padding

    layers = []
    for i in range(s.num_layers):
        p = f"layers.{i}."
        layer = {
            "input_norm": get(p + "input_layernorm.weight", (h,)),
            "post_norm": get(p + "post_attention_layernorm.weight", (h,)),
            "qkv": torch.cat([get(p + "self_attn.q_proj.weight", (q_size, h), (0, q_rows)),
                              get(p + "self_attn.k_proj.weight", (kv_size, h), (0, kv_rows)),
                              get(p + "self_attn.v_proj.weight", (kv_size, h), (0, kv_rows))]),
            "o": get(p + "self_attn.o_proj.weight", (h, q_size), (1, q_rows)),
            "gate_up": torch.cat([get(p + "mlp.gate_proj.weight", (inter, h), (0, features)),
                                  get(p + "mlp.up_proj.weight", (inter, h), (0, features))]),
            "down": get(p + "mlp.down_proj.weight", (h, inter), (1, features)),
        }
        if s.qkv_bias:
            layer["qkv_bias"] = torch.cat([get(p + "self_attn.q_proj.bias", (q_size,), (0, q_rows)),
                                           get(p + "self_attn.k_proj.bias", (kv_size,), (0, kv_rows)),
                                           get(p + "self_attn.v_proj.bias", (kv_size,), (0, kv_rows))])
        if s.qk_norm:
            layer["q_norm"] = get(p + "self_attn.q_norm.weight", (d,))
            layer["k_norm"] = get(p + "self_attn.k_norm.weight", (d,))
        layers.append(layer)
    embed = vocab("embed_tokens.weight")
    lm_head = embed if s.tied and "lm_head.weight" not in tensors else vocab("lm_head.weight")
    return {"embed": embed, "layers": layers, "norm": get("norm.weight", (h,)), "lm_head": lm_head}
