"""The model runner: target and draft forwards, drafting and acceptance for a batch of rows.

The runner owns everything the GPU touches: both paged KV caches (blocks behind one block table, a
line per slot: ``max_batch`` slots plus a dummy line for padding rows, which reads and writes only
the null block), the per-row state (anchor token and position, drafts, their probabilities, proposal
lengths, the captured hidden states of the last verification, seeds), the forwards and the CUDA
graphs (``graphs.CudaGraphs``, which it inherits); what each row sends through the target and keeps
of it is its ``Verifier``, the draft pass its ``DSparkProposer``. Rows ``0 .. n-1`` of a batch bucket
``B`` are the running requests, rows ``n .. B-1`` padding that reads and writes only the dummy line.

One speculative round is two graph replays (``launch_round``) and its readout in two parts::

    verify(B, N)  target forward over each row's [anchor, d_1 .. d_l] (l chosen by the host, ragged:
                  N flat tokens, a multiple of B) -> accept -> advance
    draft(B)      draft context K/V of the verified rows -> draft block -> Markov chain -> confidence
                  -> proposal lengths and confidences of the next round
    readout       accepted tokens and accept lengths to the host as soon as the verify ends (``read``),
                  so that the host commits them while the draft pass runs; the next proposal lengths and
                  confidences after it (``read_proposals``: only a scheduler that picks the next round's
                  verify lengths from them waits for it)

Prompts are run in chunks inside the same step (``PrefillChunk``: extra requests of the ragged
forward, after the running rows' verify or decode tokens, each group with its own attention
launch); a request whose prompt ends in a step takes the next row, gets its first token from the
prompt's last logits and is drafted by that step's draft pass with the others -- nothing is
re-drafted on admission -- or, in a step that does not draft (the cost scheduler's plain rounds),
has only its draft context written, as the others. Steps with chunks replay graphs too (graphs.py).

Plain decoding (no draft) is ``decode(B)``: one target step per row, graphed the same way. A
DSpark runner can run plain rounds too (``launch_round(rows, None, ...)``: the cost scheduler's
choice when no draft is predicted to pay): the target's token per row, the draft context kept up,
the draft pass skipped until a round drafts again. All
randomness is request-stable (``K.request_uniforms``, keyed by the request's seed and the round's
anchor position), so a request's tokens do not depend on its batch. Sampling settings live in
per-row tensors (``RowSampling``: logit bias, temperature, min-p, top-k, top-p -- the request stage
as vLLM samples, applied alike to the target's verify / decode logits and the drafter's
distributions), so a batch of any mix of settings replays the same graphs: one per shape and
``LogitsPath`` -- batches of plain greedy rows only (argmax paths), batches with a row that samples
or biases its logits (every row on the sampled path, a greedy row as the one-hot argmax of its
biased logits, which gives the same tokens), and those with a row whose controls read its tokens so
far (the penalty pass too; steps with prompt chunks have only this sampled variant).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Callable

import torch

from .. import kernels as K
from ..model.hybrid import StateLayout
from ..model.llama import AttentionBatch, TargetLM
from .block_manager import BlockTable
from .chunks import MAX_CHUNKS, ChunkBuffers, PrefillChunk, pads_verify
from .drafting import Drafter
from .graphs import CudaGraphs
from .penalties import PenaltyState
from .proposer import DSparkProposer
from .rows import DraftOverride, LogitsPath, MoveIndices, RowState, TreeSettings
from .step import Proposals, StepPlan, StepResult, readout_columns
from .structured import FREE_MASK, apply_bitmask, bitmask_width
from .verifier import Verifier, sample_rows

__all__ = ["ForwardFailed", "ModelRunner", "state_layout"]


def state_layout(target, verify_len: int, block_size: int, snapshots: int, checkpoints: bool = False) -> dict:
    """The ``states=`` of a target's ``new_cache`` / ``new_paged_cache`` (empty for an attention-only
    target): a hybrid target's cache keeps its stateful layers' states for windows of the verify
    length (and ``snapshots`` snapshot slots of prefix caching over blocks of ``block_size``, 0: none;
    ``checkpoints``: gated DeltaNet checkpoints, ``StateLayout.checkpoints``)."""
    if not getattr(target, "stateful", None):
        return {}
    return {"states": StateLayout.of(verify_len, block_size, snapshots, checkpoints)}


class ForwardFailed(RuntimeError):
    """A step's target forward raised before any row state changed (its KV writes sit at positions
    the next forward rewrites): the step can be retried as it was, or without its chunks."""


class ModelRunner(CudaGraphs):
    """Batched target/draft execution with CUDA graphs per (batch bucket, verify length, ``LogitsPath``)."""

    def __init__(self, target: TargetLM, drafter: Drafter | None, *, max_batch: int, max_model_len: int,
                 max_chunk_tokens: int = 2048, cuda_graphs: bool = True, tree: TreeSettings | None = None,
                 num_kv_blocks: int | None = None, kv_block_size: int = 16, state_snapshots: int = 0,
                 state_checkpoints: bool = False):
        self.target, self.drafter = target, drafter
        self.device = dev = target.device
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.num_drafts = drafter.num_draft_tokens if drafter else 0
        self.tree = tree
        # tokens per row in a verify forward: the chain's anchor and drafts, or the tree's nodes
        self.verify_len = tree.budget if tree is not None else self.num_drafts + 1
        block = drafter.block_size if drafter else 1
        # a round writes past the committed tokens; padding tokens of a ragged verify use the dummy line
        self.line = line = max(max_model_len + self.verify_len + block, max_batch + 1)
        self.dummy_slot = self.scratch_row = max_batch  # the seat of a chunk that ends no prompt
        # paged K/V of the target and the draft, one block table for both (its last line, the dummy
        # line of padding tokens, reads and writes only the null block)
        self.block_tables = BlockTable(max_batch + 1, -(-line // kv_block_size), dev)
        self.kv_block_size = kv_block_size
        self.num_kv_blocks = num_kv_blocks or max_batch * self.block_tables.blocks_per_line + 1
        paged = (self.num_kv_blocks, kv_block_size, self.block_tables.table)
        self.cache = target.new_paged_cache(*paged, **state_layout(target, self.verify_len, kv_block_size,
                                                                    state_snapshots, state_checkpoints))
        self._init_graphs(max_batch, cuda_graphs)
        self.draft_override: DraftOverride | None = None  # benchmarks (dspark.bench.oracle): set before any graph
        self.drafted = True  # whether the last launched step drafted its rows' next round
        # host work between a step's target pass and its draft pass (the engine's, for constrained
        # rows: the drafter's grammar masks after the committed tokens); None: the passes run back to back
        self.between_passes: Callable[[], None] | None = None
        # (verify s, draft s) of the last round without prompt chunks, on a device that runs as it is
        # called (the CPU); None elsewhere (a GPU round is timed only as a whole, at its readout)
        self.round_times: tuple[float, float] | None = None

        i32 = dict(dtype=torch.int32, device=dev)
        b, p, t = max_batch, self.num_drafts, self.verify_len
        r = b + 1  # per-row state has a scratch row after the batch rows: padded seats write there
        self.state = RowState(
            slot_ids=torch.full((r,), self.dummy_slot, **i32), active=torch.zeros(r, **i32),
            anchor=torch.zeros(r, **i32), anchor_pos=torch.zeros(r, **i32), ctx_pos=torch.zeros(r, **i32),
            seeds=torch.zeros(r, dtype=torch.int64, device=dev), temperature=torch.zeros(r, device=dev),
            top_k=torch.zeros(r, **i32), top_p=torch.ones(r, device=dev), min_p=torch.zeros(r, device=dev),
            logit_bias=torch.zeros(r, target.vocab_size, device=dev),
            draft_tokens=torch.zeros(r, max(p, 1), **i32), proposal_lengths=torch.full((r,), max(p, 1), **i32),
            accepted=torch.zeros(r, t, **i32), accept_length=torch.ones(r, **i32),
            grammar_mask=torch.full((r, t, bitmask_width(target.vocab_size)), FREE_MASK, **i32))
        if drafter is not None:
            self.state.verify_lens = torch.ones(r, **i32)
            self.state.confidence = torch.zeros(r, p, device=dev)
            self.state.draft_mask = torch.full((r, block, bitmask_width(target.vocab_size)), FREE_MASK, **i32)
            self.host_lens = torch.ones(b, dtype=torch.int32, pin_memory=dev.type == "cuda")
            if tree is None:  # sampled chain drafting (trees draft greedily); allocated here, as every row
                # buffer: one made inside the engine's inference-mode step could not be written outside it
                self.state.draft_probs = torch.zeros(b, p, target.vocab_size, device=dev)
        if tree is not None:  # the next round's tree of each row (node 0 the root: the anchor)
            size = tree.budget
            self.state.tree_tokens = torch.zeros(r, size, **i32)
            self.state.tree_parents = torch.full((r, size), -1, **i32)
            self.state.tree_depths = torch.zeros(r, size, **i32)
            self.state.tree_bits = (1 << torch.arange(size, device=dev)).repeat(r, 1)  # int64 ancestor masks
            self.state.tree_nodes = torch.ones(r, **i32)
        self.penalties = PenaltyState(max_batch + 1, target.vocab_size, t, dev)  # per slot (the dummy line last)
        self.chunks = ChunkBuffers(max_chunk_tokens, MAX_CHUNKS, dev)
        # accepted | accept length | verified drafts (the target pass's) | next proposal length | next
        # confidences (f32 bits; the draft pass's), sent to pinned host copies as each pass ends
        self.readout = torch.zeros(r, t + 3 + p, **i32)
        self.readout_columns = readout_columns(t, p)
        self.proposer = None if drafter is None else DSparkProposer(
            drafter, self.state, self.penalties, self.readout, self.readout_columns, paged, t, max_model_len, tree,
            target.vocab_size)
        on_cuda = dev.type == "cuda"
        self.host_readouts = [torch.zeros(r, t + 3 + p, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
        self.readout_sent = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._last_sent: torch.cuda.Event | None = None  # the end of the last launched step's device work
        self.offsets = torch.arange(max(t, block), **i32)
        # each row's logits path (the host's copy of which graphs to run)
        self.row_paths = [LogitsPath.GREEDY] * b
        self.move_indices = MoveIndices(b, dev)  # a compaction moves fewer pairs than rows
        # the kernels' scratch, owned here and sized once, so a captured graph's buffers never move
        self.workspace = K.Workspace()
        if dev.type == "cuda":  # the reference backend (CPU) needs no scratch
            self.workspace.reserve(dev, batch=b, proposal_len=max(p, 1), vocab=target.vocab_size,
                                   rank=max(1, drafter.config.markov_rank if drafter is not None else 1), rows=b * t)
        if drafter is not None:
            drafter.workspace = self.workspace
        width = drafter.config.num_capture_layers * drafter.config.hidden_size if drafter is not None else None
        self.verifier = Verifier(self.state, self.penalties, self.readout, self.readout_columns, self.cache,
                                 max_batch=b, verify_len=t, num_drafts=p, tree=tree, dummy_slot=self.dummy_slot,
                                 vocab_size=target.vocab_size, capture_width=width, capture_dtype=target.dtype,
                                 workspace=self.workspace)

    # ---- rows ---------------------------------------------------------------------------------

    def move_rows(self, moves: list[tuple[int, int]]) -> None:
        """Move running requests' rows, ``(source, destination)`` pairs, no row among both (their
        cache slots stay where they are): every per-row tensor in one gather and one scatter, the
        indices sent without a wait (``MoveIndices``); one pair, the most frequent, in one copy per
        tensor (no indices to send). The sources keep their state (``clear_rows``)."""
        if len(moves) == 1:
            (s, d), = moves
            for _, t in self.state.tensors():
                t[d] = t[s]
        elif moves:
            src, dst = self.move_indices.send(moves)
            for _, t in self.state.tensors():
                t.index_copy_(0, dst, t.index_select(0, src))
        for s, d in moves:
            self.row_paths[d] = self.row_paths[s]

    def clear_rows(self, start: int, stop: int) -> None:
        """Turn rows ``start .. stop-1`` into padding: dummy slot, position 0, every token allowed,
        greedy; one op per tensor."""
        s, rows = self.state, slice(start, stop)
        s.slot_ids[rows] = self.dummy_slot
        for t in (s.active, s.anchor, s.anchor_pos, s.ctx_pos):
            t[rows] = 0
        for mask in (s.grammar_mask, s.draft_mask):
            if mask is not None:
                mask[rows] = FREE_MASK
        self.row_paths[rows] = [LogitsPath.GREEDY] * (stop - start)

    # ---- a hybrid target's state snapshots (prefix caching) --------------------------------------

    def save_states(self, snapshots: list[tuple[int, int, int]]) -> None:
        """A hybrid target's states after the last position of a line's block into a snapshot slot,
        per ``(slot, block index in the line, snapshot slot)``; queued behind the forwards that wrote
        them, before any later one (which could overwrite them)."""
        if snapshots:
            self.cache.states.save(*self._snapshot_indices(snapshots))

    def restore_states(self, slot: int, block: int, snapshot: int) -> None:
        """``save_states`` backwards for one line: the states after its block ``block`` from
        ``snapshot``, read by its next tokens (queued before them)."""
        self.cache.states.restore(*self._snapshot_indices([(slot, block, snapshot)]))

    def _snapshot_indices(self, snapshots: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        columns = torch.tensor(snapshots, dtype=torch.int64).T.contiguous()
        return tuple(c.to(self.device) for c in columns)

    # ---- one step -----------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> None:
        """Start ``plan`` on the device without waiting (``read`` / ``read_proposals`` collect it):
        a plain runner decodes, a DSpark runner runs a round (``launch_round``)."""
        if self.drafter is None:
            self.launch_decode(plan.rows, plan.prefill_chunks)
        else:
            self.launch_round(plan.rows, plan.verify_lens, plan.prefill_chunks, plan.draft)

    def launch_round(self, rows: int, verify_lens: list[int] | None, chunks: list[PrefillChunk] = (),
                     draft: bool | Callable[[], bool] = True) -> None:
        """Start one speculative round for the first ``rows`` rows (no wait; ``read`` collects it):
        row i verifies ``verify_lens[i] - 1`` drafts (1 .. P), or, with ``verify_lens`` None, none
        (a plain round: one token per row from the target, as plain decoding); entries past ``rows``
        (up to the bucket) are padding rows' tokens (default 1). ``chunks`` run in the
        same forward, and those that end their prompt join at rows ``rows, rows + 1, ...`` (read
        them too). ``draft``: whether the round drafts the next one (block, Markov chain,
        confidences), or a function called once the target pass is queued that says it; without
        it only the draft context advances (the chunks' too) and the next round is plain.
        ``self.drafted`` says whether this step did."""
        self.round_times, self._draft_choice = None, draft
        self.drafted = draft if isinstance(draft, bool) else None
        self.block_tables.flush()
        self.penalties.flush()
        if verify_lens is None:
            self._launch_plain(rows, chunks)
            return
        b, verify_lens = (self.bucket(rows) if rows else 0), list(verify_lens)
        lens = self.host_lens
        lens.fill_(1)  # padding rows verify their anchor only
        lens[:len(verify_lens)] = torch.tensor(verify_lens, dtype=torch.int32)
        self.state.verify_lens[: self.max_batch].copy_(lens, non_blocking=True)  # pinned: no sync; the last readout freed it
        num_tokens = b * -(-(sum(verify_lens) + b - len(verify_lens)) // b) if b else 0  # a multiple of b: t graphs per b
        if self.tree is not None:
            num_tokens = b * self.verify_len  # every row's tree, padding rows' too
        if chunks:
            self._mixed_step(b, rows, num_tokens, chunks)
            return
        path = self._path(rows)
        self._round(b, path, ("verify", b, num_tokens, path), lambda: self._verify_rows(b, num_tokens, path))

    def _launch_plain(self, rows: int, chunks: list[PrefillChunk]) -> None:
        """A plain round of a DSpark runner: the target's token per row, the anchors' captured
        states kept for the draft context, then the draft pass (full, or the context only)."""
        b = self.bucket(rows) if rows else 0
        if chunks:
            self._mixed_step(b, rows, None, chunks)
            return
        path = self._path(rows)
        self._round(b, path, ("plain", b, path), lambda: self._decode_rows(b, path), plain=True)

    def _round(self, b: int, path: LogitsPath, key: tuple, target_pass: Callable[[], None], plain: bool = False) -> None:
        """A round without prompt chunks: the target's pass (graph ``key``), then the draft pass when
        the round drafts the next one (``self.drafted``), else only the draft context of its verify
        (``plain``: of one token a row); on the CPU, where the device runs as it is called, both
        timed (``round_times``)."""
        start = time.perf_counter()
        self._replay(key, target_pass)
        self._send_readout(0)
        self._between_passes()
        verified = time.perf_counter()
        self._draft_or_context(b, path, plain)
        self._send_readout(1)
        if self.device.type == "cpu":
            self.round_times = (verified - start, time.perf_counter() - verified)

    def _draft_or_context(self, b: int, path: LogitsPath, plain: bool) -> None:
        """After the target pass of rows ``0 .. b-1``: the draft pass where the step drafts
        (``self.drafted``, decided now where it is a choice: the target pass runs on the device
        meanwhile), else only their draft context -- what the draft pass writes first; after a
        plain round (``plain``) only its anchors' (an eighth of the work at 7 drafts)."""
        if self.drafted is None:
            self.drafted = bool(self._draft_choice())
        if self.drafted:
            self._draft(b, path)
        else:
            self._context(b, 1 if plain else self.verify_len)

    def _context(self, b: int, t: int) -> None:
        self._replay(("context", b, t), lambda: self.proposer.context_rows(b, t))

    def _between_passes(self) -> None:
        if self.between_passes is not None and self.drafter is not None:
            self.between_passes()

    def launch_decode(self, rows: int, chunks: list[PrefillChunk] = ()) -> None:
        """Start one plain decoding step for the first ``rows`` rows (no wait; ``read`` collects it),
        with ``chunks`` as ``launch_round``."""
        self.block_tables.flush()
        self.penalties.flush()
        if chunks:
            self._mixed_step(self.bucket(rows) if rows else 0, rows, None, chunks)
            return
        b = self.bucket(rows)
        path = self._path(rows)
        self._replay(("decode", b, 1, path), lambda: self._decode_rows(b, path))
        self._send_readout(0)

    def token_logits(self, flat_rows: list[int]) -> torch.Tensor:
        """The target's f32 logits of the last round at flat rows ``row * verify_len + i`` (verify
        token i of a row; its accepted token i was chosen from them)."""
        return self.verifier.logit_rows[torch.tensor(flat_rows, device=self.device)]

    def read(self, rows: int) -> StepResult:
        """The launched step's target pass for the first ``rows`` rows, once it reached the host (its
        draft pass may still run)."""
        return StepResult.from_readout(self._received(0, rows), self.readout_columns)

    def read_proposals(self, rows: int) -> Proposals:
        """The launched step's draft pass: the next round's proposal lengths and confidences."""
        return Proposals.from_readout(self._received(1, rows), self.readout_columns)

    def _send_readout(self, part: int) -> None:
        """Start the readout's copy to the host after the target pass (``part`` 0) or the draft pass
        (1), in stream order; on the CPU the readout is read where it is."""
        if self.readout_sent is not None:
            self.host_readouts[part].copy_(self.readout, non_blocking=True)
            self.readout_sent[part].record()
            self._last_sent = self.readout_sent[part]

    def device_busy(self) -> bool:
        """Whether the last launched step still runs on the device (its draft pass, which the host
        need not wait for): host work done meanwhile is off the critical path. Never on the CPU."""
        return self._last_sent is not None and not self._last_sent.query()

    def _received(self, part: int, rows: int) -> torch.Tensor:
        """A copy of the first ``rows`` rows of readout ``part`` once it reached the host (the next
        step's copy reuses the pinned buffer)."""
        if self.readout_sent is None:
            return self.readout[:rows].clone()
        self.readout_sent[part].synchronize()
        return self.host_readouts[part][:rows].clone()

    def _path(self, rows: int) -> LogitsPath:
        """The logits path of the first ``rows`` rows: the highest of theirs (``LogitsPath``)."""
        return max(self.row_paths[:rows], default=LogitsPath.GREEDY)

    # ---- device work (captured) -----------------------------------------------------------------

    def _capture_buffer(self, n: int) -> torch.Tensor:
        """Scratch for ``n`` tokens' captured hidden states (the capture layers' inputs)."""
        rows = self.verifier.capture_rows
        return torch.empty(n, rows.shape[1], dtype=rows.dtype, device=self.device)

    def _decode_rows(self, b: int, path: LogitsPath) -> None:
        """One target token per row (plain decoding; a DSpark runner's plain round keeps the anchors'
        captured states, the next draft context)."""
        s = self.state
        capture = self._capture_buffer(b) if self.drafter is not None else None
        logits = self.target.forward(s.anchor[:b].long(), s.anchor_pos[:b], s.slot_ids[:b],
                                     self.verifier.attention_batch(b, 1), self.cache, capture_out=capture)
        self.verifier.decode_commit(b, logits, path, capture)

    def _verify_rows(self, b: int, num_tokens: int, path: LogitsPath) -> None:
        ids, positions, cache_rows, slots, batch, flat = self.verifier.inputs(b, num_tokens)
        capture = self._capture_buffer(num_tokens)
        logits = self.target.forward(ids, positions, slots, batch, self.cache, capture_out=capture,
                                     cache_positions=cache_rows if self.tree else None)
        self.verifier.store(flat, capture, logits)
        del capture, logits  # stored: the acceptance's temporaries take their memory
        self.verifier.commit(b, path)

    def _propose(self, b: int, path: LogitsPath) -> None:
        """The draft pass of rows ``0 .. b-1`` (``DSparkProposer``), a benchmark's override of its
        proposals, and the readout's proposal columns."""
        self.proposer.propose_rows(b, path)
        if self.draft_override is not None:
            self.draft_override.apply(self, b)
        self.proposer.publish(b)

    # ---- steps with prompt chunks -----------------------------------------------------------------

    def _mixed_step(self, b: int, rows: int, num_tokens: int | None, chunks: list[PrefillChunk]) -> None:
        """One forward over the running rows' tokens -- ``num_tokens`` ragged verify tokens of
        bucket ``b`` (None: one decode token per row), exactly as a round without chunks -- and the
        prompt chunks, staged into ``self.chunks`` and padded to a chunk bucket; then accept / sample
        as a round does, write the chunks' draft context, seat the requests whose prompt ended
        (first token, row state) and draft every row (or, where the step does not draft, write
        their draft context only: ``_draft_or_context``). Up to ``GRAPH_CHUNK_TOKENS`` chunk tokens, one
        CUDA graph per (rows bucket, verify tokens, chunk bucket, running rows greedy or ``PENALISED``);
        with more, the running rows' verify is padded to every row's full length (one verify total per
        rows bucket: ``mixed_shapes``). The running rows are verified in the
        mode they were drafted in (a greedy batch's drafts carry no distributions); the seats are
        drawn by their own settings (a greedy seat: temperature 0, its argmax), so a mix of seats
        needs no graph of its own. Raises ``ForwardFailed`` when the forward raised (no row state
        changed yet)."""
        joined = [c for c in chunks if c.row >= 0]
        bucket = self.chunks.stage(chunks, self._chunk_bucket(sum(len(c.token_ids) for c in chunks)),
                                   self.dummy_slot, self.scratch_row)
        path = LogitsPath.PENALISED if self._path(rows).sampled else LogitsPath.GREEDY
        if num_tokens is not None and pads_verify(bucket):
            num_tokens = b * self.verify_len
        self._replay(("mixed", b, num_tokens, bucket, path), lambda: self._mixed_rows(b, num_tokens, bucket, path))
        self._send_readout(0)
        self._between_passes()
        for c in joined:
            self.row_paths[c.row] = LogitsPath.of(c.sampling)
        total = rows + len(joined)
        if self.drafter is not None and total:
            self._draft_or_context(self.bucket(total), self._path(total), plain=num_tokens is None)
            self._send_readout(1)

    def _draft(self, b: int, path: LogitsPath) -> None:
        """The draft pass of the rows in bucket ``b``: tree mode drafts greedily whatever the rows'
        settings (its trees grow from the greedy chain), so one graph."""
        path = path if self.tree is None else LogitsPath.GREEDY
        self._replay(("draft", b, 0, path), lambda: self._propose(b, path))

    def _mixed_rows(self, b: int, num_tokens: int | None, bucket: int, path: LogitsPath) -> None:
        """The device work of a mixed step (captured): forward, commit of the running rows, the
        chunks' draft context, the seats."""
        try:
            positions, slots, flat, split, capture, logits = self._mixed_forward(b, num_tokens, bucket)
        except Exception as exc:  # noqa: BLE001
            raise ForwardFailed(f"{type(exc).__name__}: {exc}") from exc
        if b and num_tokens is not None:
            self.verifier.store(flat, capture[:split], logits[:split])
            logits = logits[split:].clone()  # the seats' rows only: the acceptance's temporaries take the rest
            self.verifier.commit(b, path)
        else:
            if b:
                self.verifier.decode_commit(b, logits[:split], path, None if capture is None else capture[:split])
            logits = logits[split:]
        if self.proposer is not None:
            self.proposer.write_context(capture[split:], positions[split:], slots[split:])
        self._seat(logits)

    def _mixed_forward(self, b: int, num_tokens: int | None, bucket: int):
        """The target forward of a mixed step (no row state changes): ``(positions, token slots,
        verify tokens' flat buffer rows, running tokens, captures or None, logits)`` -- logits of
        every running token, then of each seat's last prompt token (``max_chunks`` of them)."""
        s, ch = self.state, self.chunks
        groups, flat, split, parts = [], None, 0, []
        if b and num_tokens is not None:
            ids, positions, cache_rows, slots, batch, flat = self.verifier.inputs(b, num_tokens, pads_verify(bucket))
            parts.append((ids, positions, slots, cache_rows))
            split = num_tokens
        elif b:
            parts.append((s.anchor[:b].long(), s.anchor_pos[:b], s.slot_ids[:b], s.anchor_pos[:b]))
            batch, split = self.verifier.attention_batch(b, 1), b
        if b:
            groups.append((0, split, batch))
        meta = ch.device_meta()
        groups.append((split, split + bucket, AttentionBatch(meta["request_slots"], meta["request_starts"],
                                                             meta["cu"], bucket)))
        parts.append((ch.ids[:bucket], meta["positions"][:bucket], meta["slots"][:bucket], meta["positions"][:bucket]))
        ids, positions, slots, cache_rows = (torch.cat([p[k] for p in parts]) for k in range(4))
        logit_rows = torch.cat([torch.arange(split, device=self.device), split + ch.seat_last])
        capture = self._capture_buffer(ids.numel()) if self.proposer is not None else None
        logits = self.target.forward(ids, positions, slots, groups, self.cache, capture_out=capture,
                                     logits_rows=logit_rows, cache_positions=cache_rows if self.tree else None)
        return positions, slots, flat, split, capture, logits

    def _seat(self, logits: torch.Tensor) -> None:
        """Rows for requests whose prompt ended (``self.chunks``' seats; padded seats go to the
        scratch row): the first token from the last position's logits ``[max_chunks, V]`` by each
        seat's settings and its slot's penalty state (keyed as a round's draw: seed, position; a greedy
        seat's is the argmax of its processed logits), the token appended to that state, row state (the
        seat's logit bias written into its row first), the readout as a one-token round, the logits
        kept for log-probabilities."""
        s, t, ch = self.state, self.verify_len, self.chunks
        meta = ch.device_meta()
        rows, ends, slots = ch.seat_rows, meta["seat_ends"], meta["seat_slots"]
        ones = torch.ones(ch.max_chunks, dtype=torch.int32, device=self.device)  # a graph cannot copy host scalars
        ch.write_seat_biases(s.logit_bias)
        settings = replace(ch.seat_sampling, logit_bias=s.logit_bias[rows], penalties=self.penalties.rows(slots))
        apply_bitmask(logits, s.grammar_mask[rows, 0])
        drawn = sample_rows(logits, settings, ch.seat_seeds, ends - 1, self.workspace)
        kept = ch.seat_anchors >= 0  # a preempted request's anchor: its slot's state holds it already
        tokens = torch.where(kept, ch.seat_anchors, drawn).to(torch.int32)
        self.penalties.commit(slots, tokens[:, None], (~kept & (rows != self.scratch_row)).to(torch.int32))
        for buffer, value in ((s.slot_ids, slots), (s.active, ones), (s.anchor_pos, ends), (s.ctx_pos, ends),
                              (s.anchor, tokens), (s.seeds, ch.seat_seeds), (s.accept_length, ones),
                              (s.temperature, settings.temperature), (s.top_k, settings.top_k),
                              (s.top_p, settings.top_p), (s.min_p, settings.min_p)):
            buffer[rows] = value
        s.accepted[rows, 0] = tokens
        self.verifier.logit_rows[rows * t] = logits
        self.readout[rows, 0] = tokens
        self.readout[rows, t] = ones
        self.readout[rows, t + 1] = ones - 1

    def probe(self, chunk: PrefillChunk) -> None:
        """Run one prompt chunk alone (the target forward and its draft context writes, no row state):
        after a failed mixed step, whether this request's own tokens fail."""
        self.block_tables.flush()
        bucket = self.chunks.stage([replace(chunk, row=-1)], self._chunk_bucket(len(chunk.token_ids)),
                                   self.dummy_slot, self.scratch_row)
        positions, slots, _, _, capture, _ = self._mixed_forward(0, None, bucket)
        if self.proposer is not None:
            self.proposer.write_context(capture, positions, slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prompt_logits(self, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Every position's f32 logits ``[n, V]`` of prompt tokens ``token_ids`` at positions
        ``start ..`` of cache line ``slot``, by an eager forward of that line alone (outside the
        batched step and its graphs, which keep only a chunk's last logits): what prompt
        log-probabilities are read from. Run before the step that runs these tokens as a chunk, so
        that its K/V writes are the ones that step makes again; a hybrid target's layer states are not
        written (they could reach the state the chunk starts from)."""
        self.block_tables.flush()
        n, i32 = len(token_ids), dict(dtype=torch.int32, device=self.device)
        positions = torch.arange(start, start + n, **i32)
        batch = AttentionBatch(torch.tensor([slot], **i32), torch.tensor([start], **i32), torch.tensor([0, n], **i32),
                               n)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        states = getattr(self.cache, "states", None)
        with states.frozen_writes() if states is not None else contextlib.nullcontext():
            return self.target.forward(ids, positions, torch.full((n,), slot, **i32), batch, self.cache)
