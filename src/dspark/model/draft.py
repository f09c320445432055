"""The DSpark draft model: a Qwen3-style DFlash backbone with KV injection, plus its heads.

One draft round (runtime.md §2, §2.6; reference = DeepSpec's evaluator with its cropped cache):

1. ``forward_block`` projects the captured target hidden states of the newly verified positions,
   ``c = hidden_norm(fc(concat_m h))``, and appends their per-layer keys/values
   (``RoPE(k_norm(k_proj c))``, ``v_proj c``, no ``input_layernorm``) to the ``DraftCache``;
2. the block ``[anchor, mask, ..., mask]`` at positions ``p .. p+N-1`` runs through the layers; its
   queries attend to the cached context (``< p``; on sliding layers only ``>= p - W``) and to the
   block (bidirectional on full-attention layers, causal on sliding ones unless
   ``sliding_window_non_causal``); the block's own K/V are never cached;
3. ``backbone_logits`` = ``lm_head`` over the final-norm hidden states, in the target vocabulary.

Submodule names equal the checkpoint tensor names (runtime.md §6.1), so ``state_dict()`` is the
checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels._validate import Checker
from .config import DSparkConfig
from .draft_runner import DraftRunner, draft_cache
from .heads import ConfidenceHead, MarkovHead, scatter_vocab
from .layers import swiglu

__all__ = ["DSparkDraftModel", "DraftCache", "RMSNorm"]


class RMSNorm(nn.Module):
    """A Qwen3 RMSNorm's ``weight`` ``[size]`` (the draft forward, ``draft_runner``, applies it with
    ``layers.rms_norm`` and the config's ``rms_norm_eps``)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class DraftCache:
    """The draft's context K/V of one sequence: one cache line of a ``DraftRunner`` (the batched
    draft forward), grown by doubling, so appending a round costs amortised O(new tokens).

    Holds positions ``0 .. length-1``: only verified context. A block's K/V are written past
    ``length`` and overwritten by the next context (as vLLM does), never counted in ``length``.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.runner = None  # the DraftRunner, made on first use (it needs the model)
        self.length = 0

    def reserve(self, model, positions: int):
        """The runner, its line holding at least ``positions`` positions."""
        if self.runner is None:
            self.runner = DraftRunner(model, draft_cache(model, 1, max(positions, 64)))
        elif self.runner.max_len < positions:
            self.runner.grow(max(positions, 2 * self.runner.max_len))
        return self.runner

    def crop(self, n: int) -> None:
        """Keep positions ``< n`` (roll back to a shorter verified context)."""
        self.length = Checker("DraftCache.crop").integer("n", n, low=0, high=self.length)


class DraftAttention(nn.Module):
    """Qwen3 attention (``q_norm``/``k_norm``, GQA, no biases) whose keys/values also come from
    the injected context."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        h, d, kv_heads = config.hidden_size, config.head_dim, config.num_key_value_heads
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d)
        self.k_norm = RMSNorm(d)


class DraftMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``swiglu`` of rows ``[N, H]`` (training's MLP: a module call, which FSDP gathers around)."""
        return swiglu(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]), self.down_proj.weight)


class DraftLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = DraftMLP(config)


