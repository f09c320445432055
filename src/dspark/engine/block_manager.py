"""Paged KV memory: the blocks requests hold, the prefix cache, and the device block table.

A *block* is ``block_size`` consecutive positions of one request's line in both KV caches -- the
target's and the draft's (they share one block table, so a block id names both). ``BlockManager``
owns the block ids on the host: a free list in LRU order, reference counts, and the prefix cache --
a full block of committed tokens is keyed by its tokens and its parent block's key (a chain, as
vLLM's hashed blocks), so a request whose prompt starts with the same tokens takes the same blocks
instead of running them again. A cached block whose last holder finished stays cached until a new
block is needed and it is the least recently freed. Only positions whose K/V are final are ever
cached: a request's committed tokens before its anchor (the last token, not yet run), never drafts.
``BlockTable`` is the device copy the kernels read (``K.cached_attention(block_table=...)``), kept at
one address for the CUDA graphs and updated by a copy of the rows that changed.

A hybrid target's cached block is usable only with its layers' states after its last position
(``model.hybrid``): ``StateSnapshots`` gives such snapshots slots (a bounded pool, least recently
used first out; a snapshot goes with its block when that is evicted), and a prefix found in the cache
is taken up to its last block with a snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["NULL_BLOCK", "BlockManager", "BlockTable", "SequenceBlocks", "StateSnapshots", "blocks_in_memory",
           "WorkingMemory", "kv_blocks_from_memory", "step_blocks", "working_memory"]

# beside the largest step's blocks in the CUDA graphs' pool: the allocator's rounding and the small
# tensors' blocks (``WorkingMemory``)
GRAPH_POOL_SLACK = 1 << 30
# Block 0 is never handed out: unused table entries and the padding line point to it, so a stray
# write lands in a block no request reads.
NULL_BLOCK = 0


@dataclass
class SequenceBlocks:
    """The blocks one request holds: ``block_ids`` in line order; ``keys`` the prefix-cache keys of
    its first ``len(keys)`` blocks (registered, or found in the cache); ``cached_tokens`` the prompt
    tokens its admission took from the cache; ``matched_tokens`` those the cache held (more, for a
    hybrid target, when the blocks after its last snapshot matched too)."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)
    cached_tokens: int = 0
    matched_tokens: int = 0
    next_key_at: int = 0  # the committed positions at which its next block is full (the host's quick test)


