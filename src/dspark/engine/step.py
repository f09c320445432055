"""The typed records between the engine's scheduler and its model runner: what a step runs
(``StepPlan``) and what it gave back (``StepResult``, then ``Proposals``).

One step runs, in one target forward, a round for every running row and chunks of admitted prompts;
the runner sends what the target pass decided to the host as soon as it ends (``StepResult``: read
while the draft pass still runs), then what the draft pass proposes for the next round
(``Proposals``: only schedulers that choose verify lengths from them wait for it). Both are views of
the runner's pinned readout rows ``[rows, T + 3 + P]`` (T verify tokens per row, P drafts), whose
columns are laid out here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .request import Sequence
from .chunks import PrefillChunk

__all__ = ["Proposals", "StepPlan", "StepResult", "readout_columns"]


@dataclass
class StepPlan:
    """One step: the running rows ``0 .. rows-1`` verify ``verify_lens[i]`` tokens each (the anchor
    and ``verify_lens[i] - 1`` drafts) or, with ``verify_lens`` None, decode one token; ``draft``:
    whether the step drafts the next round -- or a function that says it, called between the
    target pass and the draft pass (once the target pass is queued: ``round_plan``); ``chunks``: the
    prompt chunks run in the same forward, each with its request (one that ends its prompt seats
    it in row ``chunk.row``)."""

    rows: int
    verify_lens: list[int] | None
    draft: bool | Callable[[], bool]
    chunks: list[tuple[Sequence, PrefillChunk]]

    @property
    def prefill_chunks(self) -> list[PrefillChunk]:
        return [chunk for _, chunk in self.chunks]


def readout_columns(verify_len: int, num_drafts: int) -> dict[str, slice]:
    """The readout's columns: per row its accepted tokens, accept length and drafts verified (the
    target pass), then the next round's proposal length and confidences (the draft pass; f32 bits)."""
    t = verify_len
    return {"accepted": slice(0, t), "accept_length": slice(t, t + 1), "verified": slice(t + 1, t + 2),
            "proposal_length": slice(t + 2, t + 3), "confidence": slice(t + 3, t + 3 + num_drafts)}


@dataclass
class StepResult:
    """The target pass of a step, per row: ``tokens[i]`` the tokens row i produced (its accepted
    drafts, then the target's own token), ``accept_lengths`` int ``[rows]`` (their counts) and
    ``verified`` int ``[rows]``: drafts verified (0 in a plain round)."""

    tokens: list[list[int]]
    accept_lengths: np.ndarray
    verified: np.ndarray

    @classmethod
    def from_readout(cls, readout: torch.Tensor, columns: dict[str, slice]) -> "StepResult":
        rows = readout.numpy()
        lengths = rows[:, columns["accept_length"]][:, 0]
        accepted = rows[:, columns["accepted"]].tolist()  # one conversion: the host's per-row work is Python
        return cls([row[:n] for row, n in zip(accepted, lengths.tolist())], lengths, rows[:, columns["verified"]][:, 0])


@dataclass
class Proposals:
    """The draft pass of a step, per row: how many drafts the next round proposes
    (``lengths`` int ``[rows]``) and their confidences (``confidence`` f32 ``[rows, P]``)."""

    lengths: np.ndarray
    confidence: np.ndarray

    @classmethod
    def from_readout(cls, readout: torch.Tensor, columns: dict[str, slice]) -> "Proposals":
        return cls(readout[:, columns["proposal_length"]][:, 0].numpy(),
                   readout[:, columns["confidence"]].contiguous().view(torch.float32).numpy())