class DSparkDraftModel(nn.Module):
    """The DSpark draft model (backbone + Markov head + optional confidence head).

    Parameters follow the checkpoint names: ``embed_tokens [V_t, H]``, ``layers.{i}.*``, ``norm``,
    ``fc [H, m*H]``, ``hidden_norm``, ``lm_head [V_d, H]``, ``markov_head.*`` (none at
    ``markov_rank`` 0), ``confidence_head.proj.*``; buffers ``d2t [V_d]`` int64 and ``t2d [V_t]``
    bool only for a reduced vocabulary. Everything the engine consumes is in the target vocabulary V_t.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        h, v_t, v_d, r = config.hidden_size, config.vocab_size, config.draft_vocab_size, config.markov_rank
        self.embed_tokens = nn.Embedding(v_t, h)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h)
        self.fc = nn.Linear(config.num_capture_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h)
        self.lm_head = nn.Linear(h, v_d, bias=False)
        self.markov_head = MarkovHead(h, v_t, v_d, r, config.markov_head_type) if r > 0 else None
        self.confidence_head = (ConfidenceHead(h, r, config.confidence_uses_markov)
                                if config.enable_confidence_head else None)
        if config.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(v_d, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(v_t, dtype=torch.bool))
        self._w2_target_cache: tuple | None = None

    # ---- basic properties ---------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def markov_head_type(self) -> str:
        return self.config.markov_head_type

    @property
    def confidence_with_markov(self) -> bool:
        return self.config.confidence_uses_markov

    @property
    def draft_to_target_ids(self) -> torch.Tensor | None:
        """int64 ``[V_d]`` target id of each draft id (``arange + d2t``); None for a full vocabulary."""
        if not self.config.reduced_vocab:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def new_cache(self) -> DraftCache:
        return DraftCache(self.config.num_hidden_layers)

    # ---- backbone -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward_block(self, cache: DraftCache, context_hidden: torch.Tensor, anchor_token, anchor_position: int):
        """Append context K/V and run the draft block; returns final-norm hidden ``[N, H]`` (model dtype).

        cache: this model's ``DraftCache`` holding positions ``< cache.length``.
        context_hidden: ``[T_new, m*H]`` float, the concatenated captured target hidden states of
            positions ``cache.length .. anchor_position-1`` (``T_new = anchor_position - cache.length``,
            may be 0); their K/V are appended permanently.
        anchor_token: int or 1-element integer tensor, the target id at ``anchor_position`` (slot 0).
        anchor_position: int, absolute position p of the anchor; slot k sits at ``p + k``.
        N = ``block_size``; afterwards ``cache.length == anchor_position``.
        """
        c = Checker("forward_block")
        cfg = self.config
        if not isinstance(cache, DraftCache) or cache.num_layers != cfg.num_hidden_layers:
            c.fail(f"cache must be a DraftCache from this model's new_cache() ({cfg.num_hidden_layers} layers), "
                   f"got {type(cache).__name__}", TypeError)
        p = c.integer("anchor_position", anchor_position, low=cache.length)
        c.tensor("context_hidden", context_hidden, dtype=_FLOAT_DTYPES, device=self.device,
                 shape=[p - cache.length, cfg.num_capture_layers * cfg.hidden_size])
        anchor = self._anchor_tensor(c, anchor_token)

        # the batched draft forward (``DraftRunner``) on this sequence's single cache line
        runner = cache.reserve(self, p + cfg.block_size)
        zeros = torch.zeros(context_hidden.shape[0], dtype=torch.int32, device=self.device)
        runner.context(context_hidden, torch.arange(cache.length, p, dtype=torch.int32, device=self.device), zeros)
        cache.length = p
        i32 = dict(dtype=torch.int32, device=self.device)
        return runner.block(anchor.to(torch.int32), torch.tensor([p], **i32), torch.zeros(1, **i32))

    def _anchor_tensor(self, c: Checker, anchor_token) -> torch.Tensor:
        """The anchor as a 1-element int64 tensor on the model device (no host sync for tensors)."""
        v_t = self.config.vocab_size
        if isinstance(anchor_token, torch.Tensor):
            if anchor_token.numel() != 1 or anchor_token.dtype.is_floating_point or anchor_token.dtype == torch.bool:
                c.fail(f"anchor_token must be an int or a 1-element integer tensor, got {anchor_token.dtype} "
                       f"shape {list(anchor_token.shape)}", TypeError)
            c.ids_in_range("anchor_token", anchor_token, v_t)
            return anchor_token.reshape(1).to(self.device, torch.int64).clamp(0, v_t - 1)
        return torch.tensor([c.integer("anchor_token", anchor_token, low=0, high=v_t - 1)], device=self.device)

    @torch.no_grad()
    def backbone_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` logits, fp32 ``[..., V_t]`` for hidden ``[..., H]``; a reduced-vocabulary
        draft's logits are placed at their target ids with -inf everywhere else."""
        c = Checker("backbone_logits")
        c.tensor("hidden", hidden, dtype=_FLOAT_DTYPES, device=self.device)
        if hidden.dim() < 1 or hidden.shape[-1] != self.config.hidden_size:
            c.fail(f"hidden must have shape [..., {self.config.hidden_size}], got {list(hidden.shape)}")
        logits = self.lm_head(hidden.to(self.dtype)).float()
        if self.config.reduced_vocab:
            logits = scatter_vocab(logits, self.draft_to_target_ids, self.config.vocab_size, -1, float("-inf"))
        return logits

    # ---- Markov head --------------------------------------------------------------------------

    def _markov(self) -> MarkovHead:
        if self.markov_head is None:
            Checker("DSparkDraftModel").fail("this draft has no Markov head (markov_rank is 0)")
        return self.markov_head

    @property
    def markov_w1(self) -> torch.Tensor:
        """``[V_t, R]`` Markov embedding of the previous (target) token, model dtype."""
        return self._markov().markov_w1.weight

    @property
    def markov_w2_target(self) -> torch.Tensor:
        """``[V_t, R]`` Markov output weights in target ids (rows outside a reduced draft vocabulary
        are zero), model dtype. Cached until the weight changes."""
        w2 = self._markov().markov_w2.weight
        if not self.config.reduced_vocab:
            return w2
        key = (w2.data_ptr(), w2._version, w2.device, w2.dtype)
        if self._w2_target_cache is None or self._w2_target_cache[0] != key:
            with torch.no_grad():
                full = scatter_vocab(w2.detach(), self.draft_to_target_ids, self.config.vocab_size, 0, 0.0)
            self._w2_target_cache = (key, full)
        return self._w2_target_cache[1]

    @torch.no_grad()
    def markov_bias(self, hidden_k: torch.Tensor, prev_tokens: torch.Tensor, state: torch.Tensor | None = None):
        """Markov correction of one step for every head type: ``(bias fp32 [B, V_t], state)``.

        hidden_k ``[B, H]`` final-norm hidden of slot k; prev_tokens int ``[B]`` target ids
        ``y_{k-1}``; state: rnn recurrent state fp32 ``[B, R]`` (None before slot 0; passed through
        unchanged for vanilla/gated). Corrected logits = ``backbone_logits + bias``; the bias is 0
        without a Markov head (``markov_rank`` 0).
        """
        c = Checker("markov_bias")
        cfg = self.config
        c.tensor("hidden_k", hidden_k, dtype=_FLOAT_DTYPES, ndim=2, device=self.device)
        b = hidden_k.shape[0]
        c.tensor("hidden_k", hidden_k, shape=[b, cfg.hidden_size])
        prev = self._token_ids(c, "prev_tokens", prev_tokens, [b])
        if self.markov_head is None:
            return torch.zeros(b, cfg.vocab_size, device=self.device), state
        if state is not None and cfg.markov_head_type == "rnn":
            c.tensor("state", state, dtype=torch.float32, shape=[b, cfg.markov_rank], device=self.device)
        bias, state = self.markov_head(hidden_k, prev, state)
        if cfg.reduced_vocab:
            bias = scatter_vocab(bias, self.draft_to_target_ids, cfg.vocab_size, -1, 0.0)
        return bias, state

    @torch.no_grad()
    def markov_start_state(self, hidden_0: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor | None:
        """The Markov state the first drafting slot starts from, for ``B`` blocks: None, except for
        an rnn head without ``sample_from_anchor``, whose state first steps through slot 0 (hidden
        ``hidden_0`` ``[B, H]``, previous token the anchor ``[B]``), as speculators trains it."""
        if self.config.sample_from_anchor or self.markov_head is None or self.config.markov_head_type != "rnn":
            return None
        return self.markov_bias(hidden_0, anchor_tokens)[1]

    # ---- confidence head ----------------------------------------------------------------------

    def _confidence_proj(self) -> nn.Linear:
        if self.confidence_head is None:
            Checker("DSparkDraftModel").fail("this draft has no confidence head (enable_confidence_head is False)")
        return self.confidence_head.proj

    @property
    def confidence_weight(self) -> torch.Tensor:
        """``[H]`` or ``[H + R]`` (hidden part first), model dtype: the kernels' layout."""
        return self._confidence_proj().weight.view(-1)

    @property
    def confidence_bias(self) -> torch.Tensor:
        """``[1]``, model dtype."""
        return self._confidence_proj().bias

    @torch.no_grad()
    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid confidences fp32 ``[B, P]`` from hidden ``[B, P, H]`` and the previous target
        tokens ``[B, P]`` of each slot (slot 0: the anchor)."""
        c = Checker("confidence_logits")
        self._confidence_proj()
        c.tensor("hidden", hidden, dtype=_FLOAT_DTYPES, ndim=3, device=self.device)
        b, p, _ = hidden.shape
        c.tensor("hidden", hidden, shape=[b, p, self.config.hidden_size])
        prev = self._token_ids(c, "prev_tokens", prev_tokens, [b, p])
        embedding = self.markov_head.markov_w1(prev) if self.confidence_with_markov else None
        return self.confidence_head(hidden, embedding)

    def _token_ids(self, c: Checker, name: str, ids: torch.Tensor, shape: list[int]) -> torch.Tensor:
        """Validated int64 target ids; clamped so a bad id on the GPU (unchecked there) cannot
        index out of range."""
        c.tensor(name, ids, dtype=_INT_DTYPES, shape=shape, device=self.device)
        c.ids_in_range(name, ids, self.config.vocab_size)
        return ids.long().clamp(0, self.config.vocab_size - 1)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)
