"""Any Hugging Face decoder-only causal LM as the engine's target, through its own modeling code.

vLLM's Transformers backend in small: the model runs on the engine's flat ragged tokens (one row of
``N`` tokens, ``position_ids`` from the engine) and the engine's paged ``KVCache``, through an
attention function registered with transformers' attention interface (``ATTENTION``): each layer
writes its (already rotated) keys and values at the tokens' (slot, position) and attends with
dspark's ragged ``cached_attention`` -- the same op and cache as ``TargetLM``, the fused fast path
for Llama / Qwen2 / Qwen3. Hidden states of the draft's capture layers come from forward pre-hooks
on the decoder layers (Hugging Face ``hidden_states[a]`` = the input of layer ``a``); logits only
for the rows asked for (``logits_to_keep``).

Sliding-window layers mask per query (the window the modeling code passes). Attention variants
the ragged op cannot express exactly are refused with an error naming them: attention-logit
soft-capping, chunked attention, attention sinks, non-causal layers.

Hybrid targets whose stateful layers ``hybrid`` runs exactly -- gated DeltaNet, Mamba-1, Mamba-2
and short convolutions (``hybrid.py``: which families) -- keep those layers' states in a
``StatePool`` beside the KV cache (``new_paged_cache(..., states=)``), their mixers routed through
it during the engine's forwards; a target without attention layers (Mamba, Mamba2) has an empty KV
cache. Layers declared MLP-only (``mlp`` / ``moe``) carry nothing between positions and run as they
are. Every other decoder layer whose sequence mixer is not softmax attention (Zamba's mixers and
shared attention, Kimi Delta Attention, lightning attention, RWKV, RG-LRU, xLSTM, ...) is refused,
naming why for the mixers transformers has (``_NOT_RUN``): its recurrent or convolution state would
not be kept, so it would decode wrong from the first tokens. They are found from the config's
declared layer types and, whatever the config says, from the layers' modules (a ``Conv1d``, a class
named for a recurrent mixer, no attention with a ``layer_idx``).

The forward is capturable in a CUDA graph (static shapes per call, no host synchronisation in
dspark's part; transformers builds no mask for the ragged attention) unless the model's own code
synchronises the host: ``HFTarget.eager_reason`` names the cases known from the config (dynamic and
LongRoPE frequencies, mixture-of-experts loops), and the runner runs those eagerly. A forward that
fails inside a capture sets it too: the runner runs that step and every later one eagerly
(``CudaGraphs._replay``), after one failed capture.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .. import kernels as K
from ..kernels._validate import Checker
from . import hybrid
from .layers import KVCache
from .llama import ATTENTION_LAYER_TYPES, AttentionBatch, CachedTarget, declared_layer_types

__all__ = ["ATTENTION", "HFTarget"]
log = logging.getLogger("dspark.engine")

ATTENTION = "dspark_ragged"
# declared layer types of softmax attention: the older layers_block_type spells it "attention";
# chunked attention is refused on its own, by name
_SOFTMAX_LAYER_TYPES = (*ATTENTION_LAYER_TYPES, "attention", "chunked_attention")
# declared layer types with no sequence mixer (Nemotron-H's MLP and mixture-of-experts layers)
_FEED_FORWARD_LAYER_TYPES = ("mlp", "moe")
_SHARED_ATTENTION = ("a shared attention block (one attention module serving several layers, its KV cache picked per "
                     "call, not by its layer_idx)")
_INNER_CONVOLUTIONS = "short convolutions inside its attention and MLP blocks (a conv state per block)"
# the stateful modules of transformers' families that the engine does not run, by class name: why (the
# refusal says it); hybrid.py's mixers run, the rest are refused with the generic reason
_NOT_RUN = {
    **{name: "Kimi Delta Attention (a delta rule decaying per key channel, not per head)" for name in (
        "KimiLinearDeltaAttention", "Glm5NextTextLinearAttention", "BailingHybridDeltaAttention")},
    "MiniMaxLightningAttention": "lightning attention (linear attention with a fixed decay per head, run in blocks)",
    "RecurrentGemmaRecurrentBlock": "Griffin's RG-LRU recurrence after a short convolution",
    "RwkvBlock": "RWKV's WKV recurrence and token shift",
    "xLSTMBlock": "xLSTM's matrix memory (mLSTM)",
    "ZambaMambaMixer": "Zamba's Mamba-1 split into n_mamba_heads heads",
    "ZambaHybridLayer": _SHARED_ATTENTION,
    "Zamba2HybridLayer": _SHARED_ATTENTION,
    "ZayaCCAProjection": "compressed convolutional attention (a causal convolution over queries and keys, a delayed "
                         "value state)",
    "Qwen4ExpTextQSAIndexer": "sparse attention over the key blocks an indexer picks, not full softmax attention",
    "Qwen4ExpTextGatedDeltaNet": "in a model whose n-gram embeddings and hyper-connections this engine does not check",
    **{name: _INNER_CONVOLUTIONS for name in (
        "InklingShortConvolution", "Inkling2ShortConvolution", "Inkling2DynamicShortConvolution",
        "Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution")},
}
# class names (less the family's prefix) of sequence mixers with a recurrent or convolution state
_STATEFUL_MIXER = re.compile(r"Mamba|SSM|Ssm|DeltaNet|LinearAttention|Lightning|ShortConv|Recurrent|Rglru|RGLRU|"
                             r"Rwkv|RWKV|LSTM|Retention|Mixer")


@dataclass
class _Step:
    """What the registered attention function needs from the current forward."""

    cache: KVCache
    cache_index: tuple[torch.Tensor, torch.Tensor]  # (blocks, rows) of each token's K/V (``KVCache.index``)
    groups: list  # (first row, end row, AttentionBatch)


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("dspark_hf_step")


def _ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      **kwargs):
    """transformers' attention interface: ``query`` ``[1, H, N, d]``, ``key``/``value`` ``[1, H_kv, N, d]``
    (rotated) -> ``([1, N, H, d], None)``; keys and values go into the engine's cache first. A
    sliding layer (``sliding_window``, as the modeling code passes it) masks per query."""
    step = _STEP.get()
    layer = module.layer_idx
    k_cache, v_cache = step.cache.k[layer], step.cache.v[layer]
    k_cache[step.cache_index] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[step.cache_index] = value[0].transpose(0, 1).to(v_cache.dtype)
    q = query[0].transpose(0, 1).to(k_cache.dtype)
    out = torch.cat([K.cached_attention(q[lo:hi].contiguous(), k_cache, v_cache, g.slot_ids, g.context_lens,
                                        g.cu_query_lens, g.max_query_len, causal=True, scale=scaling,
                                        sliding_window=sliding_window or None, block_table=step.cache.block_table)
                     for lo, hi, g in step.groups])
    return out[None].to(query.dtype), None


def _register() -> None:
    """Register the ragged attention -- and no mask function: transformers skips building a mask
    for an implementation its mask interface does not know (the ragged op masks by position),
    and with it the packed-sequence check on ``position_ids``, a host synchronisation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _ragged_attention)


