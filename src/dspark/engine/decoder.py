"""Lossless DSpark speculative decoding, chain mode, one request at a time.

One round (runtime.md Part II §5.3)::

    draft   : proposal = drafter.propose(context, anchor)        P tokens (+ q), scheduled length P_v
    verify  : target([anchor, y_1 .. y_Pv])                      fp32 logits [P_v+1, V], hidden states
    accept  : greedy_accept, or probabilistic_accept on the target's probabilities (same T/top-k/top-p)
    commit  : n tokens = accepted drafts + bonus/correction; KV cropped to the accepted prefix;
              the hidden states of [anchor, accepted drafts] are the next round's draft context

Prefill samples the first token (the first anchor) from the prompt's last logits. Sampling draws
from the batched engine's request-stable stream (``K.request_uniforms``: the request's seed, the
position that keys the draw, its purpose): the first token at the prompt's last position
(``PURPOSE_TARGET_SAMPLE``), a round's drafts, accept, residual and bonus draws at its anchor
position; each round verifies the drafts the batched engine would (never more than the request can
keep), so one seed gives the same tokens here as in ``LLMEngine``, up to float rounding.

The output ends after an end-of-sequence / stop id (finish reason ``"stop"``, also when the
``on_tokens`` callback returns True), or at ``max_new_tokens`` or the target's context
``max_model_len`` (prompt + output; reason ``"length"``): near that limit a round verifies only the
drafts that still fit. Ctrl-C raises ``GenerationInterrupted`` (a ``KeyboardInterrupt``) carrying
the partial results. ``generate_requests`` runs a list of ``Request`` s; it is the one place that
decides how requests execute (today: one after another through ``SpeculativeDecoder.generate``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import kernels as K
from ..kernels._validate import Checker
from .drafting import Drafter, Proposal, SamplingParams
from .request import Request
from .stats import GenerationStats
from .target import TargetModel, eos_token_ids, load_target_model, resolve_device

__all__ = ["GenerationResult", "GenerationInterrupted", "Request", "SpeculativeDecoder", "autoregressive_generate",
           "generate_requests", "check_prompt", "check_token_ids", "FINISH_REASONS"]

# Receives each round's committed tokens; returning True ends the output there (finish reason "stop").
TokenCallback = Callable[[list[int]], "bool | None"]
FINISH_REASONS = ("stop", "length", "interrupted")


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded; the EOS / stop id included when it ended the output),
    statistics, why the output ended (``FINISH_REASONS``: ``"stop"`` an EOS / stop id / stop
    string, ``"length"`` ``max_new_tokens`` or the context limit, ``"interrupted"`` Ctrl-C) and,
    when a tokenizer is known, the decoded continuation ``text``."""

    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"
    text: str | None = None


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during generation: ``results`` holds the requests finished so far and the partial one
    (finish reason ``"interrupted"``), in request order."""

    def __init__(self, results: list[GenerationResult]):
        super().__init__(f"generation interrupted after {len(results)} request(s)")
        self.results = results


def end_ids(request: Request, target: TargetModel) -> list[int]:
    """The token ids that end ``request``'s output: its ``stop_ids``, and the target's EOS unless ``ignore_eos``."""
    return list(request.stop_ids) + ([] if request.ignore_eos else eos_token_ids(target.model))


class SpeculativeDecoder:
    """Speculative decoding of a ``TargetModel`` with a ``Drafter`` (or any object with
    ``num_draft_tokens``, ``reset()`` and ``propose(...)`` -> ``Proposal``)."""

    def __init__(self, target: TargetModel, drafter: Drafter):
        self.target = target
        self.drafter = drafter
        self.num_drafts = drafter.num_draft_tokens

    @classmethod
    def from_models(cls, target_model: torch.nn.Module, draft_model, *, max_model_len: int | None = None,
                    **drafter_options) -> "SpeculativeDecoder":
        """Pair a Hugging Face causal LM with a ``DSparkDraftModel`` (checked compatible)."""
        from ..model import check_target_compatible

        check_target_compatible(draft_model.config, target_model.config)
        target = TargetModel(target_model, draft_model.config.capture_layer_ids, max_model_len=max_model_len)
        return cls(target, Drafter(draft_model, **drafter_options))

    @classmethod
    def from_pretrained(cls, target, draft, *, device=None, dtype=None, max_model_len: int | None = None,
                        allow_pickle: bool = False, **drafter_options) -> "SpeculativeDecoder":
        """Load what is not loaded yet and pair them: ``target`` a Hugging Face causal-LM directory
        (``load_target_model``; ``allow_pickle`` as there) or model, ``draft`` a DSpark directory
        (speculators or DeepSpec format) or ``DSparkDraftModel``. What is loaded goes to ``device``
        (default: the device of the model passed in, else transformers' default)."""
        from ..model import load_draft

        paths = [isinstance(m, (str, os.PathLike)) for m in (target, draft)]
        if device is not None:
            device = resolve_device(device)
        elif not paths[1]:
            device = draft.device
        elif not paths[0]:
            device = next(target.parameters()).device
        if paths[0]:
            target = load_target_model(target, device=device, dtype=dtype, allow_pickle=allow_pickle)
        if paths[1]:
            draft = load_draft(draft, target=target, device=next(target.parameters()).device, dtype=dtype)
        return cls.from_models(target, draft, max_model_len=max_model_len, **drafter_options)

    def generate(self, prompt_ids, *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_token_id: int | Sequence[int] | None = None, on_tokens: TokenCallback | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (ints or int tensor ``[T]``).

        Stops after an ``eos_token_id`` (default: the target's; ``[]``: none) or at the target's
        ``max_model_len``. ``on_tokens`` receives each round's committed tokens as they are
        accepted (returning True ends the output). Greedy output equals the target's greedy
        decoding; sampled output is distributed as the target's (temperature / top-k / top-p filtered).
        """
        target, drafter, p = self.target, self.drafter, self.num_drafts
        prompt = check_prompt(target, prompt_ids)
        sink = _Sink(max_new_tokens, prompt.numel(), target, _eos(eos_token_id, target), on_tokens)
        stats = GenerationStats(num_drafts=p, prompt_tokens=prompt.numel())
        start = clock = _now(target.device)
        try:
            if not sink.done:
                drafter.reset()
                prefill = target.prefill(prompt)
                anchor = _sample(prefill.logits, sampling,
                                 _uniforms(sampling, [(K.PURPOSE_TARGET_SAMPLE, 1)], prompt.numel() - 1, target.device))
                context, position = prefill.hidden, prompt.numel()
                stats.prefill_tokens = sink.add(anchor.tolist())
                clock = _now(target.device)
                stats.prefill_time = clock - start
            draft_sampling = None if sampling.greedy else sampling.rows(1, target.device)
            while not sink.done:
                proposal = drafter.propose(context, anchor, position, draft_sampling,
                                           _uniforms(sampling, [(K.PURPOSE_PROPOSAL, p)], position, target.device))
                # never verify more drafts than the request can keep (the batched engine's rule)
                num_verify = max(1, min(int(proposal.proposal_lengths.max().clamp(1, p)), sink.remaining - 1))
                drafted = _now(target.device)
                stats.draft_time += drafted - clock

                verified = target.verify(K.build_verify_tokens(anchor, proposal.token_ids, num_verify)[0])
                draws = [(K.PURPOSE_ACCEPT, p), (K.PURPOSE_RESIDUAL, p), (K.PURPOSE_BONUS, 1)]
                accepted, accept_length = _accept(verified.logits, proposal, num_verify, sampling,
                                                  _uniforms(sampling, draws, position, target.device))
                n = int(accept_length[0])
                target.rollback(position + n)  # keep [.. anchor, accepted drafts]; the bonus is the next anchor
                context, position, anchor = verified.hidden[:n], position + n, accepted[0, n - 1:n]
                stats.record_round(num_verify, n, sink.add(accepted[0, :n].tolist()))
                clock = _now(target.device)
                stats.verify_time += clock - drafted
        except KeyboardInterrupt:
            stats.total_time = time.perf_counter() - start
            raise GenerationInterrupted([GenerationResult(sink.ids, stats, "interrupted")]) from None
        stats.total_time = _now(target.device) - start
        return GenerationResult(sink.ids, stats, sink.finish_reason)


def autoregressive_generate(target: TargetModel, prompt_ids, *, max_new_tokens: int = 128,
                            sampling: SamplingParams = SamplingParams(), eos_token_id: int | Sequence[int] | None = None,
                            on_tokens: TokenCallback | None = None) -> GenerationResult:
    """Plain decoding of the target alone, one token per forward (the baseline of ``--compare``).

    Same token rule and stopping rules as the speculative path; the token after position i is drawn
    with the request's ``PURPOSE_TARGET_SAMPLE`` uniform at i, as the batched engine's plain decoding
    draws it. Each token is recorded as a round with no drafts.
    """
    prompt = check_prompt(target, prompt_ids)
    sink = _Sink(max_new_tokens, prompt.numel(), target, _eos(eos_token_id, target), on_tokens)
    stats = GenerationStats(prompt_tokens=prompt.numel())
    start = _now(target.device)
    try:
        if not sink.done:
            logits = target.prefill(prompt, capture=False).logits
            while True:
                token = _sample(logits, sampling, _uniforms(sampling, [(K.PURPOSE_TARGET_SAMPLE, 1)],
                                                            prompt.numel() - 1 + len(sink.ids), target.device))
                stats.record_round(0, 1, sink.add(token.tolist()))
                if sink.done:
                    break
                logits = target.verify(token, capture=False).logits
    except KeyboardInterrupt:
        stats.total_time = time.perf_counter() - start
        raise GenerationInterrupted([GenerationResult(sink.ids, stats, "interrupted")]) from None
    stats.total_time = _now(target.device) - start
    return GenerationResult(sink.ids, stats, sink.finish_reason)


def generate_requests(decoder: SpeculativeDecoder, requests: Sequence[Request], *,
                      on_tokens: Callable[[int, list[int]], "bool | None"] | None = None) -> list[GenerationResult]:
    """Run ``requests`` to completion; one ``GenerationResult`` per request, in order.

    Every request is checked against the target (vocabulary, context length) before any runs.
    ``on_tokens(i, tokens)`` receives request i's tokens as they are committed; returning True ends
    request i there (finish reason ``"stop"``). Ctrl-C raises ``GenerationInterrupted`` with the
    results so far. ``decoder``: a ``SpeculativeDecoder`` (the single-request loop, one request after
    another) or an ``LLMEngine`` (all requests batched, its ``generate_requests``).
    """
    c = Checker("generate_requests")
    if not isinstance(decoder, SpeculativeDecoder):  # the batched LLMEngine: all requests decoded together
        return decoder.generate_requests(requests, on_tokens=on_tokens)
    if not all(isinstance(r, Request) for r in requests):
        c.fail(f"requests must be Request objects, got {sorted({type(r).__name__ for r in requests})}", TypeError)
    if on_tokens is not None and not callable(on_tokens):
        c.fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
    for request in requests:
        check_prompt(decoder.target, request.prompt_ids)
        check_token_ids(c, "stop_ids", request.stop_ids, decoder.target.vocab_size)
    results: list[GenerationResult] = []
    for i, request in enumerate(requests):
        stream = None if on_tokens is None else (lambda tokens, i=i: on_tokens(i, tokens))
        try:
            results.append(decoder.generate(request.prompt_ids, max_new_tokens=request.max_new_tokens,
                                            sampling=request.sampling, eos_token_id=end_ids(request, decoder.target),
                                            on_tokens=stream))
        except GenerationInterrupted as exc:
            raise GenerationInterrupted(results + exc.results) from None
    return results


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


def _uniforms(sampling: SamplingParams, draws: list[tuple[int, int]], position: int, device) -> torch.Tensor | None:
    """f32 ``[1, sum(counts)]``: the request's ``(purpose, count)`` draws keyed by ``position``, side
    by side (``K.request_uniforms``, the batched engine's stream); None when greedy (none needed)."""
    if sampling.greedy:
        return None
    seeds = torch.tensor([sampling.seed_bits], dtype=torch.int64, device=device)
    at = torch.tensor([position], dtype=torch.int32, device=device)
    return torch.cat([K.request_uniforms(seeds, at, purpose, count) for purpose, count in draws], dim=1)


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # attribute GPU work to the phase that queued it
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_prompt(target: TargetModel, prompt_ids) -> torch.Tensor:
    """``prompt_ids`` (ints or an int tensor) as int64 ``[T]`` on the target's device; ValueError for
    an empty prompt, an id outside the vocabulary, or a prompt that leaves no room in the context."""
    c = Checker("generate")
    if isinstance(prompt_ids, (str, bytes)):
        c.fail(f"prompt_ids must be token ids, got {type(prompt_ids).__name__} (text prompts: dspark.generate)",
               TypeError)
    try:
        ids = prompt_ids.reshape(-1) if isinstance(prompt_ids, torch.Tensor) else torch.as_tensor(prompt_ids).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        c.fail(f"prompt_ids must be a flat sequence of token ids, got {type(prompt_ids).__name__}", TypeError)
    if ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        c.fail(f"prompt_ids must be a non-empty sequence of token ids, got {ids.numel()} values of {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= target.vocab_size:
        c.fail(f"prompt_ids holds token id {lo if lo < 0 else hi}, outside [0, {target.vocab_size})")
    if target.max_model_len is not None and ids.numel() >= target.max_model_len:
        c.fail(f"the prompt has {ids.numel()} tokens, but the target's context is {target.max_model_len} tokens "
               f"(prompt + output): at most {target.max_model_len - 1} prompt tokens")
    return ids.to(target.device, torch.int64)


def check_token_ids(c: Checker, name: str, ids, vocab_size: int | None = None) -> list[int]:
    """``ids`` (one token id or a sequence of them) as a list, each checked in ``[0, vocab_size)``."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (int, Sequence, set, frozenset)):
        c.fail(f"{name} must be a token id or a sequence of token ids, got {type(ids).__name__}", TypeError)
    high = None if vocab_size is None else vocab_size - 1
    return [c.integer(f"{name}[]" if not isinstance(ids, int) else name, i, low=0, high=high)
            for i in ([ids] if isinstance(ids, int) else ids)]


def _eos(eos_token_id, target: TargetModel) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset(eos_token_ids(target.model))
    return frozenset(check_token_ids(Checker("generate"), "eos_token_id", eos_token_id, target.vocab_size))


class _Sink:
    """Collects output tokens: cuts at ``max_new_tokens``, at the context limit and after the first
    EOS, streams to the callback (which may end the output)."""

    def __init__(self, max_new_tokens: int, prompt_tokens: int, target: TargetModel, eos: frozenset[int],
                 on_tokens: TokenCallback | None):
        c = Checker("generate")
        self.limit = c.integer("max_new_tokens", max_new_tokens, low=0)
        if on_tokens is not None and not callable(on_tokens):
            c.fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
        self.context = target.max_model_len
        if self.context is not None:  # check_prompt left room for at least one token
            self.limit = min(self.limit, self.context - prompt_tokens)
        self.eos, self.on_tokens = eos, on_tokens
        self.ids: list[int] = []
        self.finish_reason = "length"
        self.done = self.limit == 0

    @property
    def remaining(self) -> int:
        """Tokens the output may still take (``max_new_tokens`` and the context)."""
        return self.limit - len(self.ids)

    def add(self, tokens: list[int]) -> int:
        """Append what fits; returns how many tokens were kept."""
        tokens = tokens[: self.limit - len(self.ids)]
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens, self.done, self.finish_reason = tokens[: i + 1], True, "stop"
                break
        self.ids.extend(tokens)
        self.done = self.done or len(self.ids) >= self.limit
        if tokens and self.on_tokens is not None and self.on_tokens(tokens):
            self.done, self.finish_reason = True, "stop"
        return len(tokens)
