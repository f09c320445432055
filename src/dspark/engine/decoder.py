"""Lossless DSpark speculative decoding, chain mode, one request at a time.

One round (runtime.md Part II §5.3)::

    draft   : proposal = drafter.propose(context, anchor)        P tokens (+ q), scheduled length P_v
    verify  : target([anchor, y_1 .. y_Pv])                      fp32 logits [P_v+1, V], hidden states
    accept  : greedy_accept, or probabilistic_accept on the target's probabilities (same T/top-k/top-p)
    commit  : n tokens = accepted drafts + bonus/correction; KV cropped to the accepted prefix;
              the hidden states of [anchor, accepted drafts] are the next round's draft context

Prefill samples the first token (the first anchor) from the prompt's last logits. Sampling draws
its uniforms with ``K.fill_uniforms(seed, offset)`` per round r >= 1: P draft uniforms at offset
``r*(3P+1)`` and 2P+1 accept uniforms at ``r*(3P+1) + P``; the prefill token uses offset 0. A run is
therefore reproducible for a given seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import kernels as K
from ..kernels._validate import Checker
from .drafting import Drafter, Proposal, SamplingParams
from .stats import GenerationStats
from .target import TargetModel, eos_token_ids

__all__ = ["GenerationResult", "SpeculativeDecoder", "autoregressive_generate", "generate"]

TokenCallback = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded; EOS included when it ended the output) and statistics."""

    token_ids: list[int]
    stats: GenerationStats


