"""One drafting round: draft block -> Markov loop -> confidence head -> per-row scheduler.

The draft block (``DSparkDraftModel.forward_block``) gives final-norm hidden states for the
``N = block_size`` slots ``[anchor, mask, ...]``; slot ``k + slot_offset`` drafts token k, where
``slot_offset`` is 0 with ``sample_from_anchor`` and 1 without (runtime.md §1). The Markov loop then
drafts the P tokens left to right:

* vanilla head of a half-precision draft: greedy, ``dspark.kernels``' fused ``markov_greedy_round``;
  sampled, each step's corrected logits from ``K.build_markov_logits``, then the request stage
  (``RowSampling.filtered_probabilities``) and ``K.sample_probability_rows``, which keeps the exact q
  each token was drawn from; or, with ``draft_candidates`` C > 0, over candidate sets
  (``K.markov_candidate_sample``: each slot's top-C backbone logits and the ``draft_successors`` M
  likeliest bigram successors of the previous token (``K.markov_successor_table``, built once), the
  correction and the request's filters on those only, q zero elsewhere -- still the exact
  distribution of each draft). A greedy
  row in such a batch drafts the argmax of its candidates (its output is the target's argmax either
  way); a batch of greedy rows only takes the fused greedy round, unchanged;
* otherwise (gated / rnn heads, no Markov head at rank 0, a vanilla rank the fused greedy kernel
  does not take, or an fp32 draft): torch, one step at a time through ``model.markov_bias``, then
  the argmax, or the request stage and ``K.sample_probability_rows``. Without ``sample_from_anchor``
  an rnn head's state first steps through slot 0 (``model.markov_start_state``).

The head kernels take fp16/bf16 weights only. An fp32 draft runs its heads in torch in fp32 rather
than through bf16 copies of W1/W2 and the confidence weights, which would flip greedy near-ties
against the model's own math.

Drafts are sampled through the same request stage as the target's probabilities
(``RowSampling``: logit_bias, temperature, min_p, top-k, top-p as vLLM applies them, and the
penalties, min_tokens and bad_words on the committed output -- not on the drafts before each step,
which verification counts: that gained nothing measurable), so drafts stay likely under the
distribution verification reproduces, and q is exactly the distribution each token came from, so
verification stays lossless (runtime.md §3.9 note, §12). The request's logit
bias is added to the block's backbone logits: the Markov correction is additive too, so every
corrected step carries it. Scheduling (chain mode, one row):
``off`` verifies all P drafts; ``threshold`` / ``sps`` go through
``K.compute_confidence_and_proposal_lengths`` / ``K.compute_confidence_and_sps_proposal_lengths``,
except for a draft with STS temperatures (``config.sts_temperatures``): the fused kernels have no
per-position temperature, so its calibrated confidences ``sigmoid(logit_k / T_k)`` come from
``model.confidence_logits`` and the same length rules run on them; so do an fp32 draft's and a
rank-0 draft's (the kernels need a half-precision W1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import kernels as K
from ..kernels._validate import HALF_DTYPES, Checker
from .penalties import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, RowPenalties, Window
from .structured import StructuredOutputs

__all__ = ["Drafter", "Proposal", "RowSampling", "SamplingParams", "SCHEDULERS", "MAX_LOGIT_BIAS_TOKENS",
           "LOGIT_BIAS_LIMIT", "PENALTY_LIMIT"]

SCHEDULERS = ("off", "threshold", "sps")
# token ids one request may bias: the runner stages a joining request's biases at fixed addresses
# (``ChunkBuffers``), this many per seat
MAX_LOGIT_BIAS_TOKENS = 1024
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most, as OpenAI's API
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| at most, as OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling, as vLLM's sampler and transformers' warpers define it (``RowSampling``):
    ``logit_bias`` (token id -> bias in [-100, 100], added to the raw logits), the controls that
    read the tokens so far (``reads_history``; ``penalties.py``: ``min_tokens`` >= 0, the stop / EOS
    ids banned until that many tokens were generated; ``bad_words``, token-id sequences whose last
    token is banned where the others end the output; ``repetition_penalty`` > 0 over prompt and
    output; ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] over the output), ``temperature``,
    ``min_p`` in [0, 1] (keep tokens with ``p >= min_p * p_max``), ``top_k``, ``top_p`` (the
    standard nucleus: the boundary token kept whole) and the uniforms' ``seed``.

    ``top_k`` 0 or negative (vLLM's -1) means no top-k filter (stored as 0). Greedy when
    ``temperature < K.GREEDY_TEMPERATURE`` or ``top_k == 1``: the argmax of the processed logits.
    ``logit_bias`` is stored as ``((token id, bias), ...)`` sorted by id (a mapping or pairs are
    taken; at most ``MAX_LOGIT_BIAS_TOKENS`` ids, each once); ``bad_words`` as a tuple of tuples
    (at most ``MAX_BAD_WORDS`` of two tokens or more, each at most ``MAX_BAD_WORD_TOKENS``); the
    engine checks the ids against its vocabulary (and ``min_tokens`` against ``max_new_tokens``).
    ``structured_outputs``: what the output must match (``structured.StructuredOutputs``: a JSON
    schema, any JSON object, a regex, a choice, an EBNF grammar), or None.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputs | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        c = Checker("SamplingParams")
        c.real("temperature", self.temperature, low=0.0)
        if c.integer("top_k", self.top_k) < 0:
            object.__setattr__(self, "top_k", 0)
        c.real("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            c.fail(f"top_p must be in (0, 1], got {self.top_p}")
        c.integer("seed", self.seed, low=0, high=2**64 - 1)
        c.real("min_p", self.min_p, low=0.0, high=1.0)
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(c, self.logit_bias))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            c.fail("structured_outputs must be a StructuredOutputs (or None), got "
                   f"{type(self.structured_outputs).__name__}", TypeError)
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, c.real(name, getattr(self, name), low=-PENALTY_LIMIT, high=PENALTY_LIMIT))
        if c.real("repetition_penalty", self.repetition_penalty) <= 0.0:
            c.fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        c.integer("min_tokens", self.min_tokens, low=0)
        if self.min_tokens and self.structured_outputs is not None:
            c.fail(f"min_tokens ({self.min_tokens}) cannot be combined with structured_outputs: where the grammar "
                   "allows only the stop token, min_tokens bans it and no token is left (the grammar decides where "
                   "the output ends)")
        object.__setattr__(self, "bad_words", _bad_words(c, self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature < K.GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def reads_history(self) -> bool:
        """Whether a control reads the tokens so far (penalties, min_tokens, bad_words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or bool(self.bad_words))

    @property
    def plain_argmax(self) -> bool:
        """Whether the token is the argmax of the raw logits (greedy, no bias, no penalty): the
        runner's argmax paths serve such a row without building its distribution."""
        return self.greedy and not self.logit_bias and not self.reads_history

    @property
    def seed_bits(self) -> int:
        """The seed as ``K.request_uniforms`` takes it: the int64 with its unsigned 64-bit pattern."""
        return self.seed - (1 << 64) if self.seed >= 1 << 63 else self.seed

    def rows(self, batch: int, device, vocab: int | None = None) -> "RowSampling":
        """These settings for ``batch`` rows, as the per-row tensors the request stage takes (the
        bias dense over a ``vocab``-token model's logits; None without a bias)."""
        bias = None
        if self.logit_bias:
            if vocab is None:
                raise ValueError("SamplingParams.rows: a logit_bias needs the vocabulary size (vocab=)")
            bias = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
            ids, values = zip(*self.logit_bias)
            bias[:, list(ids)] = torch.tensor(values, dtype=torch.float32, device=device)
        return RowSampling(torch.full((batch,), self.temperature, dtype=torch.float32, device=device),
                           torch.full((batch,), self.top_k, dtype=torch.int32, device=device),
                           torch.full((batch,), self.top_p, dtype=torch.float32, device=device),
                           torch.full((batch,), self.min_p, dtype=torch.float32, device=device), bias)