class StateSnapshots:
    """``capacity`` slots for a hybrid target's state snapshots (``StatePool``'s), each holding the
    states after a cached block's last position: ``slot_of`` block id -> slot, least recently used
    first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(capacity))

    def take(self, block: int) -> int:
        """A slot for ``block``'s snapshot: a free one, else the least recently used snapshot's."""
        slot = self.free.pop() if self.free else self.slot_of.popitem(last=False)[1]
        self.slot_of[block] = slot
        return slot

    def drop(self, block: int) -> None:
        """Free ``block``'s snapshot, if it has one (its block left the prefix cache)."""
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            self.free.append(slot)

    def touch(self, block: int) -> None:
        self.slot_of.move_to_end(block)


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` positions (block 0 reserved: ``NULL_BLOCK``), with
    prefix caching when ``prefix_caching``; for a hybrid target ``snapshots`` (its blocks' state
    snapshots: a cached prefix is usable up to its last block with one). ``queries`` / ``hits``:
    prompt tokens looked up in the cache and found there usable (vLLM's prefix-cache counters)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 snapshots: StateSnapshots | None = None):
        self.block_size, self.prefix_caching, self.snapshots = block_size, prefix_caching, snapshots
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks
        self.unused = 1  # blocks unused..num_blocks-1 were never handed out (a GPU may hold millions)
        self.free: OrderedDict[int, None] = OrderedDict()  # released blocks, least recently first
        self.cached: dict[tuple, int] = {}
        self.queries = self.hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free(self) -> int:
        """Blocks a request can take now (free ones, cached or not)."""
        return len(self.free) + self.num_blocks - self.unused

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ---- taking and releasing ------------------------------------------------------------------

    def take_cached_prefix(self, seq: SequenceBlocks, token_ids: list[int], limit: int) -> int:
        """Give an empty ``seq`` the cached blocks of the longest prefix of ``token_ids[:limit]``
        (full blocks; with snapshots, up to the last of them that has one); returns how many tokens
        they hold (also ``seq.cached_tokens``; ``seq.matched_tokens``: the matched prefix)."""
        if not self.prefix_caching:
            seq.cached_tokens = seq.matched_tokens = 0
            return 0
        size, parent, matched = self.block_size, None, []
        self.queries += limit
        for start in range(0, limit - size + 1, size):
            key = (parent, tuple(token_ids[start:start + size]))
            block = self.cached.get(key)
            if block is None:
                break
            matched.append((key, block))
            parent = hash(key)
        usable = len(matched)
        if self.snapshots is not None:
            with_snapshot = [i + 1 for i, (_, block) in enumerate(matched) if block in self.snapshots.slot_of]
            usable = with_snapshot[-1] if with_snapshot else 0
            if usable:
                self.snapshots.touch(matched[usable - 1][1])
        for key, block in matched[:usable]:
            self._hold(block)
            seq.block_ids.append(block)
            seq.keys.append(key)
        seq.cached_tokens, seq.matched_tokens = usable * size, len(matched) * size
        seq.next_key_at = seq.cached_tokens + size
        self.hits += seq.cached_tokens
        return seq.cached_tokens

    def snapshot_slot(self, seq: SequenceBlocks, index: int) -> int | None:
        """A snapshot slot for the states after ``seq``'s block ``index`` (registered in the cache),
        held by the block the cache keeps for its key; None when that one has a snapshot already
        (or there are no snapshots)."""
        if self.snapshots is None or index >= len(seq.keys):
            return None
        block = self.cached.get(seq.keys[index])
        if block is None or block in self.snapshots.slot_of:
            return None
        return self.snapshots.take(block)

    def reserve(self, seq: SequenceBlocks, positions: int) -> int | None:
        """Append fresh blocks until ``seq`` covers ``positions`` positions; returns how many it took,
        or None (nothing taken) when too few are free."""
        needed = self.blocks_for(positions) - len(seq.block_ids)
        if needed <= 0:
            return 0
        if needed > self.num_free:
            return None
        seq.block_ids += [self._take_free() for _ in range(needed)]
        return needed

    def release(self, seq: SequenceBlocks) -> None:
        """Drop ``seq``'s blocks; those no other request holds become free, the last ones first to
        go (a prefix shared by many requests stays cached longest)."""
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_ids, seq.keys, seq.next_key_at = [], [], 0

    def cache_committed(self, seq: SequenceBlocks, final: int, token_ids: Callable[[int, int], list[int]]) -> None:
        """Register ``seq``'s full blocks of positions ``< final`` (their K/V final in both caches)
        under the keys of their tokens (``token_ids(start, end)``: its committed tokens there)."""
        if not self.prefix_caching or final < seq.next_key_at:
            return
        size = self.block_size
        for index in range(len(seq.keys), min(final // size, len(seq.block_ids))):
            parent = hash(seq.keys[-1]) if seq.keys else None
            key = (parent, tuple(token_ids(index * size, (index + 1) * size)))
            seq.keys.append(key)
            block = seq.block_ids[index]
            if key not in self.cached:  # the same tokens in another block: that one stays the cached copy
                self.cached[key], self.block_keys[block] = block, key
        seq.next_key_at = (len(seq.keys) + 1) * size

    # ---- internals -------------------------------------------------------------------------------

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _take_free(self) -> int:
        """A never used block, else the least recently freed one, evicted from the prefix cache if it
        was cached."""
        if self.unused < self.num_blocks:
            self.unused += 1
            self.ref_counts[self.unused - 1] = 1
            return self.unused - 1
        block, _ = self.free.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None
            if self.snapshots is not None:
                self.snapshots.drop(block)
        self.ref_counts[block] = 1
        return block


class BlockTable:
    """The device block table int32 ``[lines, blocks_per_line]`` (one line per request slot, plus the
    padding line) and its pinned host copy: ``set_line`` writes the host copy, ``flush`` (before a
    step's launches) copies the rows that changed, in stream order behind the work already queued."""

    def __init__(self, lines: int, blocks_per_line: int, device):
        self.device = device
        self.host = torch.full((lines, blocks_per_line), NULL_BLOCK, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.table = self.host.to(device)
        self.rows = self.host.numpy()  # the pinned rows, written from the host without torch's per-call cost
        self.changed: set[int] = set()
        self._copied: torch.cuda.Event | None = None

    @property
    def blocks_per_line(self) -> int:
        return self.host.shape[1]

    def set_line(self, line: int, block_ids: list[int], start: int = 0) -> None:
        """Line ``line`` reads ``block_ids``: entries ``start ..`` written (the earlier ones stand);
        from ``start`` 0 the rest of the line is the null block."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy read the pinned rows: only then rewrite them
            self._copied = None
        row = self.rows[line]
        if start == 0:
            row[:] = NULL_BLOCK
        row[start:len(block_ids)] = block_ids[start:]
        self.changed.add(line)

    def flush(self) -> None:
        if not self.changed:
            return
        low, high = min(self.changed), max(self.changed) + 1
        on_cuda = self.device.type == "cuda"
        self.table[low:high].copy_(self.host[low:high], non_blocking=on_cuda)
        if on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.changed.clear()


def blocks_in_memory(device, utilization: float, bytes_per_block: int, working_bytes: int) -> int | None:
    """How many KV blocks of ``bytes_per_block`` fit in ``utilization`` of the GPU's memory after
    what is already in use on it (weights, other processes) and ``working_bytes`` for a step's
    activations, logits and CUDA graphs (vLLM's ``gpu_memory_utilization`` rule); None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    budget = utilization * total - (total - free) - working_bytes
    return max(0, int(budget // bytes_per_block))


@dataclass(frozen=True)
class WorkingMemory:
    """Bytes an engine needs on its GPU beside the weights and the KV blocks (``working_memory``),
    each a formula of the shapes: ``max_batch`` B rows verifying ``verify_len`` t tokens each (R =
    B t rows of a verify window), the vocabulary V, the draft block N and its P drafts, ``MAX_CHUNKS``
    M seats of a step with prompt chunks.

    The step's blocks (``step_blocks``) are what the largest step allocates -- a target step with
    prompt chunks on the penalised path: its logits in the target's dtype and their f32 copy
    (L = R + M rows), its activations (the captured shape with the most tokens: every row's verify
    beside a full chunk bucket, ``R + step_tokens``), then the acceptance's probabilities ``4 R V`` (its working
    copy of the window's logits takes the block of the f32 logits, dropped once stored; the penalty
    pass's temporaries are one position's, ``[B, V]``); or the draft pass's block logits, their f32
    copy and the drafts' distributions when those are larger. The caching allocator keeps these as
    separate blocks, so they add up.

    ``graph_pool``: the CUDA graphs' shared pool -- the largest step's blocks (``capture_graphs``
    captures that step first; every later capture fits in what it freed) and ``GRAPH_POOL_SLACK``;
    none without CUDA graphs (``cuda_graphs`` False).
    ``warm_up``: eager memory beside the pool -- a graph's warm-up run before its capture (every
    capture but the first, and any graph captured on first use while serving, runs it while the
    pool holds its blocks), an eager step: the largest step's blocks again, and the warm-up's copies
    of the row state it writes (``CudaGraphs._snapshot``: the bias, the masks, the penalty counts
    ``4 (B + 1) V``).
    ``logit_rows``: the verify's f32 logit rows ``4 (R + 1) V`` (``Verifier.logit_rows``).
    ``draft_probs``: the sampled drafts' f32 distributions ``4 B P V`` (``RowState.draft_probs``; a
    tree's depth rows ``4 B (P + 1) V``).
    ``row_state``: the rows' dense f32 logit bias ``4 (B + 1) V``, their int32 grammar bitmasks
    ``4 (B + 1)(t + N) ceil(V / 32)`` and the captured hidden states ``(R + 1)`` x the capture width.
    ``penalties``: the slots' penalty state ``BYTES_PER_TOKEN (B + 1) V`` (``PenaltyState``).
    ``states``: a hybrid target's layer states."""

    graph_pool: int
    warm_up: int
    logit_rows: int
    draft_probs: int
    row_state: int
    penalties: int
    states: int

    @property
    def total(self) -> int:
        return (self.graph_pool + self.warm_up + self.logit_rows + self.draft_probs + self.row_state + self.penalties
                + self.states)


def step_blocks(*, rows: int, batch: int, vocab: int, seats: int, logits_bytes: int, activations: int,
                draft_rows: int = 0, draft_bytes: int = 0, drafts: int = 0) -> int:
    """Bytes of the blocks the largest step allocates (``WorkingMemory``): a target step of ``rows``
    verify rows (R; ``batch`` B rows) and ``seats`` seats over ``vocab`` V, its logits computed in
    ``logits_bytes`` per entry, ``activations`` bytes of the forward's; or a draft pass of
    ``draft_rows`` block rows (B N) computed in ``draft_bytes`` per entry, with ``drafts`` (P)
    distributions per row, when larger."""
    # the acceptance's probabilities 4 R V, and the penalty pass's [B, V]: the rows' gathered state
    # (5 B V), the repetition factors and their masks (6 B V), one position's masks, products and
    # quotients (9 B V)
    target = _logits(logits_bytes) * (rows + seats) * vocab + activations + 4 * rows * vocab + 20 * batch * vocab
    if not draft_rows:
        return target
    draft = _logits(draft_bytes) * draft_rows * vocab + 4 * batch * drafts * vocab + 20 * batch * vocab
    return max(target, draft)


def _logits(entry_bytes: int) -> int:
    """Bytes per entry of a forward's logits: in the model's dtype, and their f32 copy (``.float()``,
    none for an f32 model)."""
    return entry_bytes + 4 if entry_bytes < 4 else 4


def working_memory(target, draft_model, config, verify_len: int, step_tokens: int, block_size: int = 0,
                   state_snapshots: int = 0) -> WorkingMemory:
    """``WorkingMemory`` of an engine of ``config`` (``max_batch`` rows verifying ``verify_len``
    tokens each beside prompt chunks, ``step_tokens`` tokens a step; ``block_size`` the drafter's
    block, 0 without one)."""
    from ..model.hybrid import StateLayout
    from .chunks import MAX_CHUNKS as seats
    from .penalties import BYTES_PER_TOKEN as penalty_bytes
    from .structured import bitmask_width

    vocab, batch, rows = target.vocab_size, config.max_batch, config.max_batch * verify_len
    lines = batch + 1  # the rows' (and slots') buffers have a scratch row (the padding line) after the batch
    draft_rows = drafts = draft_bytes = draft_probs = capture = 0
    if draft_model is not None:
        cfg, draft_bytes = draft_model.config, _element_size(draft_model.dtype)
        draft_rows, drafts = batch * block_size, cfg.num_draft_tokens
        draft_probs = 4 * vocab * batch * (drafts + 1 if config.draft_top_k > 1 else drafts)
        capture = (rows + 1) * cfg.num_capture_layers * cfg.hidden_size * _element_size(target.dtype)
    step = step_blocks(rows=rows, batch=batch, vocab=vocab, seats=seats, logits_bytes=_element_size(target.dtype),
                       activations=(rows + step_tokens) * target.shape.hidden_size * 64, draft_rows=draft_rows,
                       draft_bytes=draft_bytes, drafts=drafts)
    bias, masks = 4 * lines * vocab, 4 * lines * (verify_len + block_size) * bitmask_width(vocab)
    # a hybrid target's layer states (allocated beside the blocks, a line per slot and the dummy line)
    layout = StateLayout.of(verify_len, config.kv_block_size, state_snapshots, config.gated_delta_checkpoints)
    return WorkingMemory(graph_pool=step + GRAPH_POOL_SLACK if config.cuda_graphs else 0,
                         warm_up=step + bias + masks + 4 * lines * vocab, logit_rows=4 * (rows + 1) * vocab,
                         draft_probs=draft_probs, row_state=bias + masks + capture,
                         penalties=lines * vocab * penalty_bytes,
                         states=target.state_bytes(lines, layout) if hasattr(target, "state_bytes") else 0)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_blocks_from_memory(target, draft_model, config, working: WorkingMemory) -> int | None:
    """The KV blocks ``config.gpu_memory_utilization`` of the GPU holds (target and draft K/V per
    block) after the step's ``working`` memory; None off CUDA, or where there are no K/V (an
    attention-free target, plain decoding): the runner then holds ``max_batch`` full lines, as with
    ``gpu_memory_utilization`` None."""
    from ..model.layers import KVCache

    if config.gpu_memory_utilization is None:
        return None
    per_token = target.kv_bytes_per_token
    if draft_model is None and per_token == 0:
        return None
    if draft_model is not None:
        cfg = draft_model.config
        per_token += KVCache.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                             draft_model.dtype)
    return blocks_in_memory(target.device, config.gpu_memory_utilization, per_token * config.kv_block_size,
                            working.total)
