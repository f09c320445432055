"""The model runner: target and draft forwards, drafting and acceptance for a batch of rows.

The runner owns everything the GPU touches: both KV caches (one line per slot, ``max_batch`` slots
plus a dummy line for padding rows), the per-row state (anchor token and position, drafts, their
probabilities, proposal lengths, the captured hidden states of the last verification, seeds) and
the CUDA graphs. Rows ``0 .. n-1`` of a batch bucket ``B`` are the running requests, rows ``n .. B-1``
padding that reads and writes only the dummy line.

One speculative round is two graph replays (``launch_round``) and one host synchronisation (``read``)::

    verify(B, N)  target forward over each row's [anchor, d_1 .. d_l] (l chosen by the host, ragged:
                  N flat tokens, a multiple of B) -> accept -> advance
    draft(B)      draft context K/V of the verified rows -> draft block -> Markov chain -> confidence
                  -> proposal lengths and confidences of the next round
    readout       accepted tokens, accept lengths, next proposal lengths and confidences to the host
                  (the sync), from which the host picks the next round's verify lengths

Prompts are run in chunks inside the same step (``PrefillChunk``: extra requests of the ragged
forward, after the running rows' verify or decode tokens, each group with its own attention
launch); a request whose prompt ends in a step takes the next row, gets its first token from the
prompt's last logits and is drafted by that step's draft pass with the others -- nothing is
re-drafted on admission. A step with chunks runs eagerly (the Triton kernels; prompt lengths vary),
one without replays the graphs.

Plain decoding (no draft) is ``decode(B)``: one target step per row, graphed the same way. All
randomness is request-stable (``K.request_uniforms``, keyed by the request's seed and the round's
anchor position), so a request's tokens do not depend on its batch. A batch whose rows share one
sampling setting runs its whole round inside the graphs; rows with different settings are grouped
and run eagerly (the same functions, without graphs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Protocol

import torch

from .. import kernels as K
from ..model.draft_runner import DraftRunner
from ..model.llama import AttentionBatch, TargetLM
from .drafting import Drafter, SamplingParams

log = logging.getLogger("dspark.engine")

__all__ = ["ChunkBuffers", "DraftOverride", "ModelRunner", "PrefillChunk", "ForwardFailed", "RowState", "TreeSettings",
           "batch_buckets", "MAX_CHUNKS"]
MAX_CHUNKS = 8  # prompt chunks per step (the static seats of a captured mixed step)


@dataclass
class PrefillChunk:
    """Prompt tokens of an admitted request run in this step: ``token_ids`` at positions ``start ..``
    of cache line ``slot``. ``row`` >= 0 when the chunk ends the prompt: the batch row the request
    takes, its first token drawn from the last position's logits with its sampling settings."""

    slot: int
    token_ids: list[int]
    start: int
    row: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)


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
    draft context resumes), ``seeds``, ``draft_tokens`` / ``proposal_lengths`` (the next round's
    drafts and how many the drafter proposes), ``accepted`` / ``accept_length`` (this round's tokens).
    With a draft: ``capture`` (the last verify's captured hidden states, ``[B, verify_len, width]``),
    ``verify_lens`` (this round's tokens per row), ``confidence``; sampled chain drafting:
    ``draft_probs`` (allocated on first need); tree mode: the next round's tree per row
    (``tree_tokens``, ``tree_parents``, ``tree_depths``, ``tree_bits``: int64 ancestor masks,
    ``tree_nodes``)."""

    slot_ids: torch.Tensor
    active: torch.Tensor
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    ctx_pos: torch.Tensor
    seeds: torch.Tensor
    draft_tokens: torch.Tensor
    proposal_lengths: torch.Tensor
    accepted: torch.Tensor
    accept_length: torch.Tensor
    capture: torch.Tensor | None = None
    verify_lens: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    tree_tokens: torch.Tensor | None = None
    tree_parents: torch.Tensor | None = None
    tree_depths: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    tree_nodes: torch.Tensor | None = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every buffer this runner has."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]


class DraftOverride(Protocol):
    """What a benchmark puts in place of the drafter's proposals (``dspark.bench.oracle``):
    ``apply(runner, b)`` runs after the drafter proposed rows ``0 .. b-1`` (device ops, captured in
    the draft graphs); ``buffers()`` are the device tensors a round writes, restored after a graph's
    warm-up run."""

    def apply(self, runner: "ModelRunner", b: int) -> None: ...

    def buffers(self) -> list[torch.Tensor]: ...


class ForwardFailed(RuntimeError):
    """A step's target forward raised before any row state changed (its KV writes sit at positions
    the next forward rewrites): the step can be retried as it was, or without its chunks."""


def batch_buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: powers of two up to 32, then steps of 16, capped by ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    sizes += list(range(48, max_batch, 16))
    return sizes + [max_batch]


def _mode(sampling: SamplingParams) -> SamplingParams:
    """A row's sampling setting without its seed (the seed lives in a device tensor)."""
    return SamplingParams() if sampling.greedy else replace(sampling, seed=0)


class ModelRunner:
    """Batched target/draft execution with CUDA graphs per (batch bucket, verify length, mode)."""

    def __init__(self, target: TargetLM, drafter: Drafter | None, *, max_batch: int, max_model_len: int,
                 max_chunk_tokens: int = 2048, cuda_graphs: bool = True, tree: TreeSettings | None = None):
        self.target, self.drafter = target, drafter
        self.device = dev = target.device
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.num_drafts = drafter.num_draft_tokens if drafter else 0
        self.tree = tree
        # tokens per row in a verify forward: the chain's anchor and drafts, or the tree's nodes
        self.verify_len = tree.budget if tree is not None else self.num_drafts + 1
        block = drafter.block_size if drafter else 1
        # a round writes past the committed tokens; padding tokens of a ragged verify use the dummy line
        line = max(max_model_len + self.verify_len + block, max_batch + 1)
        self.dummy_slot = self.scratch_row = max_batch  # the seat of a chunk that ends no prompt
        self.line = line
        self.cache = target.new_cache(max_batch + 1, line)
        self.draft = DraftRunner(drafter.model, max_batch + 1, line) if drafter else None
        self.buckets = batch_buckets(max_batch)
        self.use_graphs = cuda_graphs and dev.type == "cuda" and getattr(target, "graphable", True)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.uncapturable: set[tuple] = set()  # keys whose capture failed: eager
        self.pool = None
        self.draft_override: DraftOverride | None = None  # benchmarks (dspark.bench.oracle): set before any graph
        # (verify s, draft s) of the last round without prompt chunks, on a device that runs as it is
        # called (the CPU); None elsewhere (a GPU round is timed only as a whole, at its readout)
        self.round_times: tuple[float, float] | None = None

        i32 = dict(dtype=torch.int32, device=dev)
        b, p, t = max_batch, self.num_drafts, self.verify_len
        r = b + 1  # per-row state has a scratch row after the batch rows: padded seats write there
        self.state = RowState(
            slot_ids=torch.full((r,), self.dummy_slot, **i32), active=torch.zeros(r, **i32),
            anchor=torch.zeros(r, **i32), anchor_pos=torch.zeros(r, **i32), ctx_pos=torch.zeros(r, **i32),
            seeds=torch.zeros(r, dtype=torch.int64, device=dev),
            draft_tokens=torch.zeros(r, max(p, 1), **i32), proposal_lengths=torch.full((r,), max(p, 1), **i32),
            accepted=torch.zeros(r, t, **i32), accept_length=torch.ones(r, **i32))
        # flat [b*t + 1] rows: row*t + i is verify token i of a row (plain decoding: t = 1), the
        # last row takes padding tokens (and the scratch row's seat); read back for log-probabilities
        self.logit_rows = torch.zeros(b * t + 1, target.vocab_size, device=dev)
        if drafter is not None:
            width = drafter.config.num_capture_layers * drafter.config.hidden_size
            self.capture_rows = torch.zeros(b * t + 1, width, dtype=target.dtype, device=dev)
            self.state.capture = self.capture_rows[: b * t].view(b, t, width)
            self.state.verify_lens = torch.ones(r, **i32)
            self.state.confidence = torch.zeros(r, p, device=dev)
            self.host_lens = torch.ones(b, dtype=torch.int32, pin_memory=dev.type == "cuda")
        if tree is not None:  # the next round's tree of each row (node 0 the root: the anchor)
            size = tree.budget
            self.state.tree_tokens = torch.zeros(r, size, **i32)
            self.state.tree_parents = torch.full((r, size), -1, **i32)
            self.state.tree_depths = torch.zeros(r, size, **i32)
            self.state.tree_bits = (1 << torch.arange(size, device=dev)).repeat(r, 1)  # int64 ancestor masks
            self.state.tree_nodes = torch.ones(r, **i32)
            self.stacked = torch.zeros(b, p + 1, target.vocab_size, device=dev)  # the drafter's depth rows
            self.tree_nodes_accepted = torch.full((b, size), -1, **i32)  # the last walk's path
        self.chunks = ChunkBuffers(max_chunk_tokens, MAX_CHUNKS, dev)
        # accepted | accept length | verified drafts | next proposal length | next confidences (f32 bits)
        self.readout = torch.zeros(r, t + 3 + p, **i32)
        self.offsets = torch.arange(max(t, block), **i32)
        self.offsets_rows = torch.arange(b + _pad_requests(b, t), **i32)
        self.flat_offsets = torch.arange(b * t, **i32)
        self.cu = {n: torch.arange(0, (b + 1) * n, n, **i32) for n in range(1, t + 1)}
        self.row_modes: list[SamplingParams | None] = [None] * b
        self._group_cache: dict[tuple, list] = {}  # mixed-setting batches: the row groups of the last composition
        # the kernels' scratch, owned here and sized once, so a captured graph's buffers never move
        self.workspace = K.Workspace()
        if dev.type == "cuda":  # the reference backend (CPU) needs no scratch
            self.workspace.reserve(dev, batch=b, proposal_len=max(p, 1), vocab=target.vocab_size,
                                   rank=max(1, drafter.config.markov_rank if drafter is not None else 1), rows=b * t)
        if drafter is not None:
            drafter.workspace = self.workspace

    # ---- rows ---------------------------------------------------------------------------------

    def _ensure_probabilities(self) -> None:
        """The draft-probability rows of sampled drafting, allocated on first need (outside graphs)."""
        if self.state.draft_probs is None:
            v = self.target.vocab_size
            self.state.draft_probs = torch.zeros(self.max_batch, self.num_drafts, v, device=self.device)
            self.graphs.clear()  # graphs captured before do not write them
            self.pool = None  # their memory pool went with them

    def move_row(self, src: int, dst: int) -> None:
        """Move a running request's row (its cache slot stays where it is)."""
        for _, t in self.state.tensors():
            t[dst] = t[src]
        self.row_modes[dst] = self.row_modes[src]
        self.clear_row(src)

    def clear_row(self, row: int) -> None:
        """Turn ``row`` into padding: dummy slot, position 0."""
        s = self.state
        s.slot_ids[row] = self.dummy_slot
        for t in (s.active, s.anchor, s.anchor_pos, s.ctx_pos):
            t[row] = 0
        self.row_modes[row] = None

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    # ---- one step -----------------------------------------------------------------------------

    def launch_round(self, rows: int, verify_lens: list[int], chunks: list[PrefillChunk] = ()) -> None:
        """Start one speculative round for the first ``rows`` rows (no wait; ``read`` collects it):
        row i verifies ``verify_lens[i] - 1`` drafts (1 .. P); ``chunks`` run in the same forward,
        and those that end their prompt join at rows ``rows, rows + 1, ...`` (read them too)."""
        b, verify_lens = (self.bucket(rows) if rows else 0), list(verify_lens or [])
        lens = self.host_lens
        lens.fill_(1)  # padding rows verify their anchor only
        lens[:rows] = torch.tensor(verify_lens, dtype=torch.int32)
        self.state.verify_lens[: self.max_batch].copy_(lens, non_blocking=True)  # pinned: no sync; the last readout freed it
        num_tokens = b * -(-sum(verify_lens + [1] * (b - rows)) // b) if b else 0  # a multiple of b: t graphs per b
        if self.tree is not None:
            num_tokens = b * self.verify_len  # every row's tree, padding rows' too
        self.round_times = None
        if chunks:
            self._mixed_step(b, rows, num_tokens, chunks)
            return
        mode = self._batch_mode(rows)
        start = time.perf_counter()
        self._replay(("verify", b, num_tokens, mode), lambda: self._verify_rows(b, rows, num_tokens, mode),
                     mode is not None)
        verified = time.perf_counter()
        self._draft(b, rows, mode)
        if self.device.type == "cpu":
            self.round_times = (verified - start, time.perf_counter() - verified)

    def launch_decode(self, rows: int, chunks: list[PrefillChunk] = ()) -> None:
        """Start one plain decoding step for the first ``rows`` rows (no wait; ``read`` collects it),
        with ``chunks`` as ``launch_round``."""
        if chunks:
            self._mixed_step(self.bucket(rows) if rows else 0, rows, None, chunks)
            return
        b = self.bucket(rows)
        mode = self._batch_mode(rows)
        self._replay(("decode", b, 1, mode), lambda: self._decode_rows(b, rows, mode), mode is not None)

    def token_logits(self, flat_rows: list[int]) -> torch.Tensor:
        """The target's f32 logits of the last round at flat rows ``row * verify_len + i`` (verify
        token i of a row; its accepted token i was chosen from them)."""
        return self.logit_rows[torch.tensor(flat_rows, device=self.device)]

    def read(self, rows: int) -> torch.Tensor:
        """The launched round's readout ``[rows, P + 4 + P]`` on the host (see ``readout``): its one
        host synchronisation."""
        return self.readout[:rows].cpu()

    def capture_graphs(self) -> int:
        """Capture the greedy graphs of every batch bucket now (verify at every token multiple, draft;
        or decode), so that no request waits for a capture later; returns the number of graphs.
        Call with no request running: the captures replay once on padding rows."""
        if not self.use_graphs:
            return 0
        greedy, lens = SamplingParams(), self.host_lens if self.drafter is not None else None
        for b in self.buckets:
            if self.drafter is None:
                self._replay(("decode", b, 1, greedy), lambda: self._decode_rows(b, b, greedy))
                continue
            for k in ([self.verify_len] if self.tree else range(1, self.verify_len + 1)):  # b * k flat tokens
                lens.fill_(k)
                self.state.verify_lens[: self.max_batch].copy_(lens)
                self._replay(("verify", b, b * k, greedy), lambda: self._verify_rows(b, b, b * k, greedy))
            self._replay(("draft", b, 0, greedy), lambda: self._draft_rows(b, b, greedy))
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _batch_mode(self, rows: int) -> SamplingParams | None:
        """The rows' shared sampling setting (greedy for no rows), or None when they differ (grouped, eager)."""
        modes = set(self.row_modes[:rows])
        return modes.pop() if len(modes) == 1 else SamplingParams() if not modes else None

    def _groups(self, b: int, rows: int, mode: SamplingParams | None):
        """(row index or slice, sampling) pairs covering rows ``0 .. b-1``; padding rows go greedy."""
        if mode is not None:
            return [(slice(0, b), mode)]
        key = (b, tuple(self.row_modes[:rows]))
        if key not in self._group_cache:  # uploaded once per batch composition (an H2D copy syncs)
            by_mode: dict[SamplingParams, list[int]] = {}
            for row in range(b):
                by_mode.setdefault(self.row_modes[row] if row < rows else SamplingParams(), []).append(row)
            self._group_cache = {key: [(torch.tensor(idx, device=self.device), m) for m, idx in by_mode.items()]}
        return self._group_cache[key]

    def _replay(self, key: tuple, fn: Callable[[], None], graphed: bool = True) -> None:
        """Replay the graph of ``key`` (captured on first use), or run ``fn`` eagerly when graphs are
        off or not ``graphed`` (rows of several sampling settings)."""
        if not self.use_graphs or not graphed or key in self.uncapturable:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            restore = self._snapshot()
            fn()  # warm-up: compiles kernels and sizes their scratch; its writes are undone below
            torch.cuda.synchronize(self.device)
            restore()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    fn()
            except Exception:  # noqa: BLE001 -- a capture records, it runs nothing: run it eagerly from now on
                log.warning("the CUDA graph %s could not be captured; it runs eagerly", key, exc_info=True)
                self.uncapturable.add(key)
                fn()
                return
            self.pool = graph.pool()
            self.graphs[key] = graph
        graph.replay()

    def _snapshot(self) -> Callable[[], None]:
        """Copies of the row state a step writes (and the draft override's buffers), and a
        function that puts them back: a graph's warm-up run must leave no trace. The captured
        hidden states and draft probabilities are excluded: every step rewrites the rows it reads."""
        live = [t for name, t in self.state.tensors() if name not in ("capture", "draft_probs")]
        if self.draft_override is not None:
            live += self.draft_override.buffers()
        saved = [t.clone() for t in live]

        def restore() -> None:
            for t, value in zip(live, saved):
                t.copy_(value)

        return restore

    # ---- device work (captured) -----------------------------------------------------------------

    def _attention_batch(self, b: int, query_len: int) -> AttentionBatch:
        s = self.state
        return AttentionBatch(s.slot_ids[:b], s.anchor_pos[:b], self.cu[query_len][: b + 1], query_len)

    def _decode_rows(self, b: int, rows: int, mode) -> None:
        s = self.state
        logits = self.target.forward(s.anchor[:b].long(), s.anchor_pos[:b], s.slot_ids[:b],
                                     self._attention_batch(b, 1), self.cache)
        self._decode_commit(b, rows, logits, mode)

    def _decode_commit(self, b: int, rows: int, logits, mode) -> None:
        s = self.state
        self.logit_rows[:b].copy_(logits)
        for index, sampling in self._groups(b, rows, mode):
            token = _sample_rows(logits[index], sampling, s.seeds[index], s.anchor_pos[index], self.workspace)
            s.accepted[index, 0] = token
        s.accept_length[:b] = 1
        self._advance(b, 1)

    def _verify_layout(self, b: int, num_tokens: int):
        """Flat layout of a ragged verify: request of each token (rows ``0 .. b-1``, then the padding
        requests on the dummy line), its index in the request, and its row in the flat capture /
        logit buffers; the requests' token offsets ``cu``."""
        s, t = self.state, self.verify_len
        n = b + _pad_requests(b, t)
        pad = num_tokens - s.verify_lens[:b].sum()
        pad_counts = (pad - t * self.offsets_rows[: n - b]).clamp(0, t)
        counts = torch.cat([s.verify_lens[:b], pad_counts])
        cu = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        cu[1:] = counts.cumsum(0)
        token_row = torch.repeat_interleave(self.offsets_rows[:n], counts, output_size=num_tokens)
        index = self.flat_offsets[:num_tokens] - cu[token_row]
        flat = torch.where(token_row < b, token_row * t + index, self.max_batch * t).long()
        return token_row, index, flat, cu

    def _verify_rows(self, b: int, rows: int, num_tokens: int, mode) -> None:
        ids, positions, cache_rows, slots, batch, flat = self._verify_inputs(b, num_tokens)
        capture = torch.empty(num_tokens, self.capture_rows.shape[1], dtype=self.capture_rows.dtype, device=self.device)
        logits = self.target.forward(ids, positions, slots, batch, self.cache, capture_out=capture,
                                     cache_positions=cache_rows if self.tree else None)
        self._verify_commit(b, rows, flat, capture, logits, mode)

    def _verify_inputs(self, b: int, num_tokens: int):
        """Token ids, positions, cache rows (the positions, except for tree nodes) and cache lines of
        a verify's ``num_tokens`` flat tokens, its ``AttentionBatch`` and each token's row in the flat
        capture / logit buffers."""
        if self.tree is not None:
            return self._tree_inputs(b)
        s, t, p = self.state, self.verify_len, self.num_drafts
        token_row, index, flat, cu = self._verify_layout(b, num_tokens)
        pads = torch.zeros(_pad_requests(b, t), dtype=torch.int32, device=self.device)
        slots = torch.cat([s.slot_ids[:b], pads + self.dummy_slot])
        starts = torch.cat([s.anchor_pos[:b], pads])
        tokens = torch.cat([K.build_verify_tokens(s.anchor[:b], s.draft_tokens[:b], p),
                            pads[:, None].expand(-1, t)])
        ids = tokens[token_row, index]
        positions = starts[token_row] + index
        return ids.long(), positions, positions, slots[token_row], AttentionBatch(slots, starts, cu, t), flat

    def _tree_inputs(self, b: int):
        """``_verify_inputs`` of tree rows: every row's ``budget`` nodes, RoPE at anchor position +
        depth, K/V at anchor position + node index, each node seeing its ancestors."""
        s, size = self.state, self.verify_len
        base = s.anchor_pos[:b, None]
        positions = (base + s.tree_depths[:b]).reshape(-1)
        cache_rows = (base + self.offsets[:size]).reshape(-1)
        batch = AttentionBatch(s.slot_ids[:b], s.anchor_pos[:b], self.cu[size][: b + 1], size,
                               tree_mask=s.tree_bits[:b].reshape(-1))
        return (s.tree_tokens[:b].reshape(-1).long(), positions, cache_rows, s.slot_ids[:b].repeat_interleave(size),
                batch, self.flat_offsets[: b * size].long())

    def _verify_commit(self, b: int, rows: int, flat, capture, logits, mode) -> None:
        """Accept each row's prefix from the verify forward's captures and logits and advance."""
        s, t = self.state, self.verify_len
        self.capture_rows.index_copy_(0, flat, capture)
        self.logit_rows.index_copy_(0, flat, logits)
        if self.tree is not None:
            self._tree_commit(b, rows, mode)
            return
        verified = s.verify_lens[:b] - 1
        padded = self.logit_rows[: b * t].view(b, t, -1)
        for rows_of, sampling in self._groups(b, rows, mode):
            accepted, n = self._accept(padded[rows_of], rows_of, verified[rows_of], sampling)
            s.accepted[rows_of] = accepted
            s.accept_length[rows_of] = n
        self.readout[:b, t + 1] = verified
        self._advance(b, t)

    def _tree_commit(self, b: int, rows: int, mode) -> None:
        """Tree acceptance -- greedy (the longest root path the target's argmax follows) or sampled
        (``K.sampled_tree_accept``: lossless, keyed by seed and anchor position) by each row's
        setting -- then the accepted path's K/V, captures and logits moved to consecutive
        positions, and advance."""
        s, size, p = self.state, self.verify_len, self.num_drafts
        logits = self.logit_rows[: b * size].view(b, size, -1)
        for index, sampling in self._groups(b, rows, mode):
            tree = K.TreeBatch(s.tree_tokens[index], s.tree_parents[index], s.tree_depths[index], None, None,
                               s.tree_nodes[index], None, None)
            if sampling.greedy:
                accepted, nodes, n = K.greedy_tree_accept(logits[index], tree, max_depth=p)
            else:
                count = tree.tokens.shape[0]
                probs = sampling.probabilities(logits[index].reshape(count * size, -1), self.workspace)
                uniforms = K.request_uniforms(s.seeds[index], s.anchor_pos[index], K.PURPOSE_TREE,
                                              (p + 1) * (self.tree.top_k + 1)).view(count, p + 1, self.tree.top_k + 1)
                accepted, nodes, n = K.sampled_tree_accept(probs.view(count, size, -1), tree, uniforms, max_depth=p)
            s.accepted[index] = accepted
            s.accept_length[index] = n
            self.tree_nodes_accepted[index] = nodes
        nodes = self.tree_nodes_accepted[:b]
        # path position i (0: the root) holds node index[:, i] (i <= P); fixed shapes, so a graph holds it
        width = min(size, p + 1)
        keep = self.offsets[:width].long()
        index = keep.repeat(b, 1)
        index[:, 1:] = torch.where(nodes[:, :width - 1] >= 0, nodes[:, :width - 1].long(), index[:, 1:])
        slots = s.slot_ids[:b, None].expand(b, width).reshape(-1).long()
        base = s.anchor_pos[:b, None].long()
        src, dst = (base + index).reshape(-1), (base + keep).reshape(-1)
        for cache in (self.cache.k, self.cache.v):
            cache[:, slots, dst] = cache[:, slots, src]
        for rows in (self.capture_rows, self.logit_rows):
            view = rows[: b * size].view(b, size, -1)
            view[:, :width] = view.gather(1, index[..., None].expand(-1, -1, view.shape[-1]))
        self.readout[:b, size + 1] = s.tree_nodes[:b] - 1
        self._advance(b, size)

    def _accept(self, logits, index, verified, sampling: SamplingParams):
        """Accept rows ``index`` from their target logits ``[R, P+1, V]``, verifying ``verified``
        drafts each (rows past a row's length are never read)."""
        s, p = self.state, self.num_drafts
        drafts = s.draft_tokens[index]
        if sampling.greedy:
            return K.greedy_accept(logits, drafts, verified, p, workspace=self.workspace)
        seeds, anchor_pos = s.seeds[index], s.anchor_pos[index]
        uniforms = torch.empty(seeds.shape[0], 2 * p + 1, device=self.device)
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_ACCEPT, p, out=uniforms[:, :p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_RESIDUAL, p, out=uniforms[:, p:2 * p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_BONUS, 1, out=uniforms[:, 2 * p:])
        probs = sampling.probabilities(logits.reshape(-1, logits.shape[-1]), self.workspace).view(logits.shape)
        return K.probabilistic_accept(probs, s.draft_probs[index], drafts, verified, uniforms, p,
                                      workspace=self.workspace)

    def _advance(self, b: int, verify_len: int) -> None:
        """Commit the accepted prefix on the device: the caches' lengths are the anchor positions."""
        s = self.state
        n = s.accept_length[:b]
        self.readout[:b, :verify_len] = s.accepted[:b, :verify_len]
        self.readout[:b, self.verify_len] = n
        s.ctx_pos[:b] = s.anchor_pos[:b]
        s.anchor[:b] = s.accepted[:b].gather(1, (n - 1).long()[:, None]).squeeze(1)
        s.anchor_pos[:b] += n * s.active[:b]  # padding rows stay at position 0

    def _draft_rows(self, b: int, rows: int, mode) -> None:
        s, t, p = self.state, self.verify_len, self.num_drafts
        positions = (s.ctx_pos[:b, None] + self.offsets[:t]).view(-1)
        self.draft.context(s.capture[:b].reshape(b * t, -1), positions, s.slot_ids[:b].repeat_interleave(t))
        hidden = self.draft.block(s.anchor[:b], s.anchor_pos[:b], s.slot_ids[:b])
        logits = self.drafter.model.backbone_logits(hidden)
        n = self.drafter.block_size
        # a tree grows from the greedy chain's depth rows whatever the rows' settings
        groups = [(slice(0, b), SamplingParams())] if self.tree is not None else self._groups(b, rows, mode)
        for index, sampling in groups:
            rows_of = (lambda x: x.view(b, n, -1)[index].reshape(-1, x.shape[-1]))
            uniforms = None
            if not sampling.greedy:
                uniforms = K.request_uniforms(s.seeds[index], s.anchor_pos[index], K.PURPOSE_PROPOSAL, p)
            stacked = self.stacked[:b] if self.tree is not None else None  # one group
            proposal = self.drafter.propose_rows(rows_of(hidden), rows_of(logits), s.anchor[index], sampling, uniforms,
                                                 stacked)
            s.draft_tokens[index] = proposal.token_ids
            s.proposal_lengths[index] = proposal.proposal_lengths
            if proposal.confidence is not None:
                s.confidence[index] = proposal.confidence
            if proposal.probabilities is not None:
                s.draft_probs[index] = proposal.probabilities
        if self.draft_override is not None:
            self.draft_override.apply(self, b)
        if self.tree is not None:
            self._grow_trees(b)
        self.readout[:b, t + 2] = s.proposal_lengths[:b]
        self.readout[:b, t + 3:] = s.confidence[:b].view(torch.int32)

    def _grow_trees(self, b: int) -> None:
        """Each row's next tree from the drafter's depth rows and confidences (kernels.md 4.4), no
        deeper than the context limit allows (RoPE positions stay below ``max_model_len``)."""
        s, tree = self.state, self.tree
        confidence = s.confidence[:b] if self.drafter.scheduler != "off" else None
        room = (self.max_model_len - 1 - s.anchor_pos[:b]).clamp(min=1)
        built = K.ddtree_build(self.stacked[:b], s.anchor[:b], s.anchor_pos[:b], candidate_top_k=tree.top_k,
                               verify_size=tree.budget, depth_confidence=confidence,
                               survival_threshold=tree.threshold, max_depths=room)
        s.tree_tokens[:b], s.tree_parents[:b], s.tree_depths[:b] = built.tokens, built.parents, built.depths
        s.tree_nodes[:b] = built.num_nodes
        s.tree_bits[:b] = built.ancestor_bits

    # ---- steps with prompt chunks -----------------------------------------------------------------

    def _mixed_step(self, b: int, rows: int, num_tokens: int | None, chunks: list[PrefillChunk]) -> None:
        """One forward over the running rows' tokens -- ``num_tokens`` ragged verify tokens of
        bucket ``b`` (None: one decode token per row), exactly as a round without chunks -- and the
        prompt chunks, staged into ``self.chunks`` and padded to a chunk bucket; then accept / sample
        as a round does, write the chunks' draft context, seat the requests whose prompt ended
        (first token, row state) and draft every row. One CUDA graph per (rows bucket, verify
        tokens, chunk bucket, sampling) when the rows share one setting and so do the seated
        requests, else the same functions eagerly. Raises ``ForwardFailed`` when the forward raised
        (no row state changed yet)."""
        if self.drafter is not None and self.tree is None and any(not c.sampling.greedy for c in chunks):
            self._ensure_probabilities()  # sampled chain drafts keep the distributions they came from
        joined = [c for c in chunks if c.row >= 0]
        bucket = self.chunks.stage(chunks, self._chunk_bucket(sum(len(c.token_ids) for c in chunks)),
                                   self.dummy_slot, self.scratch_row)
        mode, seats = self._batch_mode(rows), self._seat_groups(joined)
        key = ("mixed", b, num_tokens, bucket, mode, seats[0][1] if isinstance(seats[0][0], slice) else None)
        self._replay(key, lambda: self._mixed_rows(b, rows, num_tokens, bucket, mode, seats),
                     graphed=None not in key[-2:])
        for c in joined:
            self.row_modes[c.row] = _mode(c.sampling)
        total = rows + len(joined)
        if self.drafter is not None and total:
            self._draft(self.bucket(total), total, self._batch_mode(total))

    def _draft(self, b: int, rows: int, mode) -> None:
        """The draft pass of ``rows`` rows in bucket ``b``: one graph per setting; tree mode drafts
        greedily whatever the rows' settings (its trees grow from the greedy chain), so one graph."""
        if self.tree is not None:
            mode = SamplingParams()
        self._replay(("draft", b, 0, mode), lambda: self._draft_rows(b, rows, mode), mode is not None)

    def _chunk_bucket(self, n: int) -> int:
        """Padded chunk tokens of a step: a power of two >= 16 (one graph per bucket), within the
        step's chunk capacity, with at most a cache line of padding (the padding request's tokens)."""
        return min(max(16, 1 << max(n - 1, 0).bit_length()), self.chunks.capacity, n + self.line)

    def _seat_groups(self, joined: list[PrefillChunk]) -> list:
        """(seat index or slice, sampling) pairs of the first-token draws: every seat at once when
        the seated requests share one setting (padded seats draw with it too, into the scratch row)."""
        modes = [_mode(c.sampling) for c in joined]
        if len(set(modes)) <= 1:
            return [(slice(0, self.chunks.max_chunks), modes[0] if modes else SamplingParams())]
        groups: dict[SamplingParams, list[int]] = {}
        for i, m in enumerate(modes):
            groups.setdefault(m, []).append(i)
        return [(torch.tensor(idx, device=self.device), m) for m, idx in groups.items()]

    def _mixed_rows(self, b: int, rows: int, num_tokens: int | None, bucket: int, mode, seats) -> None:
        """The device work of a mixed step (captured): forward, commit of the running rows, the
        chunks' draft context, the seats."""
        try:
            positions, slots, flat, split, capture, logits = self._mixed_forward(b, num_tokens, bucket)
        except Exception as exc:  # noqa: BLE001
            raise ForwardFailed(f"{type(exc).__name__}: {exc}") from exc
        if b and num_tokens is not None:
            self._verify_commit(b, rows, flat, capture[:split], logits[:split], mode)
        elif b:
            self._decode_commit(b, rows, logits[:split], mode)
        if self.draft is not None:
            self.draft.context(capture[split:], positions[split:], slots[split:])
        self._seat(logits[split:], seats)

    def _mixed_forward(self, b: int, num_tokens: int | None, bucket: int):
        """The target forward of a mixed step (no row state changes): ``(positions, token slots,
        verify tokens' flat buffer rows, running tokens, captures or None, logits)`` -- logits of
        every running token, then of each seat's last prompt token (``max_chunks`` of them)."""
        s, ch = self.state, self.chunks
        groups, flat, split, parts = [], None, 0, []
        if b and num_tokens is not None:
            ids, positions, cache_rows, slots, batch, flat = self._verify_inputs(b, num_tokens)
            parts.append((ids, positions, slots, cache_rows))
            split = num_tokens
        elif b:
            parts.append((s.anchor[:b].long(), s.anchor_pos[:b], s.slot_ids[:b], s.anchor_pos[:b]))
            batch, split = self._attention_batch(b, 1), b
        if b:
            groups.append((0, split, batch))
        meta = ch.device_meta()
        groups.append((split, split + bucket, AttentionBatch(meta["request_slots"], meta["request_starts"],
                                                             meta["cu"], bucket)))
        parts.append((ch.ids[:bucket], meta["positions"][:bucket], meta["slots"][:bucket], meta["positions"][:bucket]))
        ids, positions, slots, cache_rows = (torch.cat([p[k] for p in parts]) for k in range(4))
        logit_rows = torch.cat([torch.arange(split, device=self.device), split + ch.seat_last])
        capture = None
        if self.draft is not None:
            capture = torch.empty(ids.numel(), self.capture_rows.shape[1], dtype=self.capture_rows.dtype,
                                  device=self.device)
        logits = self.target.forward(ids, positions, slots, groups, self.cache, capture_out=capture,
                                     logits_rows=logit_rows, cache_positions=cache_rows if self.tree else None)
        return positions, slots, flat, split, capture, logits

    def _seat(self, logits: torch.Tensor, seats) -> None:
        """Rows for requests whose prompt ended (``self.chunks``' seats; padded seats go to the
        scratch row): the first token from the last position's logits ``[max_chunks, V]`` (keyed as
        a round's draw: seed, position), row state, the readout as a one-token round, the logits
        kept for log-probabilities."""
        s, t, ch = self.state, self.verify_len, self.chunks
        meta = ch.device_meta()
        rows, ends, slots = ch.seat_rows, meta["seat_ends"], meta["seat_slots"]
        tokens = torch.zeros(ch.max_chunks, dtype=torch.int32, device=self.device)
        ones = torch.ones_like(tokens)  # device constants: a captured graph cannot copy host scalars
        for index, mode in seats:
            tokens[index] = _sample_rows(logits[index], mode, ch.seat_seeds[index], ends[index] - 1, self.workspace)
        for buffer, value in ((s.slot_ids, slots), (s.active, ones), (s.anchor_pos, ends), (s.ctx_pos, ends),
                              (s.anchor, tokens), (s.seeds, ch.seat_seeds), (s.accept_length, ones)):
            buffer[rows] = value
        s.accepted[rows, 0] = tokens
        self.logit_rows[rows * t] = logits
        self.readout[rows, 0] = tokens
        self.readout[rows, t] = ones
        self.readout[rows, t + 1] = ones - 1

    def probe(self, chunk: PrefillChunk) -> None:
        """Run one prompt chunk alone (the target forward and its draft context writes, no row state):
        after a failed mixed step, whether this request's own tokens fail."""
        bucket = self.chunks.stage([replace(chunk, row=-1)], self._chunk_bucket(len(chunk.token_ids)),
                                   self.dummy_slot, self.scratch_row)
        positions, slots, _, _, capture, _ = self._mixed_forward(0, None, bucket)
        if self.draft is not None:
            self.draft.context(capture, positions, slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

class ChunkBuffers:
    """The prompt chunks of one step, staged on the host (pinned) and copied to the device in one
    transfer, at fixed addresses so that a captured mixed step reads any step's chunks.

    Up to ``max_chunks`` chunks of ``capacity`` tokens in all, padded to the step's chunk bucket
    by one padding request on the dummy line; per chunk its request (slot, first position, token
    offsets ``cu``); per seat (a chunk that ends its prompt) its row, the offset of its last token,
    the prompt length, seed and slot -- unused seats name the scratch row.
    """

    def __init__(self, capacity: int, max_chunks: int, device):
        self.capacity, self.max_chunks, self.device = capacity, max_chunks, device
        m = max_chunks
        self.sizes = {"positions": capacity, "slots": capacity, "request_slots": m + 1, "request_starts": m + 1,
                      "cu": m + 2, "seat_ends": m, "seat_slots": m}
        width = sum(self.sizes.values())
        pinned = device.type == "cuda"
        # int64 ids, seats' rows / last offsets / seeds; int32 metadata the kernels read
        self.host64 = torch.zeros(capacity + 3 * m, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(width, dtype=torch.int32, pin_memory=pinned)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.ids = self.dev64[:capacity]
        self.seat_rows, self.seat_last = self.dev64[capacity:capacity + m], self.dev64[capacity + m:capacity + 2 * m]
        self.seat_seeds = self.dev64[capacity + 2 * m:]
        self._meta = self._views(self.dev32)
        self._copied = None  # the event of the last transfer: the pinned rows are reused after it

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, at = {}, 0
        for name, size in self.sizes.items():
            views[name], at = flat[at:at + size], at + size
        return views

    def device_meta(self) -> dict[str, torch.Tensor]:
        return self._meta

    def stage(self, chunks: list[PrefillChunk], bucket: int, dummy_slot: int, scratch_row: int) -> int:
        """Write ``chunks`` padded to ``bucket`` tokens; returns ``bucket``."""
        if self._copied is not None:
            self._copied.synchronize()
        m, cap = self.max_chunks, self.capacity
        lengths = [len(c.token_ids) for c in chunks]
        n = sum(lengths)
        if len(chunks) > m or n > cap:
            raise ValueError(f"a step takes at most {m} prompt chunks of {cap} tokens in all, got "
                             f"{len(chunks)} of {n}")
        h64, h = self.host64, self._views(self.host32)
        h64[:n] = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        h64[n:bucket] = 0
        offsets = [0]
        for c, k in zip(chunks, lengths):
            at = offsets[-1]
            h["positions"][at:at + k] = torch.arange(c.start, c.start + k, dtype=torch.int32)
            h["slots"][at:at + k] = c.slot
            offsets.append(at + k)
        h["positions"][n:bucket] = torch.arange(bucket - n, dtype=torch.int32)  # the padding request
        h["slots"][n:bucket] = dummy_slot
        h["request_slots"].fill_(dummy_slot)
        h["request_starts"].zero_()
        h["cu"][: len(offsets)] = torch.tensor(offsets, dtype=torch.int32)
        h["cu"][len(offsets):m + 1] = n
        h["cu"][m + 1] = bucket
        seats = [(c, offsets[i + 1] - 1) for i, c in enumerate(chunks) if c.row >= 0]
        for i, c in enumerate(chunks):
            h["request_slots"][i], h["request_starts"][i] = c.slot, c.start
        rows, last, seeds = h64[cap:cap + m], h64[cap + m:cap + 2 * m], h64[cap + 2 * m:]
        rows.fill_(scratch_row), last.zero_(), seeds.zero_()
        h["seat_ends"].fill_(1), h["seat_slots"].fill_(dummy_slot)
        for j, (c, end) in enumerate(seats):
            rows[j], last[j], seeds[j] = c.row, end, c.sampling.seed_bits
            h["seat_ends"][j], h["seat_slots"][j] = c.start + len(c.token_ids), c.slot
        blocking = self.device.type != "cuda"
        self.dev64.copy_(self.host64, non_blocking=not blocking)
        self.dev32.copy_(self.host32, non_blocking=not blocking)
        if not blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return bucket


def _pad_requests(b: int, t: int) -> int:
    """Padding requests of a ragged verify in bucket ``b``: its padding tokens (fewer than ``b``) go
    to requests of at most ``t`` tokens on the dummy line, so attention sees rows of <= t queries."""
    return -(-b // t)


def _sample_rows(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, positions: torch.Tensor,
                 workspace=None):
    """One target token per row (int32 ``[R]``) from f32 logits ``[R, V]``: the argmax when greedy,
    else an inverse-CDF draw keyed by (seed, position)."""
    if sampling.greedy:
        return logits.argmax(-1).to(torch.int32)
    uniforms = K.request_uniforms(seeds, positions, K.PURPOSE_TARGET_SAMPLE, 1)
    token = torch.zeros(logits.shape[0], 1, dtype=torch.int32, device=logits.device)
    K.sample_probability_rows(sampling.probabilities(logits, workspace), uniforms, token, 0, workspace=workspace)
    return token[:, 0]