def _logit_bias_pairs(c: Checker, logit_bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or ``(id, bias)`` pairs) as sorted pairs of an int id >= 0 and a
    float bias in [-100, 100]; ValueError / TypeError naming the entry otherwise."""
    if isinstance(logit_bias, Mapping):
        pairs = list(logit_bias.items())
    elif isinstance(logit_bias, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2
                                                       for p in logit_bias):
        pairs = list(logit_bias)
    else:
        c.fail(f"logit_bias must map token ids to biases (a dict), got {type(logit_bias).__name__}", TypeError)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        c.fail(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {len(pairs)}")
    checked = {}
    for token, bias in pairs:
        token = c.integer("logit_bias token id", token, low=0)
        if token in checked:
            c.fail(f"logit_bias names token id {token} twice")
        checked[token] = float(c.real(f"logit_bias[{token}]", bias, low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT))
    return tuple(sorted(checked.items()))


def _bad_words(c: Checker, bad_words) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` (token-id sequences) as a tuple of non-empty tuples of int ids >= 0, within the
    device table's bounds; TypeError / ValueError naming the entry otherwise."""
    if isinstance(bad_words, (str, bytes)) or not isinstance(bad_words, (tuple, list)):
        c.fail(f"bad_words must be a list of token-id sequences, got {type(bad_words).__name__}", TypeError)
    words = []
    for i, word in enumerate(bad_words):
        if isinstance(word, (str, bytes)) or not isinstance(word, (tuple, list)) or not word:
            c.fail(f"bad_words[{i}] must be a non-empty list of token ids, got {word!r}", TypeError)
        if len(word) > MAX_BAD_WORD_TOKENS:
            c.fail(f"bad_words[{i}] may hold at most {MAX_BAD_WORD_TOKENS} tokens, got {len(word)}")
        words.append(tuple(c.integer(f"bad_words[{i}] token id", t, low=0) for t in word))
    multi = sum(len(w) > 1 for w in words)
    if multi > MAX_BAD_WORDS:
        c.fail(f"bad_words may hold at most {MAX_BAD_WORDS} sequences of two tokens or more, got {multi}")
    return tuple(words)


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings of B rows as device tensors -- ``temperature`` f32 ``[B]`` (a greedy row:
    below ``K.GREEDY_TEMPERATURE``, or ``top_k`` 1), ``top_k`` int32 ``[B]`` (0: off), ``top_p`` f32
    ``[B]``, ``min_p`` f32 ``[B]`` (0: off), ``logit_bias`` f32 ``[B, V]`` (dense; None: no bias),
    ``penalties`` (the state the penalties, min_tokens and bad_words read; None: none) -- so that
    one launch, and one CUDA graph, serves rows of any settings; each row's result is the one its
    own settings give (every operation works along a row).

    The request stage, in vLLM's sampler order (``vllm/v1/sample/sampler.py``): the bias added to the
    raw logits; min_tokens' and bad_words' masks, the repetition, frequency and presence penalties
    (``RowPenalties.apply``: at each position of a verify window, with the window's tokens before
    it); a greedy row's one-hot argmax of those; else temperature (a division, as vLLM and
    transformers' ``TemperatureLogitsWarper``), min_p on the softmax of the scaled logits, then top-k
    (ties with the k-th value kept) and top-p (the standard nucleus over what min_p and top-k left,
    the boundary token kept whole) as vLLM's ``apply_top_k_top_p``, and the softmax of what is left.
    transformers' default warper order runs min_p after top-p; min_p and top-k commute (each keeps
    a set of the largest logits, min_p's independent of renormalisation), so the two orders differ
    only in the mass top-p sees -- here min_p's survivors, as vLLM.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    logit_bias: torch.Tensor | None = None
    penalties: RowPenalties | None = None

    def biased(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, V]`` or ``[B, L, V]`` plus each row's bias (row b's on its L rows)."""
        if self.logit_bias is None:
            return logits
        return logits + (self.logit_bias if logits.dim() == 2 else self.logit_bias[:, None])

    def processed(self, logits: torch.Tensor, window: Window | None = None) -> torch.Tensor:
        """fp32 logits ``[B, V]`` or ``[B, L, V]`` with the bias, masks and penalties of each row
        (position l of a verify ``window`` with the window's tokens on its path); ``logits`` is kept.
        One new ``[B, L, V]`` tensor at most (the biased logits, or a copy the penalties rewrite)."""
        if self.penalties is None:
            return self.biased(logits)
        return self.penalties.apply_(logits.clone() if self.logit_bias is None else self.biased(logits), window)

    def probabilities(self, logits: torch.Tensor, window: Window | None = None, *, workspace=None) -> torch.Tensor:
        """f32 probabilities of fp32 logits ``[B, V]`` (or ``[B, L, V]``: row b's settings on its L
        rows, at the positions of ``window``) through the whole request stage (class docstring). No
        host synchronisation; ``workspace``: the kernels' scratch (``K.Workspace``; None: the default)."""
        if self.penalties is None:  # the bias rides in the filters' first pass, not a [rows, V] pass of its own
            return self._filtered(logits, self.logit_bias, workspace)
        return self._filtered(self.processed(logits, window), None, workspace)

    def filtered_probabilities(self, logits: torch.Tensor, *, workspace=None) -> torch.Tensor:
        """``probabilities`` of logits that already carry their bias and penalties (the drafter's,
        biased in its backbone logits)."""
        return self._filtered(logits, None, workspace)

    def _filtered(self, logits: torch.Tensor, logit_bias: torch.Tensor | None, workspace) -> torch.Tensor:
        """``K.request_probabilities`` (Triton on CUDA, the torch reference on the CPU) of ``logits``
        plus ``logit_bias`` ``[B, V]`` (None: none)."""
        rows = logits.reshape(self.temperature.shape[0], -1, logits.shape[-1])
        return K.request_probabilities(rows, self.temperature, self.top_k, self.top_p, self.min_p,
                                       logit_bias=logit_bias, workspace=workspace).view(logits.shape)


@dataclass
class Proposal:
    """Drafted chains of B rows.

    ``token_ids`` int32 ``[B, P]`` (target ids); ``probabilities`` f32 ``[B, P, V]`` the distribution
    each token was drawn from (``None`` when greedy); ``proposal_lengths`` int32 ``[B]`` drafts to
    verify (the scheduler's choice, in [1, P]); ``confidence`` f32 ``[B, P]`` (``None`` when the
    scheduler is off).
    """

    token_ids: torch.Tensor
    probabilities: torch.Tensor | None
    proposal_lengths: torch.Tensor
    confidence: torch.Tensor | None


class Drafter:
    """Drafts P tokens per round from the blocks of a ``DSparkDraftModel`` (the engine's runner
    runs the blocks: ``model.draft_runner.DraftRunner``).

    ``scheduler``: ``"off"``, ``"threshold"`` (``threshold`` = minimum prefix survival) or
    ``"sps"`` (``threshold`` = survival floor); the latter two need the confidence head.
    ``min_proposal_len`` / ``max_proposal_len`` (0 = P) bound the scheduled length.
    ``draft_candidates`` C > 0: sampled rows draft over each slot's top-C backbone logits and the
    previous token's ``draft_successors`` M likeliest bigram successors (module docstring; a vanilla
    head in half precision, others draft over the vocabulary); 0: the vocabulary.
    """

    def __init__(self, model, *, scheduler: str = "off", threshold: float = 0.0, min_proposal_len: int = 1,
                 max_proposal_len: int = 0, draft_candidates: int = 0, draft_successors: int = 0):
        c = Checker("Drafter")
        if scheduler not in SCHEDULERS:
            c.fail(f"scheduler must be one of {list(SCHEDULERS)}, got {scheduler!r}")
        if scheduler != "off" and model.confidence_head is None:
            c.fail(f"scheduler {scheduler!r} needs a confidence head, but the draft has none (enable_confidence_head is False)")
        self.model = model
        self.config = model.config
        self.scheduler = scheduler
        # a minimum prefix survival (threshold) or a survival floor (sps): a probability either way
        self.threshold = c.real("threshold", threshold, low=0.0, high=1.0)
        self.min_proposal_len = c.integer("min_proposal_len", min_proposal_len, low=0)
        self.max_proposal_len = c.integer("max_proposal_len", max_proposal_len, low=0)
        self.draft_candidates = c.integer("draft_candidates", draft_candidates, low=0)
        draft_successors = c.integer("draft_successors", draft_successors, low=0)
        self.num_draft_tokens = self.config.num_draft_tokens
        self.block_size = self.config.block_size
        self.slot_offset = 0 if self.config.sample_from_anchor else 1
        # The head kernels take fp16/bf16 weights only: other drafts run their heads in torch (module docstring).
        kernel_heads = model.dtype in HALF_DTYPES and self.config.markov_rank > 0
        self.kernel_markov = kernel_heads and model.markov_head_type == "vanilla"
        self.fused_greedy = self.kernel_markov and K.fused_greedy_supported(self.config.markov_rank)
        self.sts_temperatures = _sts_temperatures(self.config.sts_temperatures, self.num_draft_tokens, model.device)
        self.kernel_confidence = kernel_heads and scheduler != "off" and self.sts_temperatures is None
        if kernel_heads:
            self.markov_w1, self.markov_w2 = model.markov_w1.detach(), model.markov_w2_target.detach()
        self.successor_ids = None  # int32 [V, M]: the candidate drafter's bigram successors
        if self.kernel_markov and self.draft_candidates and draft_successors:
            vocab = self.markov_w1.shape[0]
            self.successor_ids = K.markov_successor_table(self.markov_w1, self.markov_w2, min(draft_successors, vocab))
        if self.kernel_confidence:
            self.confidence_weight, self.confidence_bias = model.confidence_weight.detach(), model.confidence_bias.detach()
        self.workspace = None  # a K.Workspace owned by the caller (the engine's runner), else the kernels' default

    def propose_rows(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                     sampling: "RowSampling | None", uniforms: torch.Tensor | None, stacked_logits=None,
                     logit_bias: torch.Tensor | None = None, probabilities_out: torch.Tensor | None = None) -> Proposal:
        """Markov loop, confidence and schedule for B blocks drafted elsewhere.

        ``hidden`` ``[B*N, H]`` final-norm block hidden states and ``logits`` f32 ``[B*N, V]`` their
        backbone logits (row ``b*N + k`` = slot k of block b); ``anchors`` int32 ``[B]``;
        ``sampling`` the rows' settings (None: every row greedy; a greedy row among sampled ones draws
        its one-hot argmax) and ``uniforms`` f32 ``[B, P]`` draft uniforms (ignored when greedy).
        ``logit_bias`` f32 ``[B, V]`` (None: none; the rows' ``logit_bias``) is added to every slot of
        block b, in place: ``logits`` is overwritten (a second ``[B*N, V]`` tensor would add to the
        draft pass's peak memory) -- except by the candidate round, whose kernels add it where they
        read the logits (no pass over them). Sampled rows pass theirs in ``sampling`` too, whose penalties, on
        the committed output, and filters run on the corrected logits. ``stacked_logits`` f32 ``[B, P+1, V]`` (tree
        mode, greedy): depth row ``s + 1`` receives step ``s``'s Markov-corrected logits along the
        greedy chain. ``probabilities_out`` f32 ``[B, P, V]`` (None: a new tensor) receives the sampled
        drafts' distributions, which ``Proposal.probabilities`` then is (the runner's row buffer: no
        copy of ``B * P * V`` floats). No host synchronisation.
        """
        candidates = self.draft_candidates and self.kernel_markov and sampling is not None
        if logit_bias is not None and not candidates:  # the candidate round adds it where it reads the logits
            logits.view(anchors.shape[0], self.block_size, -1).add_(logit_bias[:, None])
        if self.fused_greedy and sampling is None:
            tokens = K.markov_greedy_round(logits, self.markov_w1, self.markov_w2, anchors,
                                           proposal_len=self.num_draft_tokens, stacked_logits=stacked_logits,
                                           logits_stride=self.block_size, logits_offset=self.slot_offset)
            probs = None
        elif candidates:
            tokens, probs = self._candidate_round(logits, anchors, sampling, uniforms, logit_bias, probabilities_out)
        else:
            tokens, probs = self._stepwise(hidden, logits, anchors, sampling, uniforms, stacked_logits,
                                           probabilities_out)
        lengths, confidence = self._schedule(hidden, anchors, tokens)
        return Proposal(tokens, probs, lengths, confidence)

    def _candidate_round(self, logits, anchors, sampling, uniforms, logit_bias=None, out=None):
        """The sampled Markov loop over candidate sets (``K.markov_candidate_sample``, on the backbone
        logits plus ``logit_bias``): tokens int32 ``[B, P]`` and their distributions f32 ``[B, P, V]``
        (in ``out`` where given), dense for verification (zero outside each step's candidates)."""
        vocab = logits.shape[-1]
        tokens, ids, q = K.markov_candidate_sample(
            logits, self.markov_w1, self.markov_w2, anchors, uniforms, sampling.temperature, sampling.top_k,
            sampling.top_p, sampling.min_p, candidates=min(self.draft_candidates, vocab),
            successor_ids=self.successor_ids, logits_stride=self.block_size, logits_offset=self.slot_offset,
            logit_bias=logit_bias)
        # add, not assign: a duplicate candidate holds 0 and must not overwrite its first lane's mass
        probs = torch.zeros(*tokens.shape, vocab, device=logits.device) if out is None else out.zero_()
        return tokens, probs.scatter_add_(2, ids.long(), q)

    def _stepwise(self, hidden, logits, anchors, sampling, uniforms, stacked_logits=None, out=None):
        """The Markov loop one step at a time: a sampled vanilla head's corrected logits from the
        kernel (``K.build_markov_logits``), the others' in torch in the draft's precision (see the
        module docstring); sampled steps through the request stage, their distributions stored in
        ``out`` where given."""
        p, batch = self.num_draft_tokens, anchors.shape[0]
        flat_logits = logits
        hidden = hidden.view(batch, self.block_size, -1)
        logits = logits.view(batch, self.block_size, -1)
        tokens = torch.zeros(batch, p, dtype=torch.int32, device=logits.device)
        probs = out
        if sampling is not None and out is None:
            probs = torch.empty(batch, p, logits.shape[-1], device=logits.device)
        kernel_steps = self.kernel_markov and sampling is not None
        prev, state = anchors, None if kernel_steps else self.model.markov_start_state(hidden[:, 0], anchors)
        for step in range(p):
            row = step + self.slot_offset
            if kernel_steps:
                corrected = K.build_markov_logits(flat_logits, self.markov_w1, self.markov_w2, anchors, tokens, step,
                                                  logits_stride=self.block_size, logits_offset=self.slot_offset)
            else:
                bias, state = self.model.markov_bias(hidden[:, row], prev, state)
                corrected = logits[:, row] + bias
            if stacked_logits is not None:
                stacked_logits[:, step + 1] = corrected
            if sampling is None:  # greedy: the argmax (no distribution to build: a sort of V per step)
                tokens[:, step] = corrected.argmax(-1)
            else:
                if sampling.penalties is not None:  # on the committed output: q nearer the verified p
                    corrected = sampling.penalties.apply(corrected)
                q = sampling.filtered_probabilities(corrected, workspace=self.workspace)
                K.sample_probability_rows(q, uniforms, tokens, step, workspace=self.workspace)
                K.store_draft_step_probabilities(q, probs, step)
            prev = tokens[:, step]
        return tokens, probs

    def _schedule(self, hidden, anchors, tokens):
        batch, p = tokens.shape
        if self.scheduler == "off":
            return K.fill_proposal_lengths(batch, p, device=tokens.device), None
        if not self.kernel_confidence:
            return self._schedule_torch(hidden, anchors, tokens)
        args = (hidden, self.markov_w1, self.confidence_weight, self.confidence_bias, anchors, tokens)
        kwargs = dict(confidence_with_markov=self.model.confidence_with_markov, min_proposal_len=self.min_proposal_len,
                      max_proposal_len=self.max_proposal_len, hidden_stride=self.block_size,
                      hidden_offset=self.slot_offset)
        if self.scheduler == "threshold":
            confidence, lengths = K.compute_confidence_and_proposal_lengths(*args, threshold=self.threshold, **kwargs)
        else:
            confidence, lengths = K.compute_confidence_and_sps_proposal_lengths(*args, survival_floor=self.threshold, **kwargs)
        return lengths, confidence

    def _schedule_torch(self, hidden, anchors, tokens):
        """Confidences ``sigmoid(logit_k)``, calibrated ``sigmoid(logit_k / T_k)`` with STS
        temperatures (runtime.md §4), from ``model.confidence_logits``, then the same threshold / SPS
        rules as the kernels (``K.threshold_proposal_lengths`` / ``K.sps_proposal_lengths``)."""
        batch, p = tokens.shape
        rows = hidden.view(batch, self.block_size, -1)[:, self.slot_offset:self.slot_offset + p]
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        logits = self.model.confidence_logits(rows, prev)
        confidence = torch.sigmoid(logits if self.sts_temperatures is None else logits / self.sts_temperatures)
        return self.proposal_lengths(confidence), confidence

    def proposal_lengths(self, confidence: torch.Tensor) -> torch.Tensor:
        """int32 ``[B]`` drafts to verify under this drafter's scheduler from f32 ``[B, P]``
        confidences (the threshold / SPS rules of ``K.threshold_proposal_lengths`` /
        ``K.sps_proposal_lengths``; every draft when the scheduler is off). No host synchronisation."""
        batch, p = confidence.shape
        if self.scheduler == "off":
            return K.fill_proposal_lengths(batch, p, device=confidence.device)
        rule = K.threshold_proposal_lengths if self.scheduler == "threshold" else K.sps_proposal_lengths
        return rule(confidence, self.threshold, min_proposal_len=self.min_proposal_len,
                    max_proposal_len=self.max_proposal_len)


def _sts_temperatures(temperatures, num_draft_tokens: int, device) -> torch.Tensor | None:
    """f32 ``[P]`` STS temperatures T_1..T_P; positions past a shorter list reuse its last value."""
    if temperatures is None:
        return None
    values = list(temperatures)[:num_draft_tokens]
    values += values[-1:] * (num_draft_tokens - len(values))
    return torch.tensor(values, dtype=torch.float32, device=device)
