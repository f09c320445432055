"""``LogprobScoring``: the log-probabilities requests ask for (``LLMEngine`` inherits it).

A request's prompt log-probabilities (``Request.prompt_logprobs``) are scored chunk by chunk as
the step is planned, an eager forward of the chunk's tokens before the step runs them
(``_plan_scored_chunks``); its output tokens' (``Request.logprobs``) come from the verify logits of
the tokens a round kept (``_logprobs``). A failure fails the requests it concerns only (the
engine's ``_fail``). It reads the engine's ``runner`` and ``scheduler``.
"""

from __future__ import annotations

from dataclasses import replace

from .chunks import PrefillChunk
from .request import RequestOutput, Sequence, TokenLogprobs, token_logprobs

__all__ = ["PROMPT_LOGITS_TOKENS", "LogprobScoring"]

PROMPT_LOGITS_TOKENS = 512  # prompt tokens per eager forward that scores a prompt (its logits: [512, V] f32)


class LogprobScoring:
    """Prompt log-probabilities scored per chunk, and the log-probabilities of the kept tokens."""

    def _plan_scored_chunks(self, budget: int, outputs: list[RequestOutput]) -> list[tuple[Sequence, PrefillChunk]]:
        """``Scheduler.plan_chunks``, the chunks of requests that want prompt log-probabilities scored first;
        a request whose scoring failed ends with ``"error"`` and the step is planned again without it
        (the chunks after it would take other rows)."""
        while True:
            plan = self.scheduler.plan_chunks(budget)
            scored = [self._score(seq, chunk, outputs) for seq, chunk in plan
                      if seq.prompt_logprobs is not None and not seq.output_ids]
            if all(scored):
                return plan

    def _score(self, seq: Sequence, chunk: PrefillChunk, outputs: list[RequestOutput]) -> bool:
        """The log-probabilities of the prompt tokens that ``chunk``'s logits predict (each position's
        next token) into ``seq.prompt_logprobs``; a failure fails ``seq`` alone (False)."""
        ids, k = seq.request.prompt_ids, seq.request.prompt_logprobs
        try:
            for lo in range(0, len(chunk.token_ids), PROMPT_LOGITS_TOKENS):
                start = chunk.start + lo
                logits = self.runner.prompt_logits(chunk.slot, chunk.token_ids[lo:lo + PROMPT_LOGITS_TOKENS], start)
                following = ids[start + 1:start + 1 + logits.shape[0]]  # the last prompt position predicts none
                seq.prompt_logprobs[start + 1:start + 1 + len(following)] = token_logprobs(logits[:len(following)],
                                                                                           following, k)
        except Exception as exc:  # noqa: BLE001
            self._fail([seq], exc, outputs, f"the prompt log-probabilities of request {seq.request_id}")
            return False
        return True

    def _logprobs(self, seqs: list[Sequence], logits, tokens: list[list[int]],
                  outputs: list[RequestOutput]) -> dict[int, list[TokenLogprobs]]:
        """Per request id: the log-probabilities of ``tokens`` (each request's, in order) from the
        target's logits rows (one per token, flat); a failure fails those requests only."""
        if not seqs:
            return {}
        try:
            top = max(seq.request.logprobs for seq in seqs)
            flat = token_logprobs(logits, [t for ts in tokens for t in ts], top)
        except Exception as exc:  # noqa: BLE001
            self._fail(seqs, exc, outputs, "log-probabilities")
            return {}
        result, i = {}, 0
        for seq, ts in zip(seqs, tokens):
            k = seq.request.logprobs
            result[seq.request_id] = [replace(e, top=e.top[:k]) for e in flat[i:i + len(ts)]]
            i += len(ts)
        return result
