"""Running requests to completion on ``LLMEngine``'s step API (``add_request`` / ``step`` /
``abort``): ``generate`` and ``generate_requests``, the offline calls that ``dspark.generate``, the
CLI and the benchmarks use (a server drives ``step`` itself). ``LLMEngine`` inherits them.
"""

from __future__ import annotations

import time
from typing import Callable

from ..kernels._validate import Checker
from .request import GenerationInterrupted, GenerationResult, Request, RequestOutput, Sequence, SequenceStatus

__all__ = ["OfflineGeneration"]


class OfflineGeneration:
    """``generate`` / ``generate_requests`` over the engine's ``add_request``, ``check_request``,
    ``step``, ``abort`` and ``sequences``."""

    def generate(self, requests: list[Request],
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[GenerationResult]:
        """Run ``requests`` to completion (together with any already queued); results in input order."""
        ids = [self.add_request(r) for r in requests]
        seqs = {i: self.sequences[i] for i in ids}
        self._drive(set(ids), on_output)
        return [GenerationResult(s.output_ids, s.stats, s.finish_reason, error=s.error) for s in seqs.values()]

    def generate_requests(self, requests: list[Request], *,
                          on_tokens: Callable[[int, list[int]], "bool | None"] | None = None) -> list[GenerationResult]:
        """Run ``requests`` to completion; one ``GenerationResult`` per request, in order. Every
        request is checked before any runs; ``on_tokens(i, tokens)`` streams request i's tokens as
        they are committed (returning True ends it with finish reason ``"stop"``); Ctrl-C raises
        ``GenerationInterrupted`` with every request's output so far."""
        if on_tokens is not None and not callable(on_tokens):
            Checker("generate_requests").fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
        for request in requests:
            self.check_request(request)
        ids = [self.add_request(r) for r in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        seqs = [self.sequences[i] for i in ids]

        def forward(out: RequestOutput) -> None:
            if on_tokens is not None and out.new_token_ids and on_tokens(index[out.request_id], out.new_token_ids):
                if not out.finished:
                    self.abort(out.request_id, "stop")

        def results(interrupted: bool = False):
            return [GenerationResult(s.output_ids, s.stats, s.finish_reason or ("interrupted" if interrupted else "length"))
                    for s in seqs]

        try:
            self._drive(set(ids), forward)
        except KeyboardInterrupt:
            for seq in seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    _stop_clock(seq)
                    self.abort(seq.request_id, "interrupted")
            raise GenerationInterrupted(results(True)) from None
        failed = next((i for i, s in enumerate(seqs) if s.finish_reason == "error"), None)
        if failed is not None:
            raise RuntimeError(f"request {failed} failed in the engine: {seqs[failed].error}")
        return results()

    def _drive(self, wanted: set[int], on_output: Callable[[RequestOutput], None] | None) -> None:
        """Step until every request in ``wanted`` has finished (aborted ones included)."""
        seqs = {i: self.sequences[i] for i in wanted}
        # the unfinished ones, kept up to date from each step's outputs: a scan of every request per
        # step costs O(requests) of host time per step in a batch of thousands
        unfinished = {i for i, s in seqs.items() if s.status is not SequenceStatus.FINISHED}
        while unfinished and self.has_unfinished():
            for out in self.step():
                if out.request_id in unfinished:
                    if on_output is not None:
                        on_output(out)
                    if seqs[out.request_id].status is SequenceStatus.FINISHED:  # on_output may abort it
                        _stop_clock(seqs[out.request_id])
                        unfinished.discard(out.request_id)
        for i in wanted:
            self.sequences.pop(i, None)


def _stop_clock(seq: Sequence) -> None:
    """A request's total time: from its admission (its time queued is not its own) until now."""
    if seq.admitted_at:
        seq.stats.total_time = time.perf_counter() - seq.admitted_at
