"""``Scheduler``: where every request is, and what the next step runs.

A request (``Sequence``) is *waiting* (queued), *prefilling* (a cache slot -- its line of the block
table -- and blocks; its prompt runs in chunks) or *running* (a batch row, ``running[i]`` in row
``i``: each step verifies its drafts or decodes one token). The scheduler admits waiting requests
while rows are free, with the prefix cache's blocks of their prompt; gives every running request
the blocks its next step writes (``reserve_running``), preempting the latest admitted when blocks
run out; picks the step's prompt chunks within the token budget and the free blocks; and frees a
request's row, slot and blocks when it ends (finished, aborted, failed) or is preempted. The rows
stay dense: the requests that leave together leave their rows at once (``_leave_rows``), and the
device-side row state follows through the runner (``move_rows``, ``clear_rows``, the block table).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from .block_manager import BlockManager
from .request import Sequence, SequenceStatus
from .chunks import MAX_CHUNKS, PrefillChunk
from .runner import ModelRunner

__all__ = ["Scheduler"]

log = logging.getLogger("dspark.engine")


class Scheduler:
    """Requests of one engine: ``max_batch`` rows and slots over ``runner``'s KV blocks
    (``blocks``); ``lookahead``: positions a running request writes past its committed tokens in one
    step (its verify window, then the draft block after the new anchor); ``metrics``: the engine's
    counters (waiting / running gauges, preemptions, finished requests, KV blocks, prefix cache)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, max_batch: int, lookahead: int, metrics):
        self.runner, self.blocks, self.max_batch, self.lookahead = runner, blocks, max_batch, lookahead
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted (a cache slot), prompt partly run
        self.running: list[Sequence] = []  # running[i] sits in batch row i
        self.free_slots = list(range(max_batch))
        self.count()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.count()

    # ---- admission and blocks -------------------------------------------------------------------

    def admit(self) -> list[Sequence]:
        """Give waiting requests a cache slot while rows are free, with the prefix cache's blocks of
        their prompt (their prompts then run in chunks from there) and the slot's penalty state (its
        prompt and output so far); returns them."""
        admitted = []
        while self.waiting and self.free_slots and len(self.running) + len(self.prefilling) < self.max_batch:
            seq = self.waiting.popleft()
            seq.slot, seq.status, seq.next_length = self.free_slots.pop(0), SequenceStatus.PREFILLING, self.runner.num_drafts
            seq.admitted_at = seq.admitted_at or time.perf_counter()
            # the last token always runs (its logits draw the next); prompt log-probabilities need every position
            if seq.prompt_logprobs is None or seq.output_ids:
                seq.prefilled = self.blocks.take_cached_prefix(seq.blocks, seq.token_ids(0, seq.prefill_len),
                                                               seq.prefill_len - 1)
                if not seq.output_ids:
                    seq.stats.cached_tokens = seq.prefilled
                if seq.prefilled and self.blocks.snapshots is not None:  # a hybrid target's states there
                    last = len(seq.blocks.block_ids) - 1
                    snapshot = self.blocks.snapshots.slot_of[seq.blocks.block_ids[last]]
                    self.runner.restore_states(seq.slot, last, snapshot)
            self.runner.block_tables.set_line(seq.slot, seq.blocks.block_ids)
            self.runner.penalties.stage(seq.slot, seq.request.sampling, seq.request.prompt_ids, seq.output_ids,
                                        seq.stop_ids)
            if self.runner.cache.states is not None:  # a hybrid target's layers that treat prompt positions apart
                self.runner.cache.states.set_prompt_len(seq.slot, len(seq.request.prompt_ids))
            self.prefilling.append(seq)
            admitted.append(seq)
        self.count()
        return admitted

    def reserve_running(self) -> None:
        """Blocks for every running request's next step (its verify window and draft block),
        oldest request first; the latest admitted are preempted when blocks run out."""
        size, ahead = self.blocks.block_size, self.lookahead
        # most rows hold enough blocks already: only the others are sorted and served (host time per step)
        short = [q for q in self.running
                 if len(q.blocks.block_ids) * size < len(q.request.prompt_ids) + len(q.output_ids) + ahead]
        for seq in sorted(short, key=lambda q: q.admitted_at):
            if seq.status is SequenceStatus.RUNNING:
                self._reserve(seq, seq.num_tokens + self.lookahead)

    def _reserve(self, seq: Sequence, positions: int, preempt: bool = True) -> bool:
        """Blocks for ``positions`` positions of ``seq``'s line; when too few are free (and
        ``preempt``), the latest admitted request is preempted, until they are or ``seq`` itself
        was. Returns whether ``seq`` has them."""
        while (added := self.blocks.reserve(seq.blocks, min(positions, self.runner.line))) is None:
            victims = self.running + self.prefilling
            victim = max(victims, key=lambda q: q.admitted_at) if preempt and victims else None
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        if added:
            self.runner.block_tables.set_line(seq.slot, seq.blocks.block_ids, len(seq.blocks.block_ids) - added)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch (running or prefilling), free its blocks and slot, and queue
        it first to run its tokens again (vLLM's recompute preemption): all but the last, which it
        keeps as its anchor (``PrefillChunk.anchor``), so that its next round is the one it would
        have run."""
        log.info("request %s preempted (KV blocks ran out): %d tokens to run again", seq.request_id, seq.num_tokens)
        self.requeue(seq)
        self.metrics.preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """``preempt`` without counting it: ``seq`` leaves the batch, to run its tokens again first."""
        if seq.status is SequenceStatus.RUNNING:
            self._leave_rows([seq])
            self._cache_output(seq)
        else:
            self.prefilling.remove(seq)
        self._free_slot(seq)
        seq.status, seq.prefilled = SequenceStatus.WAITING, 0
        seq.prefill_len = seq.num_tokens - 1 if seq.output_ids else seq.prompt_len
        self.waiting.appendleft(seq)
        self.count()

    # ---- prompt chunks ---------------------------------------------------------------------------

    def plan_chunks(self, budget: int) -> list[tuple[Sequence, PrefillChunk]]:
        """This step's prompt chunks (at most ``MAX_CHUNKS``), first come first served within
        ``budget`` tokens and the free blocks; a chunk that ends its prompt names the row its
        request takes."""
        plan, row = [], len(self.running)
        for seq in list(self.prefilling):
            if budget <= 0 or len(plan) == MAX_CHUNKS:
                break
            n = self._chunk_tokens(seq, min(self._chunk_end(seq) - seq.prefilled, budget))
            if n == 0:
                break
            ends = seq.prefilled + n == seq.prefill_len
            anchor = seq.output_ids[-1] if ends and seq.output_ids else -1
            plan.append((seq, PrefillChunk(seq.slot, seq.token_ids(seq.prefilled, seq.prefilled + n), seq.prefilled,
                                           row if ends else -1, seq.request.sampling, anchor)))
            row += ends
            budget -= n
        return plan

    @staticmethod
    def _chunk_end(seq: Sequence) -> int:
        """Where ``seq``'s next chunk ends at most: its prompt's end, or for a hybrid target whose
        prompt matched cached blocks past the last one with a state snapshot, the end of the match
        (a chunk's last full block gets a snapshot: the next request with this prefix takes it all)."""
        junction = seq.blocks.matched_tokens
        return junction if seq.prefilled < junction < seq.prefill_len else seq.prefill_len

    def _chunk_tokens(self, seq: Sequence, n: int) -> int:
        """How many of the next ``n`` tokens of ``seq``'s prompt get blocks this step (a chunk that
        ends the prompt also needs the first draft block after it). Only the oldest prefilling
        request preempts others, and only when nothing runs (else running requests free blocks as
        they finish)."""
        remaining = seq.prefill_len - seq.prefilled
        extra = self.lookahead - self.runner.verify_len + 1
        preempt = not self.running and seq is min(self.prefilling, key=lambda q: q.admitted_at)
        if not preempt:
            capacity = (len(seq.blocks.block_ids) + self.blocks.num_free) * self.blocks.block_size - seq.prefilled
            if n + extra * (n == remaining) > capacity:
                n = min(n, capacity, remaining - 1)
            if n <= 0:
                return 0
        ends = n == remaining
        return n if self._reserve(seq, seq.prefilled + n + extra * ends, preempt) else 0

    def ran_chunk(self, seq: Sequence, chunk: PrefillChunk) -> None:
        """``chunk`` of ``seq``'s prompt was launched: its blocks go to the prefix cache (the chunk's
        K/V is queued before any later step that could read it), and a chunk that ends the prompt
        seats the request in its row."""
        seq.prefilled += len(chunk.token_ids)
        self.blocks.cache_committed(seq.blocks, seq.prefilled, seq.token_ids)
        self._snapshot(seq, seq.prefilled, chunk.start)
        if chunk.row >= 0:
            self.prefilling.remove(seq)
            seq.status, seq.row = SequenceStatus.RUNNING, chunk.row
            self.running.append(seq)

    def _cache_output(self, seq: Sequence) -> None:
        """A leaving request's blocks of committed tokens go to the prefix cache: its positions
        before the anchor hold their final K/V in both caches (queued before any reader). Done as it
        leaves rather than every step -- the next turn of a chat comes after it; prompts are cached
        as their chunks run."""
        self.blocks.cache_committed(seq.blocks, seq.num_tokens - 1, seq.token_ids)
        self._snapshot(seq, seq.num_tokens - 1, seq.blocks.cached_tokens)

    def _snapshot(self, seq: Sequence, final: int, ran_from: int) -> None:
        """A hybrid target's states after the last full block of ``seq``'s positions ``< final``
        into a snapshot slot, when its line ran that block's end (at ``ran_from`` or after: the
        states are in its ring's block-end entries, ``model.hybrid``), the block is cached and its
        cached copy has no snapshot yet."""
        index = final // self.blocks.block_size - 1
        if index < 0 or (index + 1) * self.blocks.block_size <= ran_from:
            return
        slot = self.blocks.snapshot_slot(seq.blocks, index)
        if slot is not None:
            self.runner.save_states([(seq.slot, index, slot)])

    # ---- leaving ---------------------------------------------------------------------------------

    def release(self, seqs: list[Sequence]) -> None:
        """End ``seqs`` wherever they are (waiting, prefilling, running): slots, blocks and rows freed
        (a request named twice, once)."""
        running = []
        for seq in {id(seq): seq for seq in seqs}.values():
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.PREFILLING:
                self.prefilling.remove(seq)
                self._free_slot(seq)
            elif seq.status is SequenceStatus.RUNNING:
                running.append(seq)
                continue
            seq.status, seq.row, seq.slot = SequenceStatus.FINISHED, -1, -1
        self.retire(running)

    def retire(self, finished: list[Sequence]) -> None:
        """Free finished requests' rows, slots and blocks."""
        self._leave_rows(finished)
        for seq in finished:
            self._cache_output(seq)
            self._free_slot(seq)
            seq.status = SequenceStatus.FINISHED
            self.metrics.finished += 1
        self.count()

    def _leave_rows(self, seqs: list[Sequence]) -> None:
        """Take running requests out of their batch rows, keeping the rows dense: of n rows, with k
        leaving, the requests staying in the last k move into the rows left among the first n - k
        (one ``move_rows``), and the last k rows become padding."""
        if not seqs:
            return
        n, leaving = len(self.running), {seq.row for seq in seqs}
        kept = n - len(seqs)
        holes = sorted(row for row in leaving if row < kept)
        movers = [seq for seq in self.running[kept:] if seq.row not in leaving]
        self.runner.move_rows([(seq.row, hole) for seq, hole in zip(movers, holes)])
        for seq, hole in zip(movers, holes):
            self.running[hole], seq.row = seq, hole
        del self.running[kept:]
        self.runner.clear_rows(kept, n)
        for seq in seqs:
            seq.row = -1

    def _free_slot(self, seq: Sequence) -> None:
        """Give back ``seq``'s cache slot and its blocks (cached ones stay in the prefix cache)."""
        self.blocks.release(seq.blocks)
        self.runner.block_tables.set_line(seq.slot, [])
        bisect.insort(self.free_slots, seq.slot)
        seq.slot = -1

    def count(self) -> None:
        """The waiting / running gauges (a request prefilling has its slot: it counts as running, as
        vLLM's) and the KV blocks in use."""
        m, blocks = self.metrics, self.blocks
        m.waiting, m.running = len(self.waiting), len(self.running) + len(self.prefilling)
        m.kv_blocks, m.kv_blocks_used = blocks.num_blocks - 1, blocks.num_blocks - 1 - blocks.num_free
        m.prefix_cache_queries, m.prefix_cache_hits = blocks.queries, blocks.hits
