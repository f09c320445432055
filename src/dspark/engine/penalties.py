"""The request controls that read a request's tokens so far -- ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_tokens``, ``bad_words`` -- as vLLM applies them,
exact under speculative decoding (runtime.md §12).

Definitions (vLLM's sampler; transformers' processors where they exist): the stop / EOS ids get -inf
while fewer than ``min_tokens`` tokens were generated; a bad word (a token sequence) bans its last
token where its other tokens end the output (a one-token bad word: always); then a token seen in the
prompt or the output has its logit divided by ``repetition_penalty`` when positive, multiplied when
not (transformers' ``RepetitionPenaltyLogitsProcessor``); then ``frequency * count + presence *
[count > 0]`` is subtracted, counting the output only (OpenAI's definition).

Under speculative decoding the output before a verified position includes the drafts before it in
the same round (they are the output if accepted): verify position l of a chain follows drafts 1..l,
a tree node its ancestors and itself (``Window``). Each position's logits are processed with that
state -- the committed state for the whole vocabulary, then a fix-up of the few tokens the window
holds (their counts, their seen bit) -- so acceptance compares the drafts' q with the processed p.

The state is kept per cache slot (``PenaltyState``: the request's for its life in the engine, so
rows move without it), written when a request takes its slot (its prompt and output so far are
known then), advanced on the device as tokens are committed, and gathered by the rows' slots where
logits are processed (``RowPenalties``); fixed shapes throughout, so the runner's CUDA graphs hold
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .drafting import SamplingParams

__all__ = ["BYTES_PER_TOKEN", "MAX_BAD_WORDS", "MAX_BAD_WORD_TOKENS", "PenaltyState", "RowPenalties", "Window"]

MAX_BAD_WORDS = 64  # bad words of two tokens or more per request (one-token bad words: any number)
MAX_BAD_WORD_TOKENS = 16  # tokens per bad word
RECENT = MAX_BAD_WORD_TOKENS - 1  # output tokens a bad word's prefix is matched against
PROMPT, STOP, BANNED = 1, 2, 4  # bits of ``PenaltyState.flags``
ANY = -1  # a prefix place a shorter bad word leaves free
NO_TOKEN = -2  # a recent-output place before the first output token (matches no prefix token)
NEUTRAL = (0.0, 0.0, 1.0)  # presence, frequency, repetition that change nothing
BYTES_PER_TOKEN = 5  # device memory per slot and vocabulary entry: counts (f32) and flags (uint8)


@dataclass(frozen=True)
class Window:
    """The tokens a verify round adds to each row's output ahead of each of its positions.

    ``tokens`` int64 ``[B, W]``: token 0 the anchor (committed already), then the drafts or tree
    nodes; ``depths`` int ``[B or 1, W]``: each token's depth (the anchor's 0); ``path`` bool
    ``[B or 1, L, W]``: position l's output holds token w -- a chain's position l (whose logits
    follow token l) drafts 1..l, a tree node its ancestors below the root and itself."""

    tokens: torch.Tensor
    depths: torch.Tensor
    path: torch.Tensor

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "Window":
        """A chain's window: ``tokens`` int ``[B, W]`` = the anchor and the drafts in order; one
        position per token."""
        width = tokens.shape[1]
        path = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()
        path[:, 0] = False
        return cls(tokens.long(), torch.arange(width, device=tokens.device)[None], path[None])

    @classmethod
    def tree(cls, tokens: torch.Tensor, depths: torch.Tensor, ancestor_bits: torch.Tensor) -> "Window":
        """A token tree's window: node tokens int ``[B, S]`` (node 0 the root: the anchor), depths int
        ``[B, S]``, int64 ancestor masks ``[B, S]`` (bit w of node l: w is l or its ancestor); one
        position per node."""
        bits = 1 << torch.arange(tokens.shape[1], device=tokens.device)
        path = (ancestor_bits[:, :, None] & bits) != 0
        path[:, :, 0] = False
        return cls(tokens.long(), depths, path)


@dataclass(frozen=True)
class RowPenalties:
    """B rows' state, gathered from their slots (``PenaltyState.rows``): ``counts`` f32 ``[B, V]``
    (committed output tokens), ``flags`` uint8 ``[B, V]`` (``PROMPT`` / ``STOP`` / ``BANNED`` bits),
    ``produced`` int32 ``[B]`` (output tokens committed), ``recent`` int32 ``[B, RECENT]`` (the last
    output tokens, oldest first, ``NO_TOKEN`` before the first), ``settings`` f32 ``[B, 3]``
    (presence, frequency, repetition), ``min_tokens`` int32 ``[B]``, ``bad_words`` int32
    ``[B, MAX_BAD_WORDS, RECENT + 1]`` (each row: its prefix right-aligned, ``ANY`` before it, then
    its last token; -1 there: unused)."""

    counts: torch.Tensor
    flags: torch.Tensor
    produced: torch.Tensor
    recent: torch.Tensor
    settings: torch.Tensor
    min_tokens: torch.Tensor
    bad_words: torch.Tensor

    def apply(self, logits: torch.Tensor, window: Window | None = None) -> torch.Tensor:
        """f32 logits ``[B, V]`` or ``[B, L, V]`` (position l of ``window``; None: every position at the
        committed output) with the masks and penalties applied, as a new tensor of their shape. Fixed
        shapes, no host synchronisation: capturable."""
        return self.apply_(logits.clone(), window)

    def apply_(self, logits: torch.Tensor, window: Window | None = None) -> torch.Tensor:
        """``apply`` in place: ``logits`` is overwritten and returned. The vocabulary-wide temporaries
        are one position's (``[B, V]``), never the window's ``[B, L, V]``: at 256 rows of an 8-token
        window over a 152k vocabulary each of those would take 1.2 GB (``WorkingMemory``)."""
        x = logits if logits.dim() == 3 else logits[:, None]
        before = torch.zeros_like(self.produced)[:, None] if window is None else window.path.sum(-1)  # [B|1, L]
        self._mask_(x, before, self._tails(x.shape[1], window))
        fixed = None if window is None else self._window_values(x, window)
        self._penalise_(x, self.counts[:, None], self.flags[:, None])
        if fixed is not None:
            x.scatter_(2, window.tokens[:, None].expand(-1, x.shape[1], -1), fixed)
        return logits

    def _tails(self, positions: int, window: Window | None) -> torch.Tensor:
        """int32 ``[B, L, RECENT]``: each position's last output tokens, oldest first -- its path's
        tokens, deepest last, after the committed output's."""
        if window is None:
            return self.recent[:, None].expand(-1, positions, -1)
        back = torch.arange(RECENT, device=self.recent.device)  # tokens back from the position
        depth = window.path.sum(-1)[..., None]  # [B|1, L, 1]
        # on the path at depth - back: the path's token there; above the window: the committed output's
        on_path = window.path[:, :, None] & (window.depths[:, None, None] == (depth - back)[..., None])
        from_path = (on_path * window.tokens[:, None, None]).sum(-1)
        committed = self.recent[:, None].expand(-1, positions, -1).gather(
            2, (RECENT - 1 - back + depth).clamp(max=RECENT - 1).expand(self.recent.shape[0], -1, -1))
        return torch.where(back < depth, from_path.to(torch.int32), committed).flip(-1)

    def _mask_(self, x: torch.Tensor, before: torch.Tensor, tails: torch.Tensor) -> None:
        """-inf in place at the stop ids while ``produced + before`` < min_tokens, at one-token bad
        words, and at a bad word's last token where its prefix ends the tails (position by position)."""
        short = ((self.produced[:, None] + before) < self.min_tokens[:, None]).expand(-1, x.shape[1])  # [B, L]
        stop, banned = (self.flags & STOP) != 0, (self.flags & BANNED) != 0
        for position in range(x.shape[1]):
            x[:, position].masked_fill_(banned | (stop & short[:, position, None]), -math.inf)
        prefix, last = self.bad_words[..., :-1], self.bad_words[..., -1]  # [B, N, RECENT], [B, N]
        ends = ((tails[:, :, None] == prefix[:, None]) | (prefix[:, None] == ANY)).all(-1) & (last >= 0)[:, None]
        # -inf added where a bad word ends the output, 0 elsewhere (entries may share a token)
        index = last.clamp(min=0).long()[:, None].expand(-1, x.shape[1], -1)
        x.scatter_add_(2, index, torch.zeros_like(ends, dtype=x.dtype).masked_fill_(ends, -math.inf))

    def _window_values(self, x: torch.Tensor, window: Window) -> torch.Tensor:
        """f32 ``[B, L, W]``: the penalised logit of each window token at each position, counting the
        window tokens on its path (every entry for one token at one position is the same value)."""
        tokens = window.tokens
        same = (tokens[:, :, None] == tokens[:, None]).float()  # [B, W, W]
        ahead = window.path.float() @ same  # [B, L, W]: copies of token w on position l's path
        counts = self.counts.gather(1, tokens)[:, None] + ahead
        flags = self.flags.gather(1, tokens)[:, None]
        raw = x.gather(2, tokens[:, None].expand(-1, x.shape[1], -1))
        return self._penalise_(raw, counts, flags)

    def _penalise_(self, x: torch.Tensor, counts: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, L, K]`` with the repetition, frequency and presence penalties of tokens with
        output ``counts`` f32 and ``flags`` uint8 (broadcast to ``[B, L, K]``), in place (returned);
        the repetition penalty one position at a time, so its temporaries are ``[B, K]``."""
        presence, frequency, repetition = (s[:, None, None] for s in self.settings.unbind(1))
        seen = ((flags & PROMPT) != 0) | (counts > 0)
        penalty = torch.where(seen, repetition, 1.0).expand_as(x)
        for position in range(x.shape[1]):
            at, by = x[:, position], penalty[:, position]
            torch.where(at < 0, at * by, at / by, out=at)  # transformers' operations
        return x.sub_(frequency * counts).sub_(presence * (counts > 0))  # vLLM's


class PenaltyState:
    """The penalty state of every cache slot (``lines``: the block table's lines, the last the
    padding line) over a ``vocab``-token model, committing up to ``width`` tokens a step: ``counts``
    f32 ``[lines, V]`` and ``flags`` uint8 ``[lines, V]`` (5 bytes per line and token: 49 MB at 64
    slots of a 152k vocabulary), ``produced`` int32 ``[lines]``, ``recent`` int32 ``[lines, RECENT]``,
    ``settings`` f32 ``[lines, 3]``, ``min_tokens`` int32 ``[lines]``, ``bad_words`` int32
    ``[lines, MAX_BAD_WORDS, RECENT + 1]`` (``RowPenalties`` says what each holds). ``PROMPT`` is set
    only for a request with a repetition penalty and ``STOP`` only with ``min_tokens`` (their only
    readers).

    ``stage`` (host) queues a slot's state when a request takes it; ``flush`` writes the queued
    slots before a step's launches, in one pinned transfer, in stream order behind the work already
    queued; ``commit`` (device, captured) appends committed tokens."""

    def __init__(self, lines: int, vocab: int, width: int, device):
        self.vocab, self.device = vocab, device
        i32 = dict(dtype=torch.int32, device=device)
        self.counts = torch.zeros(lines, vocab, device=device)
        self.flags = torch.zeros(lines, vocab, dtype=torch.uint8, device=device)
        self.produced = torch.zeros(lines, **i32)
        self.recent = torch.full((lines, RECENT), NO_TOKEN, **i32)
        self.settings = torch.tensor([NEUTRAL] * lines, device=device)
        self.min_tokens = torch.zeros(lines, **i32)
        self.bad_words = torch.full((lines, MAX_BAD_WORDS, RECENT + 1), ANY, **i32)
        self.offsets = torch.arange(max(RECENT, width), **i32)
        self._pending: dict[int, _SlotState] = {}
        self._host64 = self._hostf = None  # pinned staging, grown as needed
        self._copied: torch.cuda.Event | None = None

    def buffers(self) -> list[torch.Tensor]:
        """The tensors a step writes (``commit``)."""
        return [self.counts, self.produced, self.recent]

    def rows(self, slots: torch.Tensor) -> RowPenalties:
        """The state of rows whose slots are ``slots`` int ``[B]`` (gathered: device ops, capturable)."""
        lines = slots.long()
        return RowPenalties(self.counts[lines], self.flags[lines], self.produced[lines], self.recent[lines],
                            self.settings[lines], self.min_tokens[lines], self.bad_words[lines])

    def commit(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append each row's first ``lengths[b]`` int32 tokens of ``tokens`` int32 ``[B, T]`` to its slot's
        output (rows of one slot each, or of lengths 0). Device ops only: captured in the steps."""
        lines, width = slots.long(), tokens.shape[1]
        kept = (self.offsets[:width] < lengths[:, None]).float()
        self.counts.view(-1).scatter_add_(0, (lines[:, None] * self.vocab + tokens.long()).view(-1), kept.view(-1))
        self.produced.index_add_(0, lines, lengths)
        extended = torch.cat([self.recent[lines], tokens], 1)
        self.recent[lines] = extended.gather(1, (lengths[:, None] + self.offsets[:RECENT]).long())

    def stage(self, slot: int, sampling: "SamplingParams", prompt_ids: list[int], output_ids: list[int],
              stop_ids: frozenset[int]) -> None:
        """Queue ``slot``'s state for a request taking it: its settings, its output so far (a
        preempted request's), and the token sets its controls read (host only; ``flush`` writes it)."""
        self._pending[slot] = _SlotState.of(sampling, prompt_ids, output_ids, stop_ids)

    def flush(self) -> None:
        """Write the queued slots' state to the device (a step's launches follow, in stream order)."""
        if not self._pending:
            return
        slots, states = list(self._pending), list(self._pending.values())
        self._pending = {}
        n, vocab = len(slots), self.vocab
        parts = [np.array(slots), *(np.stack([getattr(s, name) for s in states]).reshape(-1)
                                    for name in ("scalars", "recent", "bad_words")),
                 np.concatenate([slot * vocab + s.output for slot, s in zip(slots, states)]),
                 np.concatenate([(slot * vocab + s.flag_ids) * 8 + s.flag_bits for slot, s in zip(slots, states)])]
        settings = np.array([s.settings for s in states], dtype=np.float32)
        uploaded, settings = self._upload(np.concatenate(parts), settings.reshape(-1))
        lines, scalars, recent, bad_words, counted, flagged = uploaded.split([len(p) for p in parts])
        lines, scalars = lines.long(), scalars.view(n, 2).to(torch.int32)
        for table in (self.counts, self.flags):
            table.index_fill_(0, lines, 0)
        self.min_tokens.index_copy_(0, lines, scalars[:, 0])
        self.produced.index_copy_(0, lines, scalars[:, 1])
        self.recent.index_copy_(0, lines, recent.view(n, RECENT).to(torch.int32))
        self.bad_words.index_copy_(0, lines, bad_words.view(n, MAX_BAD_WORDS, RECENT + 1).to(torch.int32))
        self.settings.index_copy_(0, lines, settings.view(n, 3))
        self.counts.view(-1).index_add_(0, counted, torch.ones_like(counted, dtype=torch.float32))
        self.flags.view(-1)[flagged >> 3] = (flagged & 7).to(torch.uint8)  # one entry per (slot, token)

    def _upload(self, ints: np.ndarray, floats: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``ints`` and f32 ``floats`` on the device, through pinned buffers (rewritten once their
        last transfer is done)."""
        pinned = self.device.type == "cuda"
        if self._copied is not None:
            self._copied.synchronize()
        if self._host64 is None or self._host64.numel() < len(ints) or self._hostf.numel() < len(floats):
            size = 1 << max(len(ints), len(floats), 1024).bit_length()
            with torch.inference_mode(False):  # written by later flushes, in or out of inference mode
                self._host64 = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
                self._hostf = torch.empty(size, dtype=torch.float32, pin_memory=pinned)
        self._host64[:len(ints)] = torch.from_numpy(ints.astype(np.int64))
        self._hostf[:len(floats)] = torch.from_numpy(floats)
        uploaded = (self._host64[:len(ints)].to(self.device, non_blocking=pinned),
                    self._hostf[:len(floats)].to(self.device, non_blocking=pinned))
        if pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return uploaded


@dataclass(frozen=True)
class _SlotState:
    """A slot's staged state on the host: ``settings`` (presence, frequency, repetition), ``scalars``
    (min_tokens, produced), ``recent`` ``[RECENT]``, ``bad_words`` ``[MAX_BAD_WORDS, RECENT + 1]``,
    the ``output`` token ids (one count each), and the flagged token ids with their bits."""

    settings: tuple[float, float, float]
    scalars: np.ndarray
    recent: np.ndarray
    bad_words: np.ndarray
    output: np.ndarray
    flag_ids: np.ndarray
    flag_bits: np.ndarray

    @classmethod
    def of(cls, sampling: "SamplingParams", prompt_ids: list[int], output_ids: list[int],
           stop_ids: frozenset[int]) -> "_SlotState":
        output = np.array(output_ids, dtype=np.int64)
        recent = np.full(RECENT, NO_TOKEN, dtype=np.int64)
        tail = output[max(0, len(output) - RECENT):]
        recent[RECENT - len(tail):] = tail
        bad_words = np.full((MAX_BAD_WORDS, RECENT + 1), ANY, dtype=np.int64)
        bad_words[:, -1] = -1  # unused
        for row, word in zip(bad_words, [w for w in sampling.bad_words if len(w) > 1]):
            row[RECENT + 1 - len(word):] = word
        groups = [(np.array(prompt_ids if sampling.repetition_penalty != 1.0 else []), PROMPT),
                  (np.array(sorted(stop_ids) if sampling.min_tokens > 0 else []), STOP),
                  (np.array([w[0] for w in sampling.bad_words if len(w) == 1]), BANNED)]
        ids = np.concatenate([g for g, _ in groups]).astype(np.int64)
        bits = np.concatenate([np.full(len(g), bit) for g, bit in groups]).astype(np.int64)
        order = np.argsort(ids, kind="stable")
        ids, starts = np.unique(ids[order], return_index=True)
        if len(ids):  # one entry per token: the OR of its bits
            bits = np.bitwise_or.reduceat(bits[order], starts)
        settings = (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty)
        return cls(settings, np.array([sampling.min_tokens, len(output)], dtype=np.int64), recent, bad_words,
                   output, ids, bits[:len(ids)])