@dataclass(frozen=True)
class _HFShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int


class HFTarget(CachedTarget):
    """A loaded Hugging Face causal LM behind ``TargetLM``'s runner contract (``forward``,
    ``new_cache``, ``shape``, ``device``, ``dtype``, ``vocab_size``, ``config``, ``graphable``).
    ``eager_reason``: why the model's modeling code cannot run in a CUDA graph (None: it can) --
    known from the config, or set when the forward failed inside a capture."""

    def __init__(self, model: torch.nn.Module, capture_layer_ids: Sequence[int] = ()):
        c = Checker("HFTarget")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model, self.config = model.eval(), config
        self.layers = _decoder_layers(c, model)
        # decoder layer index -> its stateful mixer that ``hybrid`` runs (empty: attention only)
        self.stateful = _check_sequence_mixers(c, model, config, self.layers)
        hybrid.install(self.stateful)
        _check_attention(c, config, self.layers)
        num_kv_heads, head_dim = _kv_shape(config, self.layers, self.stateful)
        self.shape = _HFShape(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=len(self.layers),
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_positions=int(getattr(config, "max_position_embeddings", 0) or 0) or 4096)
        self.capture_layer_ids = [c.integer("capture_layer_ids[]", i, low=0, high=self.shape.num_layers - 1)
                                  for i in capture_layer_ids]
        self.eager_reason = _eager_reason(model, config, self.dtype)
        if self.eager_reason is not None:
            _log_eager(self.eager_reason)
        _register()

    @classmethod
    def from_pretrained(cls, path, capture_layer_ids: Sequence[int] = (), *, device=None, dtype=None) -> "HFTarget":
        """Load a checkpoint directory with ``AutoModelForCausalLM`` (safetensors only)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=dtype or "auto", use_safetensors=True)
        return cls(model.to(device or "cpu"), capture_layer_ids)

    def new_cache(self, num_slots: int, max_len: int, states: hybrid.StateLayout | None = None) -> KVCache:
        """``CachedTarget.new_cache``; a hybrid target's also holds its layers' states laid out as
        ``states`` (None: rounds of one token, no prefix caching)."""
        return self._with_states(super().new_cache(num_slots, max_len), states)

    def new_paged_cache(self, num_blocks: int, block_size: int, block_table: torch.Tensor,
                        states: hybrid.StateLayout | None = None) -> KVCache:
        """``CachedTarget.new_paged_cache``; a hybrid target's also holds its layers' states laid out
        as ``states`` (the verify length; the block ends and snapshots of prefix caching)."""
        return self._with_states(super().new_paged_cache(num_blocks, block_size, block_table), states)

    def state_bytes(self, lines: int, states: hybrid.StateLayout) -> int:
        """Bytes of the stateful layers' states for ``lines`` cache lines laid out as ``states`` (0
        for a target of attention layers only)."""
        return hybrid.pool_bytes(self.stateful, lines, states, self.dtype)

    def _with_states(self, cache: KVCache, states: hybrid.StateLayout | None) -> KVCache:
        if self.stateful:
            cache.states = hybrid.new_pool(self.stateful, cache.num_slots, states or hybrid.StateLayout(1),
                                           self.device, self.dtype)
        return cache

    @property
    def graphable(self) -> bool:
        """Whether the runner may capture this target's forwards in CUDA graphs."""
        return self.eager_reason is None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                batch, cache: KVCache, *, capture_out: torch.Tensor | None = None,
                logits_rows: torch.Tensor | None = None, cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``TargetLM.forward``'s contract: f32 logits ``[M, V]`` of ``logits_rows`` (all rows when
        None); K/V into ``cache``; ``capture_out`` ``[N, m*H]`` the capture layers' inputs. Tree
        verification (``cache_positions``) is ``TargetLM``'s only."""
        if cache_positions is not None:
            raise ValueError("HFTarget does not verify token trees (cache_positions): tree mode needs a TargetLM")
        groups = [(0, input_ids.numel(), batch)] if isinstance(batch, AttentionBatch) else list(batch)
        token = _STEP.set(_Step(cache, cache.index(token_slots, positions), groups))
        states = forward = None
        if self.stateful:
            if cache.states is None:
                raise ValueError("a hybrid target's forward needs a cache from its new_cache / new_paged_cache")
            forward = hybrid.Forward(cache.states, hybrid.Tokens.of(token_slots, positions, groups))
            states = hybrid.HYBRID.set(forward)
        hooks = self._capture_hooks(capture_out)
        configs = {id(c): c for c in (self.model.config, self.config)}.values()
        previous = [c._attn_implementation for c in configs]
        try:  # the ragged attention for this forward only: the model stays usable on its own
            for c in configs:
                c._attn_implementation = ATTENTION
            keep = 0 if logits_rows is None else logits_rows.long()
            out = self.model(input_ids=input_ids.long()[None], position_ids=positions.long()[None], use_cache=False,
                             logits_to_keep=keep)
            if forward is not None:
                forward.commit()  # (gated DeltaNet checkpoints: only a forward that ran through)
        except Exception as exc:
            if _capturing(self.device):  # the modeling code read a device value on the host: no graph will hold it
                self.eager_reason = (f"{type(self.model).__name__}'s forward failed inside a CUDA graph capture "
                                     f"({type(exc).__name__}: {str(exc)[:200]})")
                _log_eager(self.eager_reason)
            raise
        finally:
            for c, name in zip(configs, previous):
                c._attn_implementation = name
            for hook in hooks:
                hook.remove()
            _STEP.reset(token)
            if states is not None:
                hybrid.HYBRID.reset(states)
        return out.logits[0].float()

    def _capture_hooks(self, capture_out):
        if capture_out is None:
            return []

        def hook(index):
            def copy(module, args, kwargs):
                self._capture(capture_out, index, (args[0] if args else kwargs["hidden_states"])[0])
            return copy

        return [self.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True)
                for i in sorted(set(self.capture_layer_ids))]


