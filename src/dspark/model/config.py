"""``DSparkConfig``: the draft model's configuration, and its two on-disk spellings.

One dataclass serves both checkpoint formats (runtime.md §6). Its ``capture_layer_ids`` are always
Hugging Face ``output_hidden_states`` indices: speculators' ``aux_hidden_state_layer_ids`` ("input
of decoder layer a" = ``hidden_states[a]``) are taken as they are, DeepSpec's ``target_layer_ids``
("output of decoder layer j" = ``hidden_states[j+1]``) are shifted by one when read and back when
written. Getting this off by one silently ruins acceptance, so it happens only here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..kernels._validate import Checker

__all__ = ["DSparkConfig", "LAYER_TYPES", "MARKOV_HEAD_TYPES", "CHECKPOINT_FORMATS", "TARGET_FIELD_NAMES",
           "target_field"]

LAYER_TYPES = ("full_attention", "sliding_attention")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
CHECKPOINT_FORMATS = ("speculators", "deepspec")
SPECULATORS_MODEL_TYPES = ("dspark", "dflash")
# Keys the peers' loaders require that inference does not use: the speculators release whose
# format dspark writes, and DeepSpec's anchors per training sequence (its default).
SPECULATORS_VERSION = "0.9.0"
DEEPSPEC_NUM_ANCHORS = 64
# the names transformers families give the target fields a draft copies, first choice first
# (GPT-NeoX / Phi: layer_norm_eps, Nemotron-H / Falcon / GPT-2: layer_norm_epsilon, LFM2: norm_eps,
# StarCoder2: norm_epsilon, Falcon: num_kv_heads, Zamba: attention_head_dim, GPT-2: n_inner,
# OPT: ffn_dim, Falcon: ffn_hidden_size)
TARGET_FIELD_NAMES = {
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim", "attention_head_dim"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
}


@dataclass
class DSparkConfig:
    """Configuration of a Qwen3-style DSpark draft model (runtime.md §2-§4, §6).

    Sizes: ``hidden_size`` H (= the target's), ``num_hidden_layers`` draft layers, attention heads
    ``num_attention_heads`` / ``num_key_value_heads`` of ``head_dim`` each (GQA), SwiGLU
    ``intermediate_size``. ``vocab_size`` is the target vocabulary V_t, ``draft_vocab_size`` V_d
    (``None`` means V_t; smaller means a reduced-vocabulary draft with ``d2t``/``t2d``).

    Block: ``block_size`` query slots ``[anchor, mask, ...]``; ``sample_from_anchor`` decides
    whether slot 0 also drafts (``num_draft_tokens``). ``layer_types[i]`` is ``"full_attention"``
    (bidirectional block, all context) or ``"sliding_attention"`` (causal block unless
    ``sliding_window_non_causal``; context limited to ``sliding_window`` positions before the
    anchor). A sliding layer without a window (``sliding_window`` None) is a full-attention layer,
    as speculators runs it, and is stored as one. Only the default RoPE (``rope_theta``) is supported.

    Target link: ``capture_layer_ids`` (HF ``hidden_states`` indices, each ``< num_target_layers``;
    the latter is ``None`` when the checkpoint does not record it), ``mask_token_id`` (a target id).
    Heads: ``markov_rank`` r (0: no Markov head, a DFlash drafter), ``markov_head_type``,
    ``enable_confidence_head``, ``confidence_head_with_markov`` (no effect at rank 0);
    ``sts_temperatures`` T_k per draft position (key ``sts_temperatures`` in ``config.json``; None =
    uncalibrated). Bookkeeping: ``checkpoint_format`` read from, ``dtype`` of the stored weights,
    ``verifier`` (speculators' verifier record).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    capture_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    markov_rank: int
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sample_from_anchor: bool = True
    num_target_layers: int | None = None
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    checkpoint_format: str = "speculators"
    sts_temperatures: list[float] | None = None
    dtype: str = "bfloat16"
    verifier: dict = field(default_factory=dict)

    def __post_init__(self):
        c = Checker("DSparkConfig")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "block_size"):
            c.integer(name, getattr(self, name), low=1)
        c.integer("markov_rank", self.markov_rank, low=0)
        if self.num_attention_heads % self.num_key_value_heads:
            c.fail(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                   f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            c.fail(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        c.integer("draft_vocab_size", self.draft_vocab_size, low=1, high=self.vocab_size)
        c.integer("mask_token_id", self.mask_token_id, low=0, high=self.vocab_size - 1)
        c.real("rms_norm_eps", self.rms_norm_eps, low=0.0)
        c.real("rope_theta", self.rope_theta, low=1.0)
        if not self.sample_from_anchor and self.block_size < 2:
            c.fail(f"block_size must be >= 2 when sample_from_anchor is False (slot 0 drafts nothing), "
                   f"got {self.block_size}")
        self._check_capture_ids(c)
        self._check_choices(c)
        self._check_layer_types(c)
        if self.sts_temperatures is not None:
            self.sts_temperatures = [c.real("sts_temperatures[]", t) for t in self.sts_temperatures]
            if not self.sts_temperatures or min(self.sts_temperatures) <= 0:
                c.fail(f"sts_temperatures must be a non-empty list of positive floats, got {self.sts_temperatures}")

    def _check_capture_ids(self, c: Checker) -> None:
        if not isinstance(self.capture_layer_ids, (list, tuple)) or not self.capture_layer_ids:
            c.fail(f"capture_layer_ids must be a non-empty list of ints, got {self.capture_layer_ids!r}")
        self.capture_layer_ids = [c.integer("capture_layer_ids[]", i, low=0) for i in self.capture_layer_ids]
        if self.num_target_layers is not None:
            c.integer("num_target_layers", self.num_target_layers, low=1)
            if max(self.capture_layer_ids) >= self.num_target_layers:
                c.fail(f"capture_layer_ids {self.capture_layer_ids} must be < num_target_layers "
                       f"({self.num_target_layers}): the last hidden_states entry is post-norm")

    def _check_choices(self, c: Checker) -> None:
        for name, allowed in (("markov_head_type", MARKOV_HEAD_TYPES), ("checkpoint_format", CHECKPOINT_FORMATS),
                              ("dtype", ("float32", "float16", "bfloat16"))):
            if getattr(self, name) not in allowed:
                c.fail(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")

    def _check_layer_types(self, c: Checker) -> None:
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            c.fail(f"layer_types must have num_hidden_layers={self.num_hidden_layers} entries, "
                   f"got {len(self.layer_types)}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            c.fail(f"layer_types entries must be one of {list(LAYER_TYPES)}, got {bad[0]!r}")
        if self.sliding_window is None:  # no window: speculators runs these layers as full attention
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        else:
            c.integer("sliding_window", self.sliding_window, low=1)

    # ---- derived quantities -------------------------------------------------------------------

    @property
    def num_draft_tokens(self) -> int:
        """Tokens drafted per round: every slot with ``sample_from_anchor``, else all but slot 0."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def num_capture_layers(self) -> int:
        """m, the number of captured target layers (``fc`` input is m*H)."""
        return len(self.capture_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @property
    def confidence_uses_markov(self) -> bool:
        """The confidence head reads ``[h ; W1[prev]]``, not ``h`` alone (never at rank 0: no W1)."""
        return self.confidence_head_with_markov and self.markov_rank > 0

    def layer_is_causal(self, i: int) -> bool:
        """Causal block attention in draft layer ``i`` (sliding layers, unless overridden)."""
        return self.layer_types[i] == "sliding_attention" and not self.sliding_window_non_causal

    def layer_window(self, i: int) -> int | None:
        """Context window of draft layer ``i`` (keys at positions >= anchor - W), None = all."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    # ---- on-disk spellings --------------------------------------------------------------------

    def _layer_config(self) -> dict:
        """The Qwen3 layer keys shared by both formats."""
        return {
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }

    def _head_config(self) -> dict:
        out = {
            "block_size": self.block_size,
            "sample_from_anchor": self.sample_from_anchor,
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "dtype": self.dtype,
        }
        if self.sts_temperatures is not None:
            out["sts_temperatures"] = list(self.sts_temperatures)
        return out

    def to_speculators_dict(self) -> dict:
        """``config.json`` of the speculators format (runtime.md §6.1)."""
        return {
            "architectures": ["DSparkDraftModel"],
            "auto_map": {"": "config.DSparkSpeculatorConfig"},
            "speculators_model_type": "dspark",
            "speculators_version": SPECULATORS_VERSION,
            "aux_hidden_state_layer_ids": list(self.capture_layer_ids),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            **self._head_config(),
            "speculators_config": {
                "algorithm": "dspark",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_draft_tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": dict(self.verifier),
            },
            "transformer_layer_config": self._layer_config(),
        }

    def to_deepspec_dict(self) -> dict:
        """``config.json`` of the DeepSpec format (runtime.md §6.2): a flat Qwen3 config.

        DeepSpec drafts are full-vocabulary; a reduced-vocabulary config raises ValueError.
        """
        if self.reduced_vocab:
            Checker("DSparkConfig.to_deepspec_dict").fail(
                f"the DeepSpec format has no reduced vocabulary, got draft_vocab_size={self.draft_vocab_size} "
                f"< vocab_size={self.vocab_size}; save in the speculators format")
        return {
            "architectures": ["Qwen3DSparkModel"],
            **self._layer_config(),
            **self._head_config(),
            "num_target_layers": self.num_target_layers,
            "target_layer_ids": [i - 1 for i in self.capture_layer_ids],
            "num_anchors": DEEPSPEC_NUM_ANCHORS,
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        """Parse a ``config.json`` of either format (detected as runtime.md §11 step 1)."""
        return cls._from_hf_dict(d, detect_format(d))

    @classmethod
    def _from_hf_dict(cls, d: dict, fmt: str) -> "DSparkConfig":
        c = Checker("DSparkConfig.from_dict")
        dflash = d.get("speculators_model_type") == "dflash"
        if fmt == "speculators":
            layer = d.get("transformer_layer_config")
            if not isinstance(layer, dict):
                c.fail("speculators config has no transformer_layer_config object")
            capture = _required(c, d, "aux_hidden_state_layer_ids")
            extra = {"draft_vocab_size": d.get("draft_vocab_size"),
                     "num_target_layers": None,
                     "verifier": dict((d.get("speculators_config") or {}).get("verifier") or {})}
            heads = d
        else:
            layer = d
            legacy = d.get("dflash_config") or {}  # legacy exports nest these two keys
            ids = d.get("target_layer_ids", legacy.get("target_layer_ids"))
            if ids is None:
                c.fail("DeepSpec config has no target_layer_ids")
            capture = [c.integer("target_layer_ids[]", j, low=-1) + 1 for j in ids]
            extra = {"num_target_layers": d.get("num_target_layers")}
            heads = {**legacy, **d}
        _check_layer_support(c, layer)
        # Qwen3Config defaults: use_sliding_window False, sliding_window 4096
        window = layer.get("sliding_window", 4096) if layer.get("use_sliding_window", False) else None
        fields = _layer_fields(c, layer, window)
        if fmt == "deepspec" and window is None and "sliding_attention" in fields["layer_types"]:
            # speculators runs such layers as full attention; what DeepSpec does is not pinned down
            c.fail(f"layer_types holds 'sliding_attention' but there is no window (use_sliding_window="
                   f"{layer.get('use_sliding_window')!r}, sliding_window={layer.get('sliding_window')!r}); "
                   f"set use_sliding_window and sliding_window, or make those layers 'full_attention'")
        if dflash:  # speculators' DFlash drafter: the DSpark backbone without Markov / confidence heads
            head_fields = dict(markov_rank=0, sample_from_anchor=bool(heads.get("sample_from_anchor", False)),
                               enable_confidence_head=False, confidence_head_with_markov=False)
        else:  # defaults of speculators' DSpark config (DeepSpec is always anchor-sampled, runtime.md §6.4)
            head_fields = dict(markov_rank=_required(c, heads, "markov_rank"),
                               sample_from_anchor=bool(heads.get("sample_from_anchor", True)),
                               markov_head_type=heads.get("markov_head_type") or "vanilla",
                               enable_confidence_head=bool(heads.get("enable_confidence_head", True)),
                               confidence_head_with_markov=bool(heads.get("confidence_head_with_markov", True)))
        return cls(
            **fields,
            **head_fields,
            capture_layer_ids=list(capture),
            mask_token_id=_required(c, heads, "mask_token_id"),
            block_size=_required(c, heads, "block_size"),
            sliding_window_non_causal=bool(heads.get("sliding_window_non_causal", False)),
            checkpoint_format=fmt,
            sts_temperatures=heads.get("sts_temperatures"),
            dtype=str(d.get("dtype") or d.get("torch_dtype") or layer.get("dtype") or "bfloat16"),
            **extra,
        )


def target_field(c: Checker, config, field: str, default=None):
    """``field`` of a target's transformers ``config`` under the first of its names
    (``TARGET_FIELD_NAMES``) the config sets; ``default`` when it sets none -- ValueError naming the
    names looked for when there is no default either."""
    names = TARGET_FIELD_NAMES.get(field, (field,))
    value = next((getattr(config, name) for name in names if getattr(config, name, None) is not None), default)
    if value is None:
        c.fail(f"the target's {type(config).__name__} has no {field} (looked for {' / '.join(names)})")
    return value


def detect_format(d: dict) -> str:
    """``"speculators"`` (model type ``dspark`` or ``dflash``) or ``"deepspec"`` for a draft
    ``config.json``; ValueError otherwise."""
    c = Checker("load_draft")
    kind = d.get("speculators_model_type")
    if kind is not None:
        if kind not in SPECULATORS_MODEL_TYPES:
            c.fail(f"unknown checkpoint format: speculators_model_type is {kind!r}, expected one of "
                   f"{list(SPECULATORS_MODEL_TYPES)}")
        return "speculators"
    archs = d.get("architectures") or []
    if "Qwen3DSparkModel" in archs:
        return "deepspec"
    if any(str(a).endswith("DSparkModel") for a in archs):
        c.fail(f"unsupported DeepSpec architecture {archs}: only Qwen3-style drafts (Qwen3DSparkModel) are supported")
    c.fail(f"unknown checkpoint format: config.json has neither speculators_model_type 'dspark' / 'dflash' nor "
           f"architectures ['Qwen3DSparkModel'] (architectures={archs}, model_type={d.get('model_type')!r})")


def _required(c: Checker, d: dict, key: str):
    if d.get(key) is None:
        c.fail(f"config.json is missing the key {key!r}")
    return d[key]


def _check_layer_support(c: Checker, layer: dict) -> None:
    """Reject layer settings the Qwen3-style draft does not implement (rather than run them wrong)."""
    if layer.get("hidden_act", "silu") != "silu":
        c.fail(f"hidden_act must be 'silu', got {layer.get('hidden_act')!r}")
    if layer.get("attention_bias", False):
        c.fail("attention_bias=True is not supported (Qwen3-style drafts have no attention biases)")
    rope_type = (layer.get("rope_parameters") or layer.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type != "default":
        c.fail(f"only the default RoPE is supported, got rope_type {rope_type!r}")


def _layer_fields(c: Checker, layer: dict, window: int | None) -> dict:
    heads = _required(c, layer, "num_attention_heads")
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    layer_types = layer.get("layer_types")
    if layer_types is None:  # Qwen3Config's rule when the list is not spelled out
        first_sliding = layer.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                       for i in range(_required(c, layer, "num_hidden_layers"))]
    return {
        "hidden_size": _required(c, layer, "hidden_size"),
        "num_hidden_layers": _required(c, layer, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or _required(c, layer, "hidden_size") // heads,
        "intermediate_size": _required(c, layer, "intermediate_size"),
        "vocab_size": _required(c, layer, "vocab_size"),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "layer_types": layer_types,
        "sliding_window": window,
    }
