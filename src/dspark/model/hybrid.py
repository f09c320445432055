"""Hybrid targets: sequence mixers with a convolution or recurrent state, run exactly on the engine's
flat ragged tokens -- gated DeltaNet (Qwen3-Next, Qwen3.5 and its copies, OLMo-Hybrid: a short
causal conv1d, then the gated delta rule's ``[heads, dk, dv]`` state), Mamba-2 (Bamba, Granite-4,
Falcon-H1, Nemotron-H, Mamba2: a short causal conv1d, then the selective state space's ``[heads,
head_dim, d_state]`` state), Mamba-1 (Mamba, FalconMamba, Jamba: ``mamba``, on these states) and
LFM2's short convolutions (LFM2, LFM2-MoE, LFM3).

**States by position.** Each stateful layer keeps, per cache line, a short ring of states indexed by
position: the conv's inputs at ``p % conv_window`` and the recurrent state *after* position ``p`` at
``p % window``. A forward's tokens of a line at positions ``start ..`` read the state after
``start - 1`` (zero at position 0) and write one per token. So the state after any accepted prefix of
a verify window is already there -- the engine's rollback is choosing the next anchor position, as
for the KV cache -- and rounds with no drafts, plain decoding, chunked prefill (a chunk starts from
the previous one's last state), preemption (a request runs again from position 0) and a slot reused
after an abort need nothing more. The rings are sized so that no write of a window (at most
``verify_len`` tokens past the committed ones) reaches a state a later round reads:
``window = verify_len + 1`` recurrent states (also keeping a retried window's start state) and
``verify_len + kernel - 1`` conv inputs. The cost is ``verify_len + 1`` recurrent states per line
and a state write per position.

**Checkpoint + replay** (``StateLayout.checkpoints``, ``EngineConfig.gated_delta_checkpoints``, the
engine's default where a target has gated DeltaNet layers; those layers only): per line two
checkpoint slots and two halves of kept window inputs instead of the ring of recurrent states, and
per line where its checkpoints stand and which slot and half are current
(``StatePool.checkpoint_positions`` / ``checkpoint_slots``). Each ragged group runs one
``K.gated_delta_replay_scan`` (``checkpoint_scan``): from the current checkpoint (zero at position
0) through the kept tokens before the request's first position (its last window's accepted prefix)
into the other slot, then a round-sized group's tokens with outputs, kept in the other half; a
longer group (prompt chunks) is scanned whole from that checkpoint and its last state written there,
nothing kept. ``Forward.commit`` makes the other slot and half current once the forward has run
through, and not while the pool is frozen: what the next forward reads is never written by one that
failed or was a warm-up. The conv rings are as above. With prefix caching a third checkpoint entry
per line (``BLOCK_END``) holds the state after the last block end its committed tokens passed: the
replay kernel writes it as it passes one (its snapshot fields), a prompt chunk scanned whole is
split there as below, and ``StatePool.save`` replays a line's kept tokens up to the block end it
saves where no forward has replayed them yet (a leaving request's last window, a prompt chunk run as
a window); ``StatePool.restore`` writes a snapshot into the current checkpoint slot and sets the
line's checkpoint position after its block.

Prompt chunks (groups longer than a round) are scanned whole, every request of the group padded to
the group's length with inputs that leave the state as it is (gated DeltaNet: zero key, value, beta
and log-decay; Mamba: zero dt, x, B and C), from each line's state -- gated DeltaNet by the chunked
delta rule (flash-linear-attention's ``chunk_gated_delta_rule`` on a GPU, the modeling file's
``torch_chunk_gated_delta_rule`` elsewhere, as transformers runs a prompt), Mamba-2 by the chunked SSD
scan (the modeling file's ``mamba2_chunk_scan`` with the lines' states as its initial states:
transformers' own prompt scan, which it maps to mamba-ssm's ``mamba_chunk_scan_combined`` on a GPU
where that is installed; dt already biased, softplus'd and clamped per position, so the padding's
zero dt stays zero), Mamba-1 by ``mamba.selective_chunk_scan`` (PyTorch everywhere: mamba-ssm's
selective scan takes no initial state) -- writing only the states later forwards read: after each
request's last token and, with prefix caching, after the last block end among its tokens (the scan
split there). Exact to the sequential scan up to the chunked forms' reassociation (fp32:
tests/test_hybrid_target.py). ``CHUNKED_PROMPTS = False``: the sequential scan for every group (the
reference the chunked ones are tested on). A round's gated delta rule and Mamba-2 update run on a
GPU as one kernel per ragged group (``K.gated_delta_scan``: flash-linear-attention's fused recurrent
step; ``K.selective_state_scan``: transformers' ``mamba2_selective_state_update`` in f32;
``WINDOW_SCAN_DEVICES``) over the whole window, each request's state read once and the state after
every position written straight into its ring entry; elsewhere, and Mamba-1's scan, one position at
a time, all requests of a ragged group at once (static shapes, no host
synchronisation: CUDA-graph capturable): the gated delta rule as the modeling file's own
``torch_recurrent_gated_delta_rule`` (the PyTorch reference transformers falls back to); Mamba-2 as the modeling file's ``mamba2_selective_state_update`` (transformers' recurrent
step, which it maps to mamba-ssm's kernel where its kernel hub provides it). The conv is
``F.conv1d`` over each token's ``kernel`` inputs, as transformers computes it (on
``WINDOW_SCAN_DEVICES`` one kernel per forward, ``K.causal_conv_window``: each token's inputs
gathered, summed and written into its ring entry in one pass). Tree verification,
which would need a state per tree node, is refused by the engine for these targets.

**Prefix caching** (``StateLayout.boundaries`` > 0): a cached block is usable for a hybrid target
only with the states after its last position. The rings keep those apart: the recurrent state after
the last position of a block, and the conv inputs of the block's last ``kernel - 1`` positions, go to
``boundaries`` extra entries per line, chosen by the block's index (``(p // block_size) %
boundaries``), not by ``p % window``; every other position is kept as before. A window never writes
``boundaries`` block ends apart, so the states after the last full block of committed tokens stay in
the ring until the line's anchor passes the next one: the engine copies them into a snapshot slot
(``StatePool.save``: a chunk's last full block, a leaving request's last full block) and back into a
line whose request found that block in the cache (``StatePool.restore``).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import kernels as K
from . import mamba

__all__ = ["BLOCK_END", "HYBRID", "Forward", "LayerStates", "StateLayout", "StatePool", "Tokens", "causal_conv",
           "checkpoint_scan", "conv_tail", "delta_chunk_rule", "delta_rule", "has_gated_deltanet", "install",
           "is_supported_mixer", "new_pool", "pool_bytes", "prompt_dependent", "state_scan"]

_DELTANET, _SHORT_CONV, _MAMBA2 = "gated DeltaNet", "short convolution", "Mamba-2"
_MAMBA_TYPES = ("mamba", "linear_attention")  # what configs declare Mamba layers as (older releases: "mamba")
# prompt chunks scanned whole (gated DeltaNet: the chunked delta rule; Mamba-2: the chunked SSD scan;
# Mamba-1: mamba.selective_chunk_scan) rather than position by position; False: the sequential scan
# for every group (the reference the chunked scans are tested on)
CHUNKED_PROMPTS = True
# device types whose gated DeltaNet and Mamba-2 groups of round-sized windows run in one kernel each
# (``K.gated_delta_scan``, ``K.selective_state_scan``: the state read once, written per position), and
# whose convs run in one kernel per forward (``K.causal_conv_window``); elsewhere position by position
# through the modeling file's reference, and the conv as ``F.conv1d`` (what the kernels are tested against)
WINDOW_SCAN_DEVICES = {"cuda"}
# under StateLayout.checkpoints with prefix caching, the checkpoint entry of each line holding its gated DeltaNet
# state after the last block end its committed tokens passed (beside the two checkpoint slots, 0 and 1)
BLOCK_END = 2
# the stateful mixers run here: class name -> (kind, the layer types a config declares their layers as)
_SUPPORTED = {"Qwen3NextGatedDeltaNet": (_DELTANET, ("linear_attention",)),
              # Qwen3.5's gated DeltaNet, in the families that copy it
              **{name: (_DELTANET, ("linear_attention",)) for name in (
                  "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                  "LaraMiniGatedDeltaNet", "OlmoHybridGatedDeltaNet")},
              **{name: (_SHORT_CONV, ("conv",)) for name in ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")},
              "BambaMixer": (_MAMBA2, _MAMBA_TYPES),
              "GraniteMoeHybridMambaLayer": (_MAMBA2, _MAMBA_TYPES),
              "NemotronHMamba2Mixer": (_MAMBA2, _MAMBA_TYPES),
              "Mamba2Mixer": (_MAMBA2, _MAMBA_TYPES),
              "Zamba2MambaMixer": (_MAMBA2, _MAMBA_TYPES),
              "FalconH1Mixer": (_MAMBA2, ("mamba", "hybrid")),  # beside attention in a "hybrid" layer
              **{name: (mamba.MAMBA1, _MAMBA_TYPES) for name in mamba.MAMBA1_MIXERS}}


@dataclass(frozen=True)
class Tokens:
    """Where each of a forward's ``N`` flat tokens is (int64 ``[N]``): its cache line (``slots``),
    ``positions``, ``offsets`` (its index among its request's tokens in this forward) and
    ``lengths`` (that request's token count); ``groups``: the forward's ragged groups
    ``(first token, end token, AttentionBatch)``."""

    slots: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    groups: list

    @classmethod
    def of(cls, slots: torch.Tensor, positions: torch.Tensor, groups: list) -> "Tokens":
        offsets, lengths = [], []
        for lo, hi, batch in groups:
            cu = batch.cu_query_lens.long()
            counts = cu[1:] - cu[:-1]
            request = torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts,
                                              output_size=hi - lo)
            offsets.append(torch.arange(hi - lo, device=cu.device) - cu[request])
            lengths.append(counts[request])
        return cls(slots.long(), positions.long(), torch.cat(offsets), torch.cat(lengths), groups)


@dataclass(frozen=True)
class StateLayout:
    """How a ``StatePool``'s rings are laid out: ``window`` tokens a line runs per round at most (the
    verify length); with prefix caching, ``boundaries`` ring entries for the states at the ends of
    blocks of ``block_size`` positions and ``snapshots`` slots to copy them to (0, 0: no prefix
    caching); ``checkpoints``: gated DeltaNet layers keep checkpoints and their last window's inputs
    instead of a state per position (module docstring: checkpoint + replay; with prefix caching, a
    third checkpoint entry per line, ``BLOCK_END``, instead of their block-end entries)."""

    window: int
    block_size: int = 0
    boundaries: int = 0
    snapshots: int = 0
    checkpoints: bool = False

    @classmethod
    def of(cls, window: int, block_size: int, snapshots: int, checkpoints: bool = False) -> "StateLayout":
        """Rounds of ``window`` tokens; with ``snapshots`` > 0 prefix caching over blocks of
        ``block_size``, with enough block-end entries that no window past a line's committed tokens
        reaches the entry of its last full block (one block end past it, and one per ``block_size``
        tokens of the window beyond the first)."""
        if not snapshots:
            return cls(window, checkpoints=checkpoints)
        return cls(window, block_size, 2 + (window - 1) // block_size, snapshots, checkpoints)


@dataclass
class LayerStates:
    """One stateful layer's rings, a line per cache slot plus a scratch line (masked writes):
    ``conv`` ``[lines, conv_window, channels]`` (the conv's inputs, model dtype) and, for gated
    DeltaNet / Mamba-2, ``recurrent`` f32 ``[lines, window, heads, dk, dv]`` / ``[lines, window,
    heads, head_dim, d_state]`` (the state after each position); ``kernel`` the conv's. With prefix
    caching, snapshot slots of the states after a block's last position: ``snapshot_conv``
    ``[snapshots, kernel - 1, channels]`` and ``snapshot_recurrent`` ``[snapshots, ...]``. A gated
    DeltaNet layer under ``StateLayout.checkpoints`` instead: ``recurrent`` f32 ``[lines, 2, heads,
    dk, dv]`` (two checkpoint slots; with prefix caching ``[lines, 3, ...]``, the third
    ``BLOCK_END``) and ``kept`` its windows' inputs ``k``, ``v`` (model dtype), ``g`` (f32),
    ``beta`` (model dtype) ``[lines, 2 * window, heads, ...]`` (two halves)."""

    conv: torch.Tensor
    recurrent: torch.Tensor | None = None
    kernel: int = 1
    snapshot_conv: torch.Tensor | None = None
    snapshot_recurrent: torch.Tensor | None = None
    kept: tuple[torch.Tensor, ...] | None = None


class StatePool:
    """The states of a hybrid target's stateful layers beside its KV cache: ``layers[i]`` the
    ``LayerStates`` of decoder layer ``i``; ``layout`` their ``StateLayout`` (``window`` the tokens
    a line runs per round at most). ``scratch`` is the line masked writes go to; while ``frozen``
    every write goes there (a CUDA graph's warm-up run: a prompt chunk longer than the rings would
    overwrite the state it starts from, which the captured step then reads again). ``prompt_lens``
    int64 ``[lines]``: the prompt length of each line's request (``set_prompt_len``; 0 until set),
    the positions where Mamba-2 clamps dt to its ``time_step_limit`` -- transformers clamps it in a
    prompt's chunked scan and not in its recurrent decoding step. Under ``StateLayout.checkpoints``,
    per line (int64 ``[lines]``) the position its gated DeltaNet checkpoints stand at
    (``checkpoint_positions``: the state before it) and the checkpoint slot and kept half that hold
    them (``checkpoint_slots``, 0 or 1), set by ``Forward.commit``."""

    def __init__(self, layers: dict[int, LayerStates], layout: StateLayout):
        self.layers, self.layout, self.window = layers, layout, layout.window
        conv = next(iter(layers.values())).conv
        self.scratch = conv.shape[0] - 1
        self.prompt_lens = torch.zeros(conv.shape[0], dtype=torch.long, device=conv.device)
        self.checkpoint_positions = torch.zeros_like(self.prompt_lens)
        self.checkpoint_slots = torch.zeros_like(self.prompt_lens)
        self.frozen = False

    def set_prompt_len(self, slot: int, length: int) -> None:
        """Line ``slot`` now holds a request of a ``length``-token prompt (a stream-ordered write)."""
        self.prompt_lens[slot] = length

    @contextlib.contextmanager
    def frozen_writes(self):
        """Within: every write goes to the scratch line (a forward whose states the next one makes again)."""
        self.frozen = True
        try:
            yield
        finally:
            self.frozen = False

    def write_lines(self, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The lines to write tokens (or requests) of ``slots`` at: theirs where ``keep``, else the scratch line."""
        return torch.where(keep & (not self.frozen), slots, self.scratch)

    def recurrent_entries(self, positions: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """The entries of recurrent ``ring`` ``[lines, entries, ...]`` holding the states after
        ``positions`` (int64, any shape): a block's last position at its block-end entry, the others
        by position modulo the window (module docstring)."""
        ends, size = self.layout.boundaries, self.layout.block_size
        window = ring.shape[1] - ends
        if not ends:
            return positions % window
        return torch.where((positions + 1) % size == 0, window + (positions // size) % ends, positions % window)

    def conv_entries(self, positions: torch.Tensor, ring: torch.Tensor,
                     kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(entries, at a block's end)``: the entries of conv ``ring`` ``[lines, entries, C]``
        holding the inputs at ``positions`` (int64, any shape) -- a block's last ``kernel - 1``
        positions in its block-end entries, the others by position modulo the window -- and which
        positions are of those last ones."""
        ends, size, tail = self.layout.boundaries, self.layout.block_size, kernel - 1
        window = ring.shape[1] - ends * tail
        if not ends:
            return positions % window, torch.zeros_like(positions, dtype=torch.bool)
        into = positions % size - (size - tail)
        at_end = into >= 0
        return torch.where(at_end, window + (positions // size) % ends * tail + into, positions % window), at_end

    def save(self, lines: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy the states after the last position of block ``blocks[i]`` (its index in the line)
        of cache line ``lines[i]`` into snapshot slot ``slots[i]`` (int64 ``[n]`` each): the
        recurrent state and the conv inputs of the block's last ``kernel - 1`` positions (under
        ``StateLayout.checkpoints`` the gated DeltaNet states from ``BLOCK_END``, replayed there
        first: ``_replay_to_block_ends``)."""
        if self.layout.checkpoints:
            self._replay_to_block_ends(lines, blocks)
        for states, recurrent, conv in self._block_ends(lines, blocks, torch.full_like(lines, BLOCK_END)):
            if recurrent is not None:
                states.snapshot_recurrent[slots] = states.recurrent[lines, recurrent]
            states.snapshot_conv[slots] = states.conv[lines[:, None], conv]

    def restore(self, lines: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """``save`` backwards: snapshot ``slots[i]`` into line ``lines[i]``'s states after block
        ``blocks[i]``, where its next tokens read them (under ``StateLayout.checkpoints`` the gated
        DeltaNet states into the current checkpoint slot, which then stands after the block)."""
        for states, recurrent, conv in self._block_ends(lines, blocks, self.checkpoint_slots[lines]):
            if recurrent is not None:
                states.recurrent[lines, recurrent] = states.snapshot_recurrent[slots]
            states.conv[lines[:, None], conv] = states.snapshot_conv[slots]
        if self.layout.checkpoints:
            self.checkpoint_positions[lines] = (blocks + 1) * self.layout.block_size

    def _block_ends(self, lines: torch.Tensor, blocks: torch.Tensor, checkpoint_entries: torch.Tensor):
        """Per layer: ``(LayerStates, recurrent entries [n] or None, conv entries [n, kernel - 1])``
        of the states after the last position of each block (a gated DeltaNet layer's under
        ``StateLayout.checkpoints``: ``checkpoint_entries``)."""
        ends = (blocks + 1) * self.layout.block_size - 1
        for states in self.layers.values():
            back = torch.arange(states.kernel - 2, -1, -1, device=ends.device)  # oldest first
            conv, _ = self.conv_entries(ends[:, None] - back, states.conv, states.kernel)
            recurrent = None if states.recurrent is None else checkpoint_entries if states.kept is not None \
                else self.recurrent_entries(ends, states.recurrent)
            yield states, recurrent, conv

    def _replay_to_block_ends(self, lines: torch.Tensor, blocks: torch.Tensor) -> None:
        """Under ``StateLayout.checkpoints``: line ``lines[i]``'s gated DeltaNet states after block
        ``blocks[i]`` into its ``BLOCK_END`` entry, where that block's end is among the committed
        tokens its next forward would replay (a leaving request's last window, a prompt chunk run
        as a window): its current checkpoint advanced through them by ``K.gated_delta_replay_scan``,
        the steps that replay would take. A checkpoint past that block end finds the state there
        already (written by the replay or prompt chunk that passed it, the last block end the
        line's committed tokens passed), and copies it onto itself."""
        window = self.window
        replayed = (blocks + 1) * self.layout.block_size - self.checkpoint_positions[lines]
        slot, block_end, none = self.checkpoint_slots[lines], torch.full_like(lines, BLOCK_END), torch.zeros_like(lines)
        replay = K.Replay(lines, read_entries=torch.where(replayed >= 0, slot, block_end), replay_entries=slot * window,
                          replay_counts=replayed.clamp(min=0), write_entries=block_end, keep_entries=none,
                          first_tokens=none, token_counts=none)
        for states in self.layers.values():
            if states.kept is not None:
                unread = [t[0, :1] for t in states.kept]  # a row of inputs no request runs ([1, HV, ...])
                K.gated_delta_replay_scan(unread[0], *unread, states.recurrent, *states.kept, *replay, scale=1.0)


@dataclass
class Forward:
    """What a mixer needs from the current engine forward; ``windows``: the window scans' addressing
    of each group (``_window_group``, ``_replay_group``) and the conv kernel's (``_conv_window``),
    made by the forward's first stateful layer, read by the others; ``commits``: the checkpoints
    this forward wrote, ``(lines, positions, slots)`` per group (``commit``)."""

    pool: StatePool
    tokens: Tokens
    windows: dict = field(default_factory=dict)
    commits: list = field(default_factory=list)

    def commit(self) -> None:
        """Once the forward has run through every layer: the checkpoints it wrote become the ones the
        next forward reads (``StatePool.checkpoint_positions`` / ``checkpoint_slots``). Not while the
        pool is frozen, nor after a forward that failed: the lines keep the checkpoints they had,
        which no forward overwrites (each writes the other slot and half)."""
        if self.pool.frozen:
            return
        for lines, positions, slots in self.commits:
            self.pool.checkpoint_positions[lines] = positions
            self.pool.checkpoint_slots[lines] = slots


HYBRID: contextvars.ContextVar[Forward] = contextvars.ContextVar("dspark_hybrid_forward")


def is_supported_mixer(module, declared: str | None) -> bool:
    """Whether ``module`` is a stateful mixer run here (gated DeltaNet, Mamba-1, Mamba-2, short
    convolutions: ``_SUPPORTED``) in a layer declared as its type (``declared``; None: none declared)."""
    kind, types = _SUPPORTED.get(type(module).__name__, (None, ()))
    return kind is not None and (declared is None or declared in types)


def prompt_dependent(mixers: dict[int, torch.nn.Module]) -> bool:
    """Whether a mixer's recurrence depends on which positions were the prompt -- a Mamba-2
    ``time_step_limit`` other than (0, inf), clamped at prompt positions only: its states after a
    cached block hold the prompt length of the request that wrote them, so they cannot serve another."""
    free = (0.0, float("inf"))
    return any(_kind(m) == _MAMBA2 and tuple(m.time_step_limit or free) != free for m in mixers.values())


def has_gated_deltanet(mixers: dict[int, torch.nn.Module]) -> bool:
    """Whether a mixer is a gated DeltaNet (the layers ``StateLayout.checkpoints`` applies to)."""
    return any(_kind(m) == _DELTANET for m in mixers.values())


def _kind(module) -> str:
    return _SUPPORTED[type(module).__name__][0]


def install(mixers: dict[int, torch.nn.Module]) -> None:
    """Route the forward of each mixer (decoder layer index -> module) through the engine's states
    while an engine forward runs (``HYBRID`` set); outside it the module runs its own code, so
    the model stays usable on its own. Idempotent; bound methods, so that a deep copy of the model
    routes its own mixers."""
    for index, module in mixers.items():
        if getattr(module, "_dspark_original_forward", None) is None:
            module._dspark_layer, module._dspark_original_forward = index, module.forward
            module.forward = types.MethodType(_routed_forward, module)


def new_pool(mixers: dict[int, torch.nn.Module], lines: int, layout: StateLayout, device, dtype) -> StatePool:
    """Zero states for ``lines`` cache lines (plus the scratch line) laid out as ``layout``."""
    layers = {}
    for index, module in mixers.items():
        conv_shape, recurrent_shape = _state_shapes(module, lines, layout)
        if _kind(module) == _DELTANET:
            delta_rule(module, torch.device(device))  # a missing kernel is named before any step
        conv = torch.zeros(conv_shape, dtype=dtype, device=device)
        recurrent = None if recurrent_shape is None else torch.zeros(recurrent_shape, device=device)
        kernel = _conv(module).kernel_size[0]
        snapshots = {}
        if layout.snapshots:
            snapshots = dict(snapshot_conv=conv.new_zeros((layout.snapshots, kernel - 1, conv_shape[2])),
                             snapshot_recurrent=None if recurrent is None else
                             recurrent.new_zeros((layout.snapshots, *recurrent_shape[2:])))
        kept = tuple(torch.zeros(shape, dtype=torch.float32 if f32 else dtype, device=device)
                     for shape, f32 in _kept_shapes(module, lines, layout)) or None
        layers[index] = LayerStates(conv, recurrent, kernel, **snapshots, kept=kept)
    return StatePool(layers, layout)


def conv_tail(mixers: dict[int, torch.nn.Module]) -> int:
    """The most inputs before a position that a mixer's conv reads (its kernel less one)."""
    return max(_conv(module).kernel_size[0] - 1 for module in mixers.values())


def pool_bytes(mixers: dict[int, torch.nn.Module], lines: int, layout: StateLayout, dtype) -> int:
    """What ``new_pool`` allocates, in bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for module in mixers.values():
        conv_shape, recurrent_shape = _state_shapes(module, lines, layout)
        conv_snapshot = conv_shape[2] * (_conv(module).kernel_size[0] - 1)
        recurrent = 0 if recurrent_shape is None else recurrent_shape.numel()
        recurrent_snapshot = 0 if recurrent_shape is None else recurrent_shape[2:].numel()
        total += size * (conv_shape.numel() + layout.snapshots * conv_snapshot)
        total += 4 * (recurrent + layout.snapshots * recurrent_snapshot)
        total += sum((4 if f32 else size) * shape.numel() for shape, f32 in _kept_shapes(module, lines, layout))
    return total


def _state_shapes(module, lines: int, layout: StateLayout) -> tuple[torch.Size, torch.Size | None]:
    """A mixer's conv ring ``[lines + 1, window + kernel - 1 + boundaries * (kernel - 1), channels]``
    and its recurrent ring ``[lines + 1, window + 1 + boundaries, ...]`` (None for a short
    convolution; a gated DeltaNet's two checkpoint slots ``[lines + 1, 2, ...]`` under
    ``StateLayout.checkpoints``, and ``BLOCK_END`` with prefix caching; module docstring: why these sizes)."""
    conv, window, ends = _conv(module), layout.window, layout.boundaries
    tail = conv.kernel_size[0] - 1
    conv_shape = torch.Size((lines + 1, window + tail + ends * tail, conv.in_channels))
    kind, states = _kind(module), (lines + 1, window + 1 + ends)
    if kind == _DELTANET:
        slots = (lines + 1, 2 + (layout.snapshots > 0)) if layout.checkpoints else states
        return conv_shape, torch.Size((*slots, module.num_v_heads, module.head_k_dim, module.head_v_dim))
    if kind == _MAMBA2:
        return conv_shape, torch.Size((*states, module.num_heads, module.head_dim, module.ssm_state_size))
    if kind == mamba.MAMBA1:
        return conv_shape, torch.Size((*states, module.intermediate_size, module.ssm_state_size))
    return conv_shape, None


def _kept_shapes(module, lines: int, layout: StateLayout) -> list[tuple[torch.Size, bool]]:
    """A gated DeltaNet's kept window inputs under ``StateLayout.checkpoints`` -- ``k``, ``v``, ``g``,
    ``beta`` ``[lines + 1, 2 * window, heads, ...]``, each with whether it is f32 (``g``; the others
    in the model's dtype) -- none otherwise."""
    if not layout.checkpoints or _kind(module) != _DELTANET:
        return []
    entries = (lines + 1, 2 * layout.window, module.num_v_heads)
    return [(torch.Size((*entries, module.head_k_dim)), False), (torch.Size((*entries, module.head_v_dim)), False),
            (torch.Size(entries), True), (torch.Size(entries), False)]


def _conv(module) -> torch.nn.Conv1d:
    return module.conv1d if hasattr(module, "conv1d") else module.conv


def _routed_forward(module, hidden_states, *args, **kwargs):
    """A routed mixer's forward: the engine's (its decoder layer's states) while ``HYBRID`` is set."""
    current = HYBRID.get(None)
    if current is None:
        return module._dspark_original_forward(hidden_states, *args, **kwargs)
    mix = {_DELTANET: _gated_deltanet, _SHORT_CONV: _short_conv, _MAMBA2: _mamba2, mamba.MAMBA1: mamba.mamba1}[
        _kind(module)]
    return mix(module, hidden_states[0], current.pool.layers[module._dspark_layer], current)[None]


# ---- the mixers -------------------------------------------------------------------------------


def _short_conv(module, hidden: torch.Tensor, states: LayerStates, current: Forward) -> torch.Tensor:
    """LFM2's ``Lfm2ShortConv`` on ``hidden`` ``[N, H]``: ``out_proj(C * conv(B * x))``."""
    b, c, x = module.in_proj(hidden).chunk(3, dim=-1)
    conv = causal_conv(b * x, module.conv, states.conv, current)
    return module.out_proj(c * conv)


def _gated_deltanet(module, hidden: torch.Tensor, states: LayerStates, current: Forward) -> torch.Tensor:
    """Qwen3-Next's / Qwen3.5's / OLMo-Hybrid's gated DeltaNet on ``hidden`` ``[N, H]`` (their forward,
    less the cache: the conv and the delta rule run on the engine's states). OLMo-Hybrid's beta
    spans [0, 2] (``allow_neg_eigval``); its gated norm and output projection are ``o_norm`` / ``o_proj``."""
    n = hidden.shape[0]
    mixed, z, b, a = _deltanet_projections(module, hidden)
    mixed = _activation(module.activation)(causal_conv(mixed, module.conv1d, states.conv, current))
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query, key = (t.reshape(n, -1, module.head_k_dim) for t in (query, key))
    value = value.reshape(n, -1, module.head_v_dim)
    beta = b.sigmoid() * (2.0 if getattr(module, "allow_neg_eigval", False) else 1.0)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    groups = module.num_v_heads // module.num_k_heads
    if groups > 1:
        query, key = (t.repeat_interleave(groups, dim=1, output_size=module.num_v_heads) for t in (query, key))
    rule, chunk_rule = delta_rule(module, hidden.device), delta_chunk_rule(module, hidden.device)

    def step(state, q, k, v, g_t, beta_t):
        o, after = rule(q[:, None], k[:, None], v[:, None], g=g_t[:, None], beta=beta_t[:, None], initial_state=state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0], after

    def chunked(state, q, k, v, g_t, beta_t):  # whole prompt chunks [R, T, ...]
        return chunk_rule(q, k, v, g=g_t, beta=beta_t, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)

    def window(ring, *addressing):  # every position of a round in one kernel (kernels.recurrent)
        return K.gated_delta_scan(query, key, value, g, beta, ring, *addressing, scale=module.head_k_dim ** -0.5)

    inputs = (query, key, value, g, beta)
    if states.kept is not None:
        core = checkpoint_scan(inputs, states, current, chunked, module.head_k_dim ** -0.5)
    else:
        core = state_scan(step, inputs, states.recurrent, current, chunked if CHUNKED_PROMPTS else None,
                          window if hidden.device.type in WINDOW_SCAN_DEVICES else None)
    norm, out = (module.o_norm, module.o_proj) if hasattr(module, "o_proj") else (module.norm, module.out_proj)
    core = norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return out(core.reshape(n, -1))


def _mamba2(module, hidden: torch.Tensor, states: LayerStates, current: Forward) -> torch.Tensor:
    """A Mamba-2 mixer (Bamba, Granite-4, Falcon-H1, Nemotron-H, Mamba2, Zamba2) on ``hidden`` ``[N,
    H]`` (their forward, less the cache): ``in_proj`` -> gate | conv input | dt (Falcon-H1: its input
    multiplier and MuP vector around it); the conv on the engine's states; ``softplus(dt + dt_bias)``,
    clamped to ``time_step_limit`` at prompt positions only (``StatePool.prompt_lens``), as
    transformers' chunked prompt scan clamps and its recurrent step does not; the selective state
    update position by position (the modeling file's ``mamba2_selective_state_update``,
    transformers' own recurrent step), prompt chunks by its chunked SSD scan (``mamba2_chunk_scan``,
    from the lines' states; ``CHUNKED_PROMPTS``); the gated norm (Falcon-H1 without one: a SiLU gate) and
    ``out_proj``."""
    if hasattr(module, "mup_vector"):  # Falcon-H1
        projected = module.in_proj(hidden * module.ssm_in_multiplier) * module.mup_vector.view(-1)
    else:
        projected = module.in_proj(hidden)
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    xbc = _activation(module.activation)(causal_conv(xbc, module.conv1d, states.conv, current))
    groups = module.n_groups * module.ssm_state_size
    x, b, c = torch.split(xbc, [module.intermediate_size, groups, groups], dim=-1)
    modeling = sys.modules[type(module).__module__]
    heads, head_dim, size, n_groups = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    a_heads = -torch.exp(module.A_log.float())
    a = a_heads[:, None, None].expand(-1, head_dim, size)
    d = module.D[:, None].expand(-1, head_dim)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype))
    low, high = module.time_step_limit or (0.0, float("inf"))
    t = current.tokens
    dt = torch.where((t.positions < current.pool.prompt_lens[t.slots])[:, None], dt.clamp(low, high), dt)

    def step(state, x_t, dt_t, b_t, c_t):
        after = state.clone()  # updated in place
        r = x_t.shape[0]
        out = modeling.mamba2_selective_state_update(
            after, x_t.view(r, heads, head_dim), dt_t[:, :, None].expand(-1, -1, head_dim), a,
            b_t.view(r, n_groups, size), c_t.view(r, n_groups, size), d)
        return out.reshape(r, -1), after

    def chunked(state, x_t, dt_t, b_t, c_t):  # whole prompt chunks [R, T, ...]; dt already final (no bias, no limit)
        r, length = dt_t.shape[:2]
        out, after = modeling.mamba2_chunk_scan(
            x_t.view(r, length, heads, head_dim), dt_t, a_heads, b_t.view(r, length, n_groups, size),
            c_t.view(r, length, n_groups, size), chunk_size=module.chunk_size, D=module.D, initial_states=state,
            return_final_states=True)
        return out.reshape(r, length, -1).to(x_t.dtype), after

    def window(ring, *addressing):  # every position of a round in one kernel (kernels.recurrent)
        r = x.shape[0]
        out = K.selective_state_scan(x.view(r, heads, head_dim), dt, a_heads, b.view(r, n_groups, size),
                                     c.view(r, n_groups, size), module.D, ring, *addressing)
        return out.view(r, -1)

    scan = state_scan(step, (x, dt, b, c), states.recurrent, current, chunked if CHUNKED_PROMPTS else None,
                      window if hidden.device.type in WINDOW_SCAN_DEVICES else None)
    gated = module.norm(scan, gate) if getattr(module, "mamba_rms_norm", True) else scan * F.silu(gate)
    return module.out_proj(gated.to(hidden.dtype))


def _deltanet_projections(module, hidden: torch.Tensor):
    """``(conv input [N, 2*key_dim + value_dim] (q | k | v), z [N, hv, dv], b [N, hv], a [N, hv])``
    of each family's projections (Qwen3-Next interleaved, OLMo-Hybrid one each, Qwen3.5 fused q | k | v)."""
    n = hidden.shape[0]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden[None]),
                                                               module.in_proj_ba(hidden[None]))
        mixed = torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=-1)
        return mixed, z[0], b[0], a[0]
    if hasattr(module, "g_proj"):  # OLMo-Hybrid: a projection each, the gate z is g_proj's
        mixed = torch.cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)], dim=-1)
        z = module.g_proj(hidden).reshape(n, -1, module.head_v_dim)
        return mixed, z, module.b_proj(hidden), module.a_proj(hidden)
    z = module.in_proj_z(hidden).reshape(n, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def delta_rule(module, device: torch.device):
    """The gated delta rule over positions, ``(q, k, v, g=, beta=, initial_state=,
    output_final_state=, use_qk_l2norm_in_kernel=) -> (out, state)``: on a GPU flash-linear-attention's
    fused recurrent Triton kernel (what transformers itself dispatches to there; ``fla-core``),
    elsewhere the modeling file's PyTorch reference, ``torch_recurrent_gated_delta_rule``."""
    if device.type != "cuda":
        return sys.modules[type(module).__module__].torch_recurrent_gated_delta_rule
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as exc:
        raise RuntimeError(f"{type(module).__name__} layers on a GPU run flash-linear-attention's gated delta rule "
                           "kernel, which is not installed: pip install fla-core") from exc
    return fused_recurrent_gated_delta_rule


def delta_chunk_rule(module, device: torch.device):
    """``delta_rule`` over whole sequences in chunks (the same arguments, ``[R, T, ...]``): on a GPU
    flash-linear-attention's chunked Triton kernel, elsewhere the modeling file's
    ``torch_chunk_gated_delta_rule`` -- what transformers runs a prompt with."""
    if device.type != "cuda":
        return sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # installed: delta_rule checked it

    return chunk_gated_delta_rule


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


# ---- the states -------------------------------------------------------------------------------


def causal_conv(x: torch.Tensor, conv: torch.nn.Conv1d, ring: torch.Tensor, current: Forward) -> torch.Tensor:
    """A depthwise causal ``conv`` (kernel ``K``) of each token's input ``x`` ``[N, C]`` and the
    ``K - 1`` inputs before it -- this forward's tokens of its request, earlier positions from
    ``ring`` ``[lines, entries, C]`` (zero before position 0; ``StatePool.conv_entries``) -- as
    ``F.conv1d`` over those ``K`` inputs (transformers' own op); then each token's input goes into
    ``ring`` unless a later token of its request takes the same entry. Returns ``[N, C]`` in ``x``'s
    dtype. On ``WINDOW_SCAN_DEVICES`` one kernel for the whole forward (``K.causal_conv_window``,
    addressing ``_conv_window``): its f32 sums, oldest input first, may differ from cuDNN's
    ``F.conv1d`` in the last bit -- plain decoding and DSpark rounds run the same kernel, so their
    outputs stay identical to each other."""
    kernel = conv.kernel_size[0]
    if x.device.type in WINDOW_SCAN_DEVICES:
        return K.causal_conv_window(x, conv.weight[:, 0], conv.bias, ring, *_conv_window(ring, kernel, current))
    t, pool = current.tokens, current.pool
    n = x.shape[0]
    rows = torch.arange(n, device=x.device)
    taps = []
    for back in range(kernel - 1, 0, -1):  # oldest first, as the kernel's weights
        before = t.positions - back
        cached = ring[t.slots, pool.conv_entries(before, ring, kernel)[0]] * (before >= 0)[:, None].to(ring.dtype)
        inside = x[(rows - back).clamp(min=0)]
        taps.append(torch.where((t.offsets >= back)[:, None], inside, cached.to(x.dtype)))
    inputs = torch.stack([*taps, x], dim=-1).to(conv.weight.dtype)  # [N, C, K]
    out = F.conv1d(inputs, conv.weight, conv.bias, groups=inputs.shape[1])[..., 0]
    write_lines, entries = _conv_writes(ring, kernel, current)
    ring[write_lines, entries] = x.to(ring.dtype)
    return out.to(x.dtype)


def _conv_writes(ring: torch.Tensor, kernel: int, current: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lines, entries)`` int64 ``[N]``: where each token's conv input goes -- its position's entry
    of its line, or the scratch line where a later token of its request takes the same entry (or the
    pool is frozen)."""
    t, pool = current.tokens, current.pool
    entries, at_end = pool.conv_entries(t.positions, ring, kernel)
    # one write per entry: the window's entries repeat every `window` positions, a block end's every
    # `boundaries` blocks
    layout = pool.layout
    repeat = torch.where(at_end, layout.boundaries * layout.block_size,
                         ring.shape[1] - layout.boundaries * (kernel - 1))
    last = t.offsets >= t.lengths - repeat
    return pool.write_lines(t.slots, last), entries


def _conv_window(ring: torch.Tensor, kernel: int, current: Forward) -> tuple[torch.Tensor, ...]:
    """``K.causal_conv_window``'s addressing of the forward's requests (every group's): ``(read_lines,
    read_entries [R, kernel - 1], first_tokens, token_counts, write_lines, write_entries)``, made by
    the forward's first conv, read by the others (``Forward.windows``)."""
    key = ("conv", ring.shape[1], kernel)  # every conv ring of a kernel size has the same entries
    if key not in current.windows:
        lines, firsts, counts, starts = [], [], [], []
        for lo, _, batch in current.tokens.groups:
            cu = batch.cu_query_lens.long()
            lines.append(batch.slot_ids.long())
            firsts.append(lo + cu[:-1])
            counts.append(cu[1:] - cu[:-1])
            starts.append(batch.context_lens.long())
        starts = torch.cat(starts)
        before = starts[:, None] - torch.arange(kernel - 1, 0, -1, device=starts.device)  # oldest first
        read_entries = torch.where(before >= 0, current.pool.conv_entries(before, ring, kernel)[0], -1)
        current.windows[key] = (torch.cat(lines), read_entries, torch.cat(firsts), torch.cat(counts),
                                *_conv_writes(ring, kernel, current))
    return current.windows[key]


def state_scan(step, inputs: tuple[torch.Tensor, ...], ring: torch.Tensor, current: Forward,
               chunked=None, window=None) -> torch.Tensor:
    """A recurrence over each request's tokens in order, one position of every request of a ragged
    group per ``step(state [R, ...], *inputs at that position [R, ...]) -> (out [R, ...], state
    after)``, from the state after the position before each request's first token (``ring`` f32
    ``[lines, entries, ...]``; zero at position 0), writing the state after every token at its
    position's entry (``StatePool.recurrent_entries``). ``inputs``: per-token tensors ``[N, ...]``.
    ``chunked``: optionally a scan of whole sequences for the groups longer than a round (prompt
    chunks; ``_chunked_group``). ``window``: optionally the per-position scan of a whole group in one
    call (``_window_group``; gated DeltaNet on a GPU: ``K.gated_delta_scan``). Returns the outputs
    ``[N, ...]``."""
    n, pool = inputs[0].shape[0], current.pool
    outputs = []  # (token indices, their outputs); index n: padding
    for lo, hi, batch in current.tokens.groups:
        cu, starts, slots = batch.cu_query_lens.long(), batch.context_lens.long(), batch.slot_ids.long()
        counts = cu[1:] - cu[:-1]
        if window is not None and (chunked is None or batch.max_query_len <= pool.window):
            outputs.append(_window_group(window, ring, current, lo, hi, lo + cu[:-1], counts, starts, slots))
            continue
        state = ring[slots, pool.recurrent_entries(starts - 1, ring)]
        state = state * (starts > 0).to(ring.dtype).view(-1, *[1] * (ring.dim() - 2))
        if chunked is not None and batch.max_query_len > pool.window:
            outputs.append(_chunked_group(chunked, state, inputs, ring, pool, lo + cu[:-1], starts, counts, slots,
                                          batch.max_query_len, n))
            continue
        for i in range(batch.max_query_len):
            valid = counts > i
            token = torch.where(valid, lo + cu[:-1] + i, n)
            read = token.clamp(max=n - 1)
            o, state = step(state, *(t[read] for t in inputs))
            # a request past its last token stays past it: its state is written nowhere and its
            # outputs go to the padding index, so it needs no masking (a pass over every state saved)
            state = state.to(ring.dtype)
            outputs.append((token, o))
            ring[pool.write_lines(slots, valid), pool.recurrent_entries(starts + i, ring)] = state
    return _gathered(outputs, n)


def _gathered(outputs: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> torch.Tensor:
    """The ``[N, ...]`` outputs of the forward's ``n`` tokens from ``(token indices, outputs)`` pairs
    (index ``n``: padding, dropped)."""
    first = outputs[0][1]
    out = first.new_zeros((n + 1,) + tuple(first.shape[1:]))
    for token, o in outputs:
        out[token] = o.to(out.dtype)
    return out[:n]


def checkpoint_scan(inputs: tuple[torch.Tensor, ...], states: LayerStates, current: Forward, chunked,
                    scale: float) -> torch.Tensor:
    """The gated delta rule over each request's tokens (``inputs``: ``q, k, v, g, beta`` ``[N, ...]``)
    from its line's checkpoint, under ``StateLayout.checkpoints``: per ragged group one
    ``K.gated_delta_replay_scan`` -- the accepted prefix of the line's last window replayed from its
    kept inputs into the line's other checkpoint slot, then a round-sized group's tokens run and kept
    in the other half; a longer group (prompt chunks) is scanned whole by ``chunked`` (as
    ``_chunked_group``) from that checkpoint, its last state the new checkpoint, nothing kept.
    Returns the outputs ``[N, HV, dv]``."""
    n, pool = inputs[0].shape[0], current.pool
    outputs = []
    for lo, hi, batch in current.tokens.groups:
        whole = batch.max_query_len <= pool.window
        if not whole and chunked is None:
            raise ValueError("gated DeltaNet checkpoints scan prompt chunks whole: hybrid.CHUNKED_PROMPTS must be on")
        replay, counts, tokens_at = _replay_group(current, lo, hi, batch, whole)
        out = K.gated_delta_replay_scan(*inputs, states.recurrent, *states.kept, *replay, scale=scale)
        if whole:
            outputs.append((tokens_at, out[lo:hi]))
            continue
        at = (replay.lines, replay.write_entries)
        token, valid, padded = _padded(inputs, replay.first_tokens, counts, batch.max_query_len, n)
        if pool.layout.snapshots:  # split at the last block end (after the replay's, which it follows)
            starts = batch.context_lens.long()
            out, state, middle, split = _split_at_block_end(chunked, states.recurrent[at], padded, valid, starts,
                                                            counts, pool.layout.block_size)
            states.recurrent[pool.write_lines(replay.lines, split >= 0), BLOCK_END] = middle.to(states.recurrent.dtype)
        else:
            out, state = chunked(states.recurrent[at], *_only(padded, valid))
        states.recurrent[at] = state.to(states.recurrent.dtype)
        outputs.append((token.flatten(), out.flatten(0, 1)))
    return _gathered(outputs, n)


def _replay_group(current: Forward, lo: int, hi: int, batch,
                  whole: bool) -> tuple[K.Replay, torch.Tensor, torch.Tensor]:
    """A ragged group's ``K.gated_delta_replay_scan`` addressing, its requests' token counts and its
    token indices ``lo .. hi - 1``, made by the forward's first gated DeltaNet layer (``Forward.windows``):
    each request from its line's current checkpoint (none at position 0), replaying the tokens of
    its last window before its first position (``StatePool.checkpoint_positions``), writing the
    other slot and, for a round-sized group (``whole``), keeping its tokens in the other half.
    Records the group's commit (``Forward.commit``): the new checkpoints stand at the group's first
    positions (``whole``) or after its last ones."""
    key = ("replay", lo)
    if key not in current.windows:
        pool = current.pool
        cu, starts, lines = batch.cu_query_lens.long(), batch.context_lens.long(), batch.slot_ids.long()
        counts, slot, window = cu[1:] - cu[:-1], pool.checkpoint_slots[lines], pool.window
        # (clamped for the padding requests of the scratch line, whose checkpoints nobody commits to)
        replayed = torch.where(starts > 0, starts - pool.checkpoint_positions[lines], 0).clamp(0, window)
        replay = K.Replay(lines, read_entries=torch.where(starts > 0, slot, -1), replay_entries=slot * window,
                          replay_counts=replayed, write_entries=1 - slot, keep_entries=(1 - slot) * window,
                          first_tokens=lo + cu[:-1], token_counts=counts if whole else torch.zeros_like(counts),
                          **_block_end_snapshots(pool, starts, replayed))
        current.windows[key] = (replay, counts, torch.arange(lo, hi, device=lines.device))
        current.commits.append((lines, starts if whole else starts + counts, 1 - slot))
    return current.windows[key]


def _block_end_snapshots(pool: StatePool, starts: torch.Tensor, replayed: torch.Tensor) -> dict:
    """``K.Replay``'s snapshot fields for requests starting at ``starts`` after replaying ``replayed``
    tokens (int64 ``[R]``), with prefix caching: the state after the last block end among the
    replayed positions into ``BLOCK_END`` (none where they hold no block end, nor while the pool is
    frozen); none without prefix caching."""
    if not pool.layout.snapshots:
        return {}
    passed = starts // pool.layout.block_size * pool.layout.block_size - (starts - replayed)  # through the block end
    if pool.frozen:
        passed = torch.zeros_like(passed)
    return dict(snapshot_counts=torch.where(passed > 0, passed, -1),
                snapshot_entries=torch.full_like(starts, BLOCK_END))


def _window_group(window, ring: torch.Tensor, current: Forward, lo: int, hi: int, firsts: torch.Tensor,
                  counts: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged group's tokens ``lo .. hi - 1`` scanned by ``window(ring, read_lines, read_entries,
    first_tokens, token_counts, write_lines, write_entries) -> out [N, ...]`` (``K.gated_delta_scan``'s
    addressing): each request from its line's state before its first token (none at position 0),
    each token's state written at its own line and position entry. Returns ``(token indices,
    outputs)``."""
    key = (lo, ring.shape[1])  # every stateful layer's ring has the same entries
    if key not in current.windows:
        pool, tokens = current.pool, current.tokens
        read_entries = torch.where(starts > 0, pool.recurrent_entries(starts - 1, ring), -1)
        token_slots = tokens.slots[lo:hi]
        # [N] for the flat tokens; only the group's are read
        write_lines = torch.full((tokens.slots.shape[0],), pool.scratch, dtype=torch.long, device=ring.device)
        write_entries = torch.zeros_like(write_lines)
        write_lines[lo:hi] = pool.write_lines(token_slots, torch.ones_like(token_slots, dtype=torch.bool))
        write_entries[lo:hi] = pool.recurrent_entries(tokens.positions[lo:hi], ring)
        current.windows[key] = (slots, read_entries, firsts, counts, write_lines, write_entries,
                                torch.arange(lo, hi, device=ring.device))
    *addressing, tokens_at = current.windows[key]
    return tokens_at, window(ring, *addressing)[lo:hi]


def _chunked_group(chunked, state: torch.Tensor, inputs: tuple[torch.Tensor, ...], ring: torch.Tensor, pool: StatePool,
                   firsts: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor, length: int,
                   n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged group's requests scanned whole: their tokens padded to ``[R, length, ...]`` with
    zeros (inputs that leave the state as it is: the gated delta rule's zero key, value, beta and
    log-decay; Mamba's zero dt, x, B and C), ``chunked(state [R, ...], *inputs [R, T, ...]) -> (out
    [R, T, ...], state after the last)``. Only the states later forwards and snapshots read are
    written: after each request's last token and, with prefix caching, after the last block end
    among its tokens (the scan is split there: before it, then from it with its state). Returns
    ``(token indices [R * T], outputs [R * T, ...])`` (index ``n``: padding)."""
    token, valid, padded = _padded(inputs, firsts, counts, length, n)
    if pool.layout.boundaries:
        out, state, middle, split = _split_at_block_end(chunked, state, padded, valid, starts, counts,
                                                        pool.layout.block_size)
        ring[pool.write_lines(slots, split >= 0), pool.recurrent_entries(starts + split, ring)] = middle.to(ring.dtype)
    else:
        out, state = chunked(state, *_only(padded, valid))
    ring[pool.write_lines(slots, counts > 0), pool.recurrent_entries(starts + counts - 1, ring)] = state.to(ring.dtype)
    return token.flatten(), out.flatten(0, 1)


def _split_at_block_end(chunked, state: torch.Tensor, padded: list[torch.Tensor], valid: torch.Tensor,
                        starts: torch.Tensor, counts: torch.Tensor, block_size: int):
    """Padded requests (``_padded``) scanned whole by ``chunked`` in two parts, split after the last
    block end among each one's tokens (positions ``starts[r] ..``, ``counts[r]`` of them; blocks of
    ``block_size``). Returns ``(out [R, T, ...], state after the last token, state after that
    block end, split [R])``: ``split[r]`` its index among the request's tokens (< 0: none, the
    second part then the whole)."""
    split = (starts + counts) // block_size * block_size - 1 - starts
    before = torch.arange(valid.shape[1], device=counts.device)[None] <= split[:, None]
    out_before, middle = chunked(state, *_only(padded, before & valid))
    out_after, state = chunked(middle.to(state.dtype), *_only(padded, valid & ~before))
    out = torch.where(before.view(*before.shape, *[1] * (out_before.dim() - 2)), out_before, out_after)
    return out, state, middle, split


def _padded(inputs: tuple[torch.Tensor, ...], firsts: torch.Tensor, counts: torch.Tensor, length: int,
            n: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Each request's tokens ``firsts[r] ..`` (``counts[r]`` of them) padded to ``length``: their
    indices ``[R, length]`` (``n``: padding), which are real (bool ``[R, length]``) and the inputs
    ``[R, length, ...]`` at them (padding: the last token's, for ``_only`` to zero)."""
    steps = torch.arange(length, device=counts.device)
    valid = steps[None] < counts[:, None]
    token = torch.where(valid, firsts[:, None] + steps, n)
    return token, valid, [t[token.clamp(max=n - 1)] for t in inputs]


def _only(padded: list[torch.Tensor], mask: torch.Tensor) -> list[torch.Tensor]:
    """``padded`` inputs ``[R, T, ...]`` where ``mask`` ``[R, T]``, zero elsewhere (inputs that leave
    the state as it is)."""
    return [torch.where(mask.view(*mask.shape, *[1] * (t.dim() - 2)), t, torch.zeros_like(t)) for t in padded]
