"""Requests, their running state in the engine, what each engine step reports and what a finished
request returns (``GenerationResult``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Sequence as _IdSequence

import torch

from ..kernels._validate import Checker
from .block_manager import SequenceBlocks
from .drafting import SamplingParams
from .stats import GenerationStats
from .structured import RequestGrammar

__all__ = ["FINISH_REASONS", "GenerationInterrupted", "GenerationResult", "Request", "RequestOutput", "Sequence",
           "SequenceStatus", "TokenLogprobs", "MAX_LOGPROBS", "token_logprobs"]

MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask for (OpenAI's limit)
FINISH_REASONS = ("stop", "length", "interrupted")


@dataclass
class Request:
    """One generation request (``LLMEngine.add_request`` / ``generate_requests``).

    ``prompt_ids``: the prompt's token ids (a sequence or a 1-D tensor); the output ends after the
    target's EOS (unless ``ignore_eos``; a structured output's always ends there, where its grammar
    is complete) or any of ``stop_ids``, or after ``max_new_tokens``.
    ``logprobs``: None, or k >= 0: each output token comes with its log-probability under the
    target and the k most likely tokens' (``RequestOutput.logprobs``; the target's log-softmax before
    logit_bias / temperature / min_p / top-k / top-p, as vLLM reports by default -- under speculative
    decoding too).
    ``prompt_logprobs``: None, or k >= 0: the log-probability of each prompt token after the first
    given those before it, and the k most likely tokens' (``RequestOutput.prompt_logprobs``, vLLM's
    ``prompt_logprobs``); with ``max_new_tokens`` 0 the request only scores its prompt.
    ``disable_spec_decode``: the request verifies no draft -- plain decoding inside a DSpark batch,
    on the same graphs: greedy, its output is plain decoding's; sampled, each token is drawn from the
    target's distribution (not supported in tree mode).
    """

    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    disable_spec_decode: bool = False

    def __post_init__(self):
        c = Checker("Request")
        ids = self.prompt_ids.reshape(-1).tolist() if isinstance(self.prompt_ids, torch.Tensor) else self.prompt_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, _IdSequence) or not ids:
            c.fail(f"prompt_ids must be a non-empty sequence of token ids (ints), got {_describe(self.prompt_ids)}",
                   TypeError)
        self.prompt_ids = [c.integer("prompt_ids[]", i, low=0) for i in ids]
        c.integer("max_new_tokens", self.max_new_tokens, low=0)
        if not isinstance(self.sampling, SamplingParams):
            c.fail(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}", TypeError)
        if self.sampling.min_tokens > self.max_new_tokens:
            c.fail(f"min_tokens must be at most max_new_tokens ({self.max_new_tokens}), got {self.sampling.min_tokens}")
        stops = self.stop_ids
        if isinstance(stops, torch.Tensor):
            stops = stops.reshape(-1).tolist()
        if isinstance(stops, (str, bytes, int)) or not isinstance(stops, (_IdSequence, set, frozenset)):
            c.fail(f"stop_ids must be a sequence of token ids, got {_describe(self.stop_ids)}", TypeError)
        self.stop_ids = tuple(c.integer("stop_ids[]", i, low=0) for i in stops)
        for name in ("ignore_eos", "disable_spec_decode"):
            if not isinstance(getattr(self, name), bool):
                c.fail(f"{name} must be a bool, got {type(getattr(self, name)).__name__}", TypeError)
        if self.logprobs is not None:
            c.integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            c.integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


@dataclass
class GenerationResult:
    """A finished request: generated token ids (prompt excluded; the EOS / stop id included when it
    ended the output), statistics, why the output ended (``FINISH_REASONS``: ``"stop"`` an EOS /
    stop id / stop string, ``"length"`` ``max_new_tokens`` or the context limit, ``"interrupted"``
    Ctrl-C; ``LLMEngine.generate`` also ``"abort"`` and ``"error"``, with ``error`` saying why) and,
    when a tokenizer is known, the decoded continuation ``text``."""

    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"
    text: str | None = None
    error: str | None = None


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during generation: ``results`` holds every request's output so far (finish reason
    ``"interrupted"`` for those not finished), in request order."""

    def __init__(self, results: list[GenerationResult]):
        super().__init__(f"generation interrupted after {len(results)} request(s)")
        self.results = results


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued
    PREFILLING = "prefilling"  # a cache slot and blocks; its prompt runs in chunks
    RUNNING = "running"  # a batch row: decoding
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """One token's log-probability under the target, the ``top`` most likely tokens ``(token id,
    log-probability)``, most likely first, and its ``rank`` (1 + how many tokens are more likely)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of ``token_ids[i]`` under the f32 logits row ``logits[i]`` ``[N, V]``: its
    log-softmax, rank and the ``top`` most likely tokens' (one host transfer each)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logp.gather(1, ids[:, None])
    ranks = (logp > chosen).sum(-1) + 1
    values, index = logp.topk(top, dim=-1) if top else (logp[:, :0], ids[:, None][:, :0])
    return [TokenLogprobs(t, c, list(zip(i, v)), r) for t, c, r, i, v in
            zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(), index.tolist(), values.tolist())]


@dataclass
class RequestOutput:
    """What one ``LLMEngine.step`` produced for one request: the tokens committed this step and,
    when the request ended, why (``"stop"``: a stop/EOS token, ``"length"``: ``max_new_tokens`` or
    the context limit, ``"abort"``, ``"error"``: the engine failed on this request, ``error`` says
    why). ``logprobs``: one entry per new token when the request asked for them;
    ``prompt_logprobs`` (when asked for, in the request's first output): one entry per prompt token,
    None for the first. ``cached_tokens`` (in the first output): prompt tokens the prefix cache held.
    ``stop_token_id``: the stop / EOS token that ended the output (the last of ``new_token_ids``), else
    None (a text stream leaves it out of the text, as vLLM does)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int | None = None
    stop_token_id: int | None = None


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: its output so far, its batch row, cache slot (block-table line)
    and KV blocks while running."""

    request_id: int
    request: Request
    stop_ids: frozenset[int]
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    row: int = -1
    slot: int = -1
    finish_reason: str | None = None
    next_length: int = 0  # drafts the next round verifies (the scheduler's choice, read back each round)
    confidence: object = None  # numpy f32 [P] confidences of the pending proposal (read back each round)
    error: str | None = None  # why the engine failed this request (finish reason "error")
    prefilled: int = 0  # tokens of prefill_len already in the cache
    prefill_len: int = 0  # tokens run before the next one is drawn: the prompt, or prompt + output after a preemption
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    admitted_at: float = 0.0  # perf_counter when it got its slot (prefill time: until its first token)
    strikes: int = 0  # failed steps that ran this request's prompt
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt position, filled as its chunks run
    stats: GenerationStats = field(default_factory=GenerationStats)
    grammar: RequestGrammar | None = None  # the structured output's matcher (committed tokens taken)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.request.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end-1`` of the prompt followed by the output."""
        prompt = self.request.prompt_ids
        if end <= len(prompt):
            return list(prompt[start:end])
        return list(prompt[start:]) + self.output_ids[max(0, start - len(prompt)):end - len(prompt)]

    def room(self, max_len: int) -> int:
        """Tokens this sequence may still produce: ``max_new_tokens`` and the context limit ``max_len``."""
        request, produced = self.request, len(self.output_ids)
        return min(request.max_new_tokens, max_len - len(request.prompt_ids)) - produced

    def commit(self, tokens: list[int], max_len: int) -> list[int]:
        """Append what fits (``max_new_tokens``, the first stop token, the context limit
        ``max_len``); returns the tokens kept and sets ``finish_reason`` when the sequence ends."""
        room = self.room(max_len)
        kept = tokens[:max(0, room)]
        if not self.stop_ids.isdisjoint(kept):  # once per request at most: the scan only then
            end = next(i for i, t in enumerate(kept) if t in self.stop_ids) + 1
            kept, self.finish_reason = kept[:end], "stop"
        self.output_ids.extend(kept)
        if self.finish_reason is None and room <= len(kept):
            self.finish_reason = "length"
        return kept
