"""Scratch sizes of every Triton op at given largest shapes, for ``dspark.kernels.Workspace.reserve``."""

from __future__ import annotations

import torch

from . import draw, markov, request, verify
from . import filter as tfilter
from ._shared import merge

# (top_k, top_p) after filter_settings whose plans cover every filter path: unfiltered, and top-p
# without top-k (candidates at their widest, the search and the searched rows' draws).
_FILTER_CASES = ((0, 1.0), (0, 0.5))


def scratch_sizes(batch: int, rows: int, vocab: int, rank: int) -> dict[tuple[str, torch.dtype], int]:
    """``{(name, dtype): elements}`` that the ops need for up to ``batch`` requests and ``rows`` logit
    rows over a vocabulary of ``vocab`` with Markov rank ``rank`` (every smaller size is covered:
    plans are not assumed monotone)."""
    plans = []
    for b in range(1, batch + 1):
        plans += [markov.sample_step_plan(b, vocab, rank, fp8, k > 0 or p < 1.0, k, p)
                  for fp8 in (False, True) for k, p in _FILTER_CASES]
        plans += [verify.accept_plan(b, vocab), draw.plan(b, vocab)]
    for r in range(1, rows + 1):
        plans += [tfilter.plan(r, vocab, k, p) for k, p in _FILTER_CASES]
        plans += [verify.argmax_plan(r, vocab), request.plan(r, vocab)]
    return {(name, dtype): numel for name, (numel, dtype) in merge(*plans).items()}