class SpeculativeDecoder:
    """Speculative decoding of a ``TargetModel`` with a ``Drafter`` (or any object with
    ``num_draft_tokens``, ``reset()`` and ``propose(...)`` -> ``Proposal``)."""

    def __init__(self, target: TargetModel, drafter: Drafter):
        self.target = target
        self.drafter = drafter
        self.num_drafts = drafter.num_draft_tokens

    @classmethod
    def from_models(cls, target_model: torch.nn.Module, draft_model, **drafter_options) -> "SpeculativeDecoder":
        """Pair a Hugging Face causal LM with a ``DSparkDraftModel`` (checked compatible)."""
        from ..model import check_target_compatible

        check_target_compatible(draft_model.config, target_model.config)
        return cls(TargetModel(target_model, draft_model.config.capture_layer_ids), Drafter(draft_model, **drafter_options))

    @classmethod
    def from_pretrained(cls, target_path: str, draft_path: str, *, device=None, dtype=None,
                        **drafter_options) -> "SpeculativeDecoder":
        """Load the target (Hugging Face directory) and the draft (speculators or DeepSpec directory;
        weights it leaves out come from the target, see ``load_draft``)."""
        from transformers import AutoModelForCausalLM

        from ..model import load_draft

        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype)
        draft = load_draft(draft_path, target=target, device=device, dtype=dtype)
        return cls.from_models(target.to(draft.device), draft, **drafter_options)

    def generate(self, prompt_ids, *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_token_id: int | Sequence[int] | None = None, on_tokens: TokenCallback | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (ints or int tensor ``[T]``).

        Stops after an ``eos_token_id`` (default: the target's). ``on_tokens`` receives each round's
        committed tokens as they are accepted. Greedy output equals the target's greedy decoding;
        sampled output is distributed as the target's (temperature / top-k / top-p filtered).
        """
        target, drafter, p = self.target, self.drafter, self.num_drafts
        prompt = _prompt_tensor(prompt_ids, target)
        sink = _Sink(max_new_tokens, _eos(eos_token_id, target), on_tokens)
        stats = GenerationStats(num_drafts=p, prompt_tokens=prompt.numel())
        start = clock = _now(target.device)
        if not sink.done:
            drafter.reset()
            prefill = target.prefill(prompt)
            anchor = _sample(prefill.logits, sampling, _uniforms(sampling, 1, 0, target.device))
            context, position = prefill.hidden, prompt.numel()
            stats.prefill_tokens = sink.add(anchor.tolist())
            clock = _now(target.device)
            stats.prefill_time = clock - start
        round_index = 1
        while not sink.done:
            base = round_index * (3 * p + 1)
            proposal = drafter.propose(context, anchor, position, sampling,
                                       _uniforms(sampling, p, base, target.device))
            num_verify = int(proposal.proposal_lengths.max().clamp(1, p))
            drafted = _now(target.device)
            stats.draft_time += drafted - clock

            verified = target.verify(K.build_verify_tokens(anchor, proposal.token_ids, num_verify)[0])
            accepted, accept_length = _accept(verified.logits, proposal, num_verify, sampling,
                                              _uniforms(sampling, 2 * p + 1, base + p, target.device))
            n = int(accept_length[0])
            target.rollback(position + n)  # keep [.. anchor, accepted drafts]; the bonus is the next anchor
            context, position, anchor = verified.hidden[:n], position + n, accepted[0, n - 1:n]
            stats.record_round(num_verify, n, sink.add(accepted[0, :n].tolist()))
            clock = _now(target.device)
            stats.verify_time += clock - drafted
            round_index += 1
        stats.total_time = _now(target.device) - start
        return GenerationResult(sink.ids, stats)


def autoregressive_generate(target: TargetModel, prompt_ids, *, max_new_tokens: int = 128,
                            sampling: SamplingParams = SamplingParams(), eos_token_id: int | Sequence[int] | None = None,
                            on_tokens: TokenCallback | None = None) -> GenerationResult:
    """Plain decoding of the target alone, one token per forward (the baseline of ``--compare``).

    Same token rule as the speculative path; token i uses the uniform at offset i. Each token is
    recorded as a round with no drafts.
    """
    prompt = _prompt_tensor(prompt_ids, target)
    sink = _Sink(max_new_tokens, _eos(eos_token_id, target), on_tokens)
    stats = GenerationStats(prompt_tokens=prompt.numel())
    start = _now(target.device)
    if not sink.done:
        logits = target.prefill(prompt, capture=False).logits
        while True:
            token = _sample(logits, sampling, _uniforms(sampling, 1, len(sink.ids), target.device))
            stats.record_round(0, 1, sink.add(token.tolist()))
            if sink.done:
                break
            logits = target.verify(token, capture=False).logits
    stats.total_time = _now(target.device) - start
    return GenerationResult(sink.ids, stats)


def generate(target, draft, prompt_ids, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, scheduler: str = "off", threshold: float = 0.0,
             eos_token_id: int | Sequence[int] | None = None, on_tokens: TokenCallback | None = None,
             device=None, dtype=None) -> GenerationResult:
    """One-call speculative generation (``dspark.engine.generate``).

    ``target``: a Hugging Face causal-LM directory or model; ``draft``: a DSpark checkpoint directory
    (speculators or DeepSpec format; weights it leaves out come from ``target``) or a ``DSparkDraftModel``. Other arguments as
    ``SpeculativeDecoder.generate``, ``SamplingParams`` and ``Drafter``.
    """
    options = dict(scheduler=scheduler, threshold=threshold)
    if isinstance(target, str) and isinstance(draft, str):
        decoder = SpeculativeDecoder.from_pretrained(target, draft, device=device, dtype=dtype, **options)
    elif isinstance(draft, str):
        from ..model import load_draft

        decoder = SpeculativeDecoder.from_models(target, load_draft(draft, target=target, device=device, dtype=dtype),
                                                 **options)
    else:
        if isinstance(target, str):
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(draft.device)
        decoder = SpeculativeDecoder.from_models(target, draft, **options)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    return decoder.generate(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                            eos_token_id=eos_token_id, on_tokens=on_tokens)


# ---------------------------------------------------------------------------------------- helpers


def _accept(logits: torch.Tensor, proposal: Proposal, num_verify: int, sampling: SamplingParams,
            uniforms: torch.Tensor | None):
    """``(accepted int32 [1, P_v+1], accept_length int32 [1])`` from the verify logits ``[P_v+1, V]``."""
    if sampling.greedy:
        return K.greedy_accept(logits, proposal.token_ids, proposal.proposal_lengths, num_verify)
    target_probs = sampling.probabilities(logits).view(1, num_verify + 1, -1)
    return K.probabilistic_accept(target_probs, proposal.probabilities, proposal.token_ids,
                                  proposal.proposal_lengths, uniforms, num_verify)


def _sample(logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """One token (int32 ``[1]``) from fp32 logits ``[1, V]``.

    Greedy takes the argmax (first index among ties, the kernels' rule) without building the one-hot
    probability row the sampled path needs.
    """
    if sampling.greedy:
        return logits.argmax(-1).to(torch.int32)
    token = torch.zeros(1, 1, dtype=torch.int32, device=logits.device)
    K.sample_probability_rows(sampling.probabilities(logits), uniforms, token, 0)
    return token[0]


def _uniforms(sampling: SamplingParams, count: int, offset: int, device) -> torch.Tensor | None:
    """f32 ``[1, count]`` uniforms of the run's seed at ``offset``; None when greedy (none needed)."""
    if sampling.greedy:
        return None
    return K.fill_uniforms(count, sampling.seed, offset, device=device).view(1, count)


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # attribute GPU work to the phase that queued it
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _prompt_tensor(prompt_ids, target: TargetModel) -> torch.Tensor:
    c = Checker("generate")
    ids = torch.as_tensor(prompt_ids).reshape(-1) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids.reshape(-1)
    if ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        c.fail(f"prompt_ids must be a non-empty sequence of token ids, got {ids.numel()} values of {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= target.vocab_size:
        c.fail(f"prompt_ids holds token id {lo if lo < 0 else hi}, outside [0, {target.vocab_size})")
    return ids.to(target.device, torch.int64)


def _eos(eos_token_id, target: TargetModel) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset(eos_token_ids(target.model))
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


class _Sink:
    """Collects output tokens: cuts at ``max_new_tokens`` and after the first EOS, streams to the callback."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int], on_tokens: TokenCallback | None):
        self.limit = Checker("generate").integer("max_new_tokens", max_new_tokens, low=0)
        self.eos, self.on_tokens = eos, on_tokens
        self.ids: list[int] = []
        self.done = self.limit == 0

    def add(self, tokens: list[int]) -> int:
        """Append what fits; returns how many tokens were kept."""
        tokens = tokens[: self.limit - len(self.ids)]
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens, self.done = tokens[: i + 1], True
                break
        self.ids.extend(tokens)
        self.done = self.done or len(self.ids) >= self.limit
        if tokens and self.on_tokens is not None:
            self.on_tokens(tokens)
        return len(tokens)