def _decoder_layers(c: Checker, model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` and its spellings)."""
    if getattr(model.config, "is_encoder_decoder", False):
        c.fail(f"the target must be a decoder-only causal LM, got encoder-decoder {type(model).__name__}")
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    c.fail(f"cannot find the decoder layers of {type(model).__name__} (looked for layers / h / blocks)")


def _check_sequence_mixers(c: Checker, model, config, layers) -> dict[int, torch.nn.Module]:
    """The stateful mixers ``hybrid`` runs (decoder layer index -> module); refuse every other decoder
    layer that is not softmax attention (see the module docstring), naming the model, the layers and
    what they are."""
    declared = declared_layer_types(config)
    family = re.sub(r"(For[A-Z]\w*|LMHeadModel|Model)$", "", type(model).__name__)
    found: dict[str, list[int]] = {}
    stateful = {}
    for i, layer in enumerate(layers):
        kind_declared = declared[i] if i < len(declared) else None
        mixer = _supported_mixer(layer, kind_declared, family)
        if mixer is not None:
            stateful[i] = mixer
            continue
        kind = _non_attention_kind(kind_declared, layer, family)
        if kind is not None:
            found.setdefault(kind, []).append(i)
    if found:
        what = "; ".join(f"layers {indices} are {kind}" for kind, indices in found.items())
        c.fail(f"{type(model).__name__}: {what}. This engine cannot run that layer type exactly yet: it runs "
               f"full and sliding-window softmax attention layers, whose state is its KV cache, and the hybrid "
               f"layers whose states it keeps: gated DeltaNet, Mamba-1, Mamba-2, short convolutions")
    return stateful


def _supported_mixer(layer, declared: str | None, family: str):
    """The one stateful mixer of ``layer`` that ``hybrid`` runs exactly, or None (the layer has none,
    or holds another stateful module too)."""
    mixers = [m for m in layer.modules() if m is not layer and hybrid.is_supported_mixer(m, declared)]
    if len(mixers) != 1:
        return None
    others = [m for m in layer.modules() if m is not layer and m is not mixers[0]
              and m not in set(mixers[0].modules()) and _is_stateful(m, family)]
    return None if others else mixers[0]


def _non_attention_kind(declared: str | None, layer, family: str) -> str | None:
    """What decoder ``layer`` holds that is not softmax attention -- its declared type, the module
    with the state -- or None when it is softmax attention."""
    stateful = next((type(m).__name__ for m in layer.modules()
                     if m is not layer and _is_stateful(m, family)), None)
    if declared in _FEED_FORWARD_LAYER_TYPES and stateful is None:
        return None  # no sequence mixer: nothing carried between positions
    why = next((f", {_NOT_RUN[type(m).__name__]}" for m in layer.modules() if type(m).__name__ in _NOT_RUN), "")
    if declared is not None and declared not in _SOFTMAX_LAYER_TYPES:
        return f"{declared!r}" + (f" ({stateful})" if stateful else "") + why
    if stateful is not None:
        return stateful + why
    if _attention_module(layer) is None:
        return f"{type(layer).__name__} without an attention module (one with a layer_idx, for its cache)" + why
    return None


def _is_stateful(module, family: str) -> bool:
    """A causal convolution over positions (it holds a ``Conv1d``) or a recurrent mixer by name."""
    if any(isinstance(child, torch.nn.Conv1d) for child in module.children()):
        return True
    # less the family's own name, which may hold a marker (RecurrentGemmaAttention, MambaRMSNorm)
    return bool(_STATEFUL_MIXER.search(type(module).__name__.removeprefix(family)))


def _attention_module(layer):
    """The module of ``layer`` whose ``layer_idx`` names its cache (None: it has none)."""
    return next((m for m in layer.modules() if hasattr(m, "layer_idx") and m is not layer), None)


def _kv_shape(config, layers, stateful: dict[int, torch.nn.Module]) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of the KV cache; ``(0, 0)`` for a target without attention
    (pure Mamba / Mamba-2 / FalconMamba: every layer's state is in the ``StatePool``, and the K/V
    blocks, empty, only account each request's positions)."""
    def has_attention(i, layer):  # a module with a layer_idx beside the layer's stateful mixer
        mixer = set(stateful[i].modules()) if i in stateful else set()
        return any(hasattr(m, "layer_idx") for m in layer.modules() if m is not layer and m not in mixer)

    if not any(has_attention(i, layer) for i, layer in enumerate(layers)):
        return 0, 0
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def _check_attention(c: Checker, config, layers) -> None:
    """Refuse attention variants the ragged causal op cannot run exactly, naming them."""
    name = type(config).__name__
    chunked = [i for i, t in enumerate(getattr(config, "layer_types", None) or []) if "chunked" in str(t)]
    if chunked:
        c.fail(f"{name}: chunked attention (layers {chunked}) is not supported by the Hugging Face backend")
    for key in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, key, None):
            c.fail(f"{name}: {key}={getattr(config, key)} is not supported by the Hugging Face backend")
    for i, layer in enumerate(layers):
        attention = _attention_module(layer)
        if getattr(attention, "is_causal", True) is False:
            c.fail(f"{name}: layer {i} attention is not causal")
        if getattr(attention, "sinks", None) is not None:
            c.fail(f"{name}: attention sinks (layer {i}) are not supported by the Hugging Face backend")


def _eager_reason(model, config, dtype: torch.dtype) -> str | None:
    """Why transformers' forward of ``model`` (weights in ``dtype``) cannot be captured in a CUDA
    graph -- a host synchronisation or a shape read from device values, known from the config --
    or None."""
    name = type(config).__name__
    dynamic = sorted(t for t in _rope_types(config) if "dynamic" in t or t == "longrope")
    if dynamic:  # the frequencies are chosen by comparing the largest position on the host
        return f"{name}: RoPE type {dynamic[0]!r} picks its frequencies on the host from the positions"
    if any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        can_set = getattr(type(model), "_can_set_experts_implementation", None)  # transformers 5's experts interface
        experts = getattr(config, "_experts_implementation", None) if can_set is not None and can_set() else "eager"
        if experts == "grouped_mm" and dtype != torch.bfloat16:
            # torch's grouped GEMM is one kernel in bf16 only; other dtypes loop over offsets copied to the host
            return f"{name}: experts_implementation 'grouped_mm' in {dtype} loops over the experts on the host"
        if experts not in ("grouped_mm", "batched_mm"):
            return f"{name}: experts_implementation {experts!r} loops over the experts each batch hits"
    return None


def _rope_types(config) -> set[str]:
    """The RoPE types of ``config``: ``rope_parameters`` (one set, or one per layer type) or the
    older ``rope_scaling``; ``{"default"}`` when it has none."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sets = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {str(p.get("rope_type", p.get("type", "default"))) for p in sets}


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph capture is under way on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def _log_eager(reason: str) -> None:
    """Say once per reason (targets are re-wrapped per engine) that a target runs without CUDA graphs."""
    log.info("the Hugging Face target runs without CUDA graphs: %s", reason)
