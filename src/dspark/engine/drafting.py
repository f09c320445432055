"""One drafting round: draft block -> Markov loop -> confidence head -> per-row scheduler.

The draft block (``DSparkDraftModel.forward_block``) gives final-norm hidden states for the
``N = block_size`` slots ``[anchor, mask, ...]``; slot ``k + slot_offset`` drafts token k, where
``slot_offset`` is 0 with ``sample_from_anchor`` and 1 without (runtime.md §1). The Markov loop then
drafts the P tokens left to right:

* vanilla head of a half-precision draft: ``dspark.kernels`` -- ``markov_greedy_round`` (greedy)
  or ``vanilla_markov_sample`` (sampled, which also returns the exact q each token was drawn from);
* otherwise (gated / rnn heads, no Markov head at rank 0, a vanilla rank the fused greedy kernel
  does not take, or an fp32 draft): torch, one step at a time through ``model.markov_bias``, then
  ``K.logits_to_probabilities`` + ``K.sample_probability_rows``. Without ``sample_from_anchor`` an
  rnn head's state first steps through slot 0 (``model.markov_start_state``).

The head kernels take fp16/bf16 weights only. An fp32 draft runs its heads in torch in fp32 rather
than through bf16 copies of W1/W2 and the confidence weights, which would flip greedy near-ties
against the model's own math.

Drafts are sampled with the same temperature / top-k / top-p function as the target's probabilities
(``K.logits_to_probabilities``), so q is exactly the distribution each token came from and
verification stays lossless (runtime.md §3.9 note). Scheduling (chain mode, one row):
``off`` verifies all P drafts; ``threshold`` / ``sps`` go through
``K.compute_confidence_and_proposal_lengths`` / ``K.compute_confidence_and_sps_proposal_lengths``,
except for a draft with STS temperatures (``config.sts_temperatures``): the fused kernels have no
per-position temperature, so its calibrated confidences ``sigmoid(logit_k / T_k)`` come from
``model.confidence_logits`` and the same length rules run on them; so do an fp32 draft's and a
rank-0 draft's (the kernels need a half-precision W1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels as K
from ..kernels._validate import HALF_DTYPES, Checker

__all__ = ["Drafter", "Proposal", "RowSampling", "SamplingParams", "SCHEDULERS"]

SCHEDULERS = ("off", "threshold", "sps")


@dataclass(frozen=True)
class SamplingParams:
    """Temperature / top-k / top-p of ``K.logits_to_probabilities`` and the uniforms' seed.

    ``top_k`` 0 or negative (vLLM's -1) means no top-k filter (stored as 0). Greedy when
    ``temperature < K.GREEDY_TEMPERATURE`` or ``top_k == 1`` (the kernels' one-hot case).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        c = Checker("SamplingParams")
        c.real("temperature", self.temperature, low=0.0)
        if c.integer("top_k", self.top_k) < 0:
            object.__setattr__(self, "top_k", 0)
        c.real("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            c.fail(f"top_p must be in (0, 1], got {self.top_p}")
        c.integer("seed", self.seed, low=0, high=2**64 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < K.GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def seed_bits(self) -> int:
        """The seed as ``K.request_uniforms`` takes it: the int64 with its unsigned 64-bit pattern."""
        return self.seed - (1 << 64) if self.seed >= 1 << 63 else self.seed

    def rows(self, batch: int, device) -> "RowSampling":
        """These settings for ``batch`` rows, as the per-row tensors every sampling kernel call takes."""
        return RowSampling(torch.full((batch,), self.temperature, dtype=torch.float32, device=device),
                           torch.full((batch,), self.top_k, dtype=torch.int32, device=device),
                           torch.full((batch,), self.top_p, dtype=torch.float32, device=device))


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings of B rows as device tensors -- ``temperature`` f32 ``[B]``, ``top_k`` int32
    ``[B]``, ``top_p`` f32 ``[B]`` (a greedy row: temperature 0) -- so that one kernel launch, and one
    CUDA graph, serves rows of any settings; each row's result is the one its own settings give."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def probabilities(self, logits: torch.Tensor, workspace=None) -> torch.Tensor:
        """f32 probabilities of fp32 logits ``[B, V]`` (or ``[B, L, V]``: row b's settings on its L rows)."""
        return K.logits_to_probabilities(logits, self.temperature, self.top_k, self.top_p, workspace=workspace)


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
    """

    def __init__(self, model, *, scheduler: str = "off", threshold: float = 0.0, min_proposal_len: int = 1,
                 max_proposal_len: int = 0):
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
        if self.kernel_confidence:
            self.confidence_weight, self.confidence_bias = model.confidence_weight.detach(), model.confidence_bias.detach()
        self.workspace = None  # a K.Workspace owned by the caller (the engine's runner), else the kernels' default

    def propose_rows(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                     sampling: "RowSampling | None", uniforms: torch.Tensor | None, stacked_logits=None) -> Proposal:
        """Markov loop, confidence and schedule for B blocks drafted elsewhere.

        ``hidden`` ``[B*N, H]`` final-norm block hidden states and ``logits`` f32 ``[B*N, V]`` their
        backbone logits (row ``b*N + k`` = slot k of block b); ``anchors`` int32 ``[B]``;
        ``sampling`` the rows' settings (None: every row greedy; a greedy row among sampled ones draws
        its one-hot argmax) and ``uniforms`` f32 ``[B, P]`` draft uniforms (ignored when greedy).
        ``stacked_logits`` f32 ``[B, P+1, V]`` (tree mode, greedy): depth row ``s + 1`` receives step
        ``s``'s Markov-corrected logits along the greedy chain. No host synchronisation.
        """
        if self.kernel_markov and (self.fused_greedy or sampling is not None):
            tokens, probs = self._vanilla(logits, anchors, sampling, uniforms, stacked_logits)
        else:
            tokens, probs = self._stepwise(hidden, logits, anchors, sampling, uniforms, stacked_logits)
        lengths, confidence = self._schedule(hidden, anchors, tokens)
        return Proposal(tokens, probs, lengths, confidence)

    def _vanilla(self, logits, anchors, sampling, uniforms, stacked_logits=None):
        rows = dict(logits_stride=self.block_size, logits_offset=self.slot_offset)
        if sampling is None:
            tokens = K.markov_greedy_round(logits, self.markov_w1, self.markov_w2, anchors,
                                           proposal_len=self.num_draft_tokens, stacked_logits=stacked_logits, **rows)
            return tokens, None
        return K.vanilla_markov_sample(logits, self.markov_w1, self.markov_w2, anchors, uniforms,
                                       sampling.temperature, sampling.top_k, sampling.top_p, **rows,
                                       workspace=self.workspace)

    def _stepwise(self, hidden, logits, anchors, sampling, uniforms, stacked_logits=None):
        """Sequential Markov loop in torch in the draft's precision (see the module docstring)."""
        p, batch = self.num_draft_tokens, anchors.shape[0]
        hidden = hidden.view(batch, self.block_size, -1)
        logits = logits.view(batch, self.block_size, -1)
        tokens = torch.zeros(batch, p, dtype=torch.int32, device=logits.device)
        probs = None if sampling is None else torch.empty(batch, p, logits.shape[-1], device=logits.device)
        prev, state = anchors, self.model.markov_start_state(hidden[:, 0], anchors)
        for step in range(p):
            row = step + self.slot_offset
            bias, state = self.model.markov_bias(hidden[:, row], prev, state)
            corrected = logits[:, row] + bias
            if stacked_logits is not None:
                stacked_logits[:, step + 1] = corrected
            if sampling is None:  # greedy: the argmax (no distribution to build: a sort of V per step)
                tokens[:, step] = corrected.argmax(-1)
            else:
                q = sampling.probabilities(corrected, self.workspace)
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
