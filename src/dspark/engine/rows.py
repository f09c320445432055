"""The runner's per-row device state (``RowState``), tree-mode settings, the benchmarks' draft
override, and the batch buckets a CUDA graph is captured for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

import torch

from .drafting import RowSampling, SamplingParams

if TYPE_CHECKING:
    from .penalties import PenaltyState
    from .runner import ModelRunner

__all__ = ["DraftOverride", "LogitsPath", "MoveIndices", "RowState", "TreeSettings", "batch_buckets"]


class LogitsPath(IntEnum):
    """How a step's rows turn logits into tokens, one CUDA graph each: ``GREEDY`` (every row the
    argmax of its raw logits), ``SAMPLED`` (each row's distribution: temperature, top-k, top-p,
    min_p, logit bias; a greedy row's is one-hot at its argmax), ``PENALISED`` (``SAMPLED`` after
    the penalty pass, ``penalties.py``). A batch takes the highest path of its rows: the penalty
    pass is several full passes over the ``[rows, positions, V]`` logits (about 3 GB a verify at 64
    rows of a 152k vocabulary), which a batch with no row reading its tokens so far skips -- an
    exact shortcut, as neutral settings change no logit."""

    GREEDY = 0
    SAMPLED = 1
    PENALISED = 2

    @classmethod
    def of(cls, sampling: SamplingParams) -> "LogitsPath":
        if sampling.reads_history:
            return cls.PENALISED
        return cls.GREEDY if sampling.plain_argmax else cls.SAMPLED

    @property
    def sampled(self) -> bool:
        return self is not LogitsPath.GREEDY


@dataclass(frozen=True)
class TreeSettings:
    """Tree mode (DDTree, runtime.md Part II 5.4): each round verifies a token tree per row grown
    from the drafter's ``top_k`` (2..8) candidates per depth, ``budget`` nodes with the root
    (2..64), no deeper than the prefix survival ``threshold`` allows (0: the block)."""

    top_k: int
    budget: int
    threshold: float = 0.0


@dataclass
class RowState:
    """The runner's per-row tensors, rows ``0 .. max_batch`` (the last: the scratch row that unused
    seats write); a request's row moves as a whole when another leaves (``tensors``).

    Every round: ``slot_ids`` (cache line; padding: the dummy line), ``active`` (1: a request),
    ``anchor`` / ``anchor_pos`` (the last accepted token and its position), ``ctx_pos`` (where the
    draft context resumes), the request's ``seeds`` and sampling settings (``temperature``, 0 when
    greedy; ``top_k``; ``top_p``; ``min_p``; ``logit_bias``, f32 ``[max_batch + 1, V]``: dense, so
    that any request's bias is one row a graph adds -- 39 MB at 64 rows of a 152k vocabulary),
    ``draft_tokens`` / ``proposal_lengths`` (the next round's
    drafts and how many the drafter proposes), ``accepted`` / ``accept_length`` (this round's tokens),
    ``grammar_mask`` (int32 ``[max_batch + 1, verify_len, ceil(V / 32)]``: each verify position's
    token bitmask, every bit set for a free row; ``structured.GrammarStager`` fills a constrained
    row's).
    With a draft: ``capture`` (the last verify's captured hidden states, ``[B, verify_len, width]``),
    ``verify_lens`` (this round's tokens per row), ``confidence``; sampled chain drafting:
    ``draft_probs`` (``[max_batch, P, V]`` f32: the distributions the drafts came from);
    ``draft_mask`` (int32 ``[max_batch + 1, N, ceil(V / 32)]``: the drafter's bitmask of each block
    slot, at the draft positions whose grammar state is known before drafting); tree mode:
    the next round's tree per row
    (``tree_tokens``, ``tree_parents``, ``tree_depths``, ``tree_bits``: int64 ancestor masks,
    ``tree_nodes``)."""

    slot_ids: torch.Tensor
    active: torch.Tensor
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    ctx_pos: torch.Tensor
    seeds: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    logit_bias: torch.Tensor
    draft_tokens: torch.Tensor
    proposal_lengths: torch.Tensor
    accepted: torch.Tensor
    accept_length: torch.Tensor
    grammar_mask: torch.Tensor
    capture: torch.Tensor | None = None
    verify_lens: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    draft_mask: torch.Tensor | None = None
    tree_tokens: torch.Tensor | None = None
    tree_parents: torch.Tensor | None = None
    tree_depths: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    tree_nodes: torch.Tensor | None = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every buffer this runner has."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def sampling(self, b: int, penalties: "PenaltyState | None" = None) -> RowSampling:
        """Rows ``0 .. b-1``'s sampling settings, with their slots' ``penalties`` state when given."""
        return RowSampling(self.temperature[:b], self.top_k[:b], self.top_p[:b], self.min_p[:b], self.logit_bias[:b],
                           None if penalties is None else penalties.rows(self.slot_ids[:b]))


class MoveIndices:
    """The rows of ``ModelRunner.move_rows`` on the device without a synchronising copy (one from
    pageable memory waits for the queued device work): a batch of k ``(source, destination)`` pairs
    is written into a pinned host buffer at a cursor, 2k contiguous int64 (the sources, then the
    destinations: a strided copy would go through a pageable temporary), and copied asynchronously
    into the same place of a device buffer (``capacity`` pairs each). A place is rewritten only
    once the device took it: the cursor goes back to 0 when the last copy is done (an event after
    it); a batch that does not fit after the cursor waits for that."""

    def __init__(self, capacity: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.empty(2 * capacity, dtype=torch.int64, pin_memory=on_cuda)
        self.device = torch.empty(2 * capacity, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if on_cuda else None
        self.used = 0  # pairs staged since the cursor was last at 0

    def send(self, moves: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``moves`` on the device: int64 ``[k]`` sources and ``[k]`` destinations (queued copies)."""
        k = len(moves)
        start = self._cursor(k)
        self.used = start + k
        staged = self.host[2 * start:2 * self.used].view(2, k)
        staged.copy_(torch.tensor(list(zip(*moves)), dtype=torch.int64))
        sent = self.device[2 * start:2 * self.used].view(2, k)
        sent.copy_(staged, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return sent[0], sent[1]

    def _cursor(self, k: int) -> int:
        """Where ``k`` pairs are staged: after the pairs the device may not have taken yet, or at 0."""
        if self.copied is None or self.copied.query():
            return 0
        if self.used + k > self.host.numel() // 2:
            self.copied.synchronize()
            return 0
        return self.used


class DraftOverride(Protocol):
    """What a benchmark puts in place of the drafter's proposals (``dspark.bench.oracle``):
    ``apply(runner, b)`` runs after the drafter proposed rows ``0 .. b-1`` (device ops, captured in
    the draft graphs); ``buffers()`` are the device tensors a round writes, restored after a graph's
    warm-up run."""

    def apply(self, runner: "ModelRunner", b: int) -> None: ...

    def buffers(self) -> list[torch.Tensor]: ...



def batch_buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: powers of two up to 32, then steps of 16, capped by ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    sizes += list(range(48, max_batch, 16))
    return sizes + [max_batch]
