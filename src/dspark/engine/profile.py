"""Profile the target's verify forward per total token count, its plain decoding forward per row
count, and the round's draft pass per batch size: the cost table of the ``cost`` scheduler (paper
Algorithm 1, runtime.md "Cost tables").

Each point times one forward of ``N`` flat tokens spread over requests of at most ``tokens_per_row``
tokens (a verify block; one for the decode curve), each with ``context`` cached positions, on the
engine's own target runner: replayed as a CUDA graph on a GPU (median of CUDA-event timings),
eagerly on the CPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from ..model.llama import AttentionBatch, TargetLM
from .rows import LogitsPath
from .runner import state_layout
from .schedulers import SPSCostTable

__all__ = ["default_token_counts", "profile_costs", "profile_draft", "profile_verify"]


def default_token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... and every multiple of 64 up to ``max_tokens`` (strictly increasing)."""
    counts = {1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens}
    counts |= set(range(64, max_tokens + 1, 64)) | {max_tokens}
    return sorted(counts)


def profile_costs(target: TargetLM, token_counts: list[int], *, context: int, tokens_per_row: int,
                  engine=None, reps: int = 20) -> SPSCostTable:
    """The ``cost`` scheduler's whole table: the verify curve (``profile_verify``), the decode curve
    (a plain forward of R rows of one token, R up to the verify curve's rows) and, given ``engine``
    (an idle ``LLMEngine`` with a draft), its draft pass per batch bucket (``profile_draft``)."""
    table = profile_verify(target, token_counts, context=context, tokens_per_row=tokens_per_row, reps=reps)
    decode = profile_verify(target, default_token_counts(-(-max(token_counts) // tokens_per_row)), context=context,
                            tokens_per_row=1, reps=reps)
    table = replace(table, decode_rows=decode.token_counts, decode_time_ms=decode.step_time_ms,
                    tokens_per_row=tokens_per_row)
    if engine is not None:
        table = replace(table, **dict(zip(("draft_rows", "draft_time_ms"), profile_draft(engine, reps))))
    return table


@torch.inference_mode()
def profile_verify(target: TargetLM, token_counts: list[int], *, context: int = 512, tokens_per_row: int = 8,
                   reps: int = 20) -> SPSCostTable:
    """Median milliseconds of a verify forward for each total token count -> ``SPSCostTable``."""
    dev = target.device
    rows_max = -(-max(token_counts) // tokens_per_row)
    # a hybrid target's states for rounds of tokens_per_row (its verify scan, as the engine's)
    cache = target.new_cache(rows_max, context + tokens_per_row, **state_layout(target, tokens_per_row, 0, 0))
    times = []
    for n in token_counts:
        rows = -(-n // tokens_per_row)
        counts = [tokens_per_row] * (n // tokens_per_row) + ([n % tokens_per_row] if n % tokens_per_row else [])
        i32 = dict(dtype=torch.int32, device=dev)
        cu = torch.tensor([0] + counts, **i32).cumsum(0, dtype=torch.int32)
        slots = torch.arange(rows, **i32)
        starts = torch.full((rows,), context, **i32)
        token_slots = torch.repeat_interleave(slots, torch.tensor(counts, device=dev))
        positions = context + torch.cat([torch.arange(c, **i32) for c in counts])
        ids = torch.randint(0, target.vocab_size, (n,), device=dev)
        batch = AttentionBatch(slots, starts, cu, tokens_per_row)

        def forward():
            target.forward(ids, positions, token_slots, batch, cache)

        times.append(_median_ms(forward, reps, dev))
    return SPSCostTable(tuple(token_counts), tuple(round(t, 4) for t in times), tokens_per_row=tokens_per_row)


@torch.inference_mode()
def profile_draft(engine, reps: int = 20) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Median milliseconds of a round's draft pass (draft context, block, Markov chain, confidence;
    greedy) of ``engine`` (an ``LLMEngine`` with a draft, nothing running) at each of its batch
    buckets: ``(draft_rows, draft_time_ms)`` of an ``SPSCostTable``."""
    runner = engine.runner
    times = [_median_ms(lambda b=b: runner._propose(b, LogitsPath.GREEDY), reps, runner.device) for b in runner.buckets]
    return tuple(runner.buckets), tuple(round(t, 4) for t in times)


def _median_ms(fn, reps: int, device: torch.device) -> float:
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(1000 * (time.perf_counter() - start))
        return statistics.median(samples)
    fn()  # compile kernels outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    graph.replay()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)
