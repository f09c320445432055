"""The model runner's CUDA graphs: one per shape, captured on first use or all up front, and replayed.

A graph is keyed by its shape -- ``("decode", B, 1, path)``, ``("verify", B, N, path)``,
``("draft", B, 0, path)``, ``("plain", B, path)``, ``("context", B, T)`` (T = 1: after a plain round), and
``("mixed", B, N, chunk bucket, path)`` for a step with prompt chunks -- where ``B`` is the batch
bucket the running rows pad up to (``rows.batch_buckets``) and ``path`` the rows' ``LogitsPath``
(greedy, sampled, or sampled after the penalty pass; a mixed step's only ``GREEDY`` or
``PENALISED``, which keeps the many chunk shapes to two variants). Steps with prompt chunks pad their
chunk tokens to power-of-two buckets (``_chunk_bucket``; staged at fixed addresses: ``ChunkBuffers``)
and are captured up front with the rest (``capture_graphs``: ``mixed_shapes``): up to
``GRAPH_CHUNK_TOKENS`` chunk tokens for every verify total the scheduler may choose; above it the
running rows' verify is padded to every row's full length, so that each larger chunk bucket needs
one graph per rows bucket. A capture that fails runs eagerly from then on (``uncapturable``).
``ModelRunner`` inherits this: the graphs' state lives on the runner.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .. import kernels as K
from .chunks import MAX_CHUNKS, PrefillChunk, pads_verify
from .rows import LogitsPath, batch_buckets

log = logging.getLogger("dspark.engine")

__all__ = ["CudaGraphs"]


class CudaGraphs:
    """The CUDA graphs of a ``ModelRunner`` (which provides the rows, the forwards and the draft pass
    the graphs record: ``state``, ``penalties``, ``chunks``, ``_decode_rows``, ``_verify_rows``, ``_draft``,
    ``_mixed_rows``, ...)."""

    def _init_graphs(self, max_batch: int, cuda_graphs: bool) -> None:
        self.buckets = batch_buckets(max_batch)
        # the PyTorch reference kernels (forced: K.use_backend / DSPARK_BACKEND) read device values on
        # the host and index freely: they run eagerly, never inside a capture's warm-up or recording
        self.use_graphs = (cuda_graphs and self.device.type == "cuda" and getattr(self.target, "graphable", True)
                           and K.forced_backend() != "reference")
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.uncapturable: set[tuple] = set()  # keys whose capture failed: eager
        self.captures = 0  # graphs captured so far (a step that captures is no measure of host time)
        self.pool = None

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _chunk_bucket(self, n: int) -> int:
        """Padded chunk tokens of a step: a power of two >= 16 (one graph per bucket), within the
        step's chunk capacity, with at most a cache line of padding (the padding request's tokens)."""
        return min(max(16, 1 << max(n - 1, 0).bit_length()), self.chunks.capacity, n + self.line)

    def _replay(self, key: tuple, fn: Callable[[], None]) -> None:
        """Replay the graph of ``key`` (captured on first use), or run ``fn`` eagerly when graphs are off."""
        if not self.use_graphs or key in self.uncapturable:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            restore = self._snapshot()
            fn()  # warm-up: compiles kernels and sizes their scratch; its writes are undone below
            torch.cuda.synchronize(self.device)
            restore()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.current_stream(self.device)
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    fn()
            except Exception:  # noqa: BLE001 -- a capture records, it runs nothing: run it eagerly from now on
                # a failed capture_end leaves torch.cuda.graph's capture stream current: step back to ours
                torch.cuda.set_stream(stream)
                log.warning("the CUDA graph %s could not be captured; it runs eagerly", key, exc_info=True)
                self.uncapturable.add(key)
                # a target whose forward failed inside the capture says so (HFTarget): no more captures
                self.use_graphs = getattr(self.target, "graphable", True)
                fn()
                return
            self.pool = graph.pool()
            self.graphs[key] = graph
            self.captures += 1
        graph.replay()

    def _snapshot(self) -> Callable[[], None]:
        """Copies of the row state a step writes (the slots' penalty state and the draft override's
        buffers too), a hybrid target's layer states frozen, and a function that puts them back: a
        graph's warm-up run must leave no trace. The captured hidden states and draft probabilities
        are excluded: every step rewrites the rows it reads."""
        live = [t for name, t in self.state.tensors() if name not in ("capture", "draft_probs")]
        live += self.penalties.buffers()
        if self.draft_override is not None:
            live += self.draft_override.buffers()
        saved = [t.clone() for t in live]
        states = getattr(self.cache, "states", None)  # a hybrid target's: written to scratch until restored
        if states is not None:
            states.frozen = True

        def restore() -> None:
            for t, value in zip(live, saved):
                t.copy_(value)
            saved.clear()  # freed before the capture: the pool may grow into them
            if states is not None:
                states.frozen = False

        return restore

    def capture_graphs(self, plain_rounds: bool = False) -> int:
        """Capture the graphs of every batch bucket now, on every ``LogitsPath`` (verify at
        every token multiple, draft; or decode; with ``plain_rounds``, a DSpark runner's plain round
        and context-only pass too: the cost scheduler's), and of the steps with prompt chunks
        (``mixed_shapes``), so that no request waits for a capture later; returns the number of
        graphs. Call with no request running: the captures replay once on padding rows.

        Largest first: every graph allocates in one shared memory pool, and a capture reuses the
        blocks the captures before it freed only where one is large enough for each of its tensors.
        The first capture -- the largest mixed step, on the penalised path -- sizes the pool; the
        rest fit in it. Smallest first, each batch bucket's ``[rows, V]`` temporaries took new
        blocks (the pool passed 18 GiB by the 144-row bucket of max_batch 256 on an H100)."""
        if not self.use_graphs:
            return 0
        shapes = sorted(self.mixed_shapes(plain_rounds), reverse=True,
                        key=lambda shape: (shape[0], shape[0] if shape[1] is None else shape[1], shape[2]))
        for b, num_tokens, bucket in shapes:
            for path in (LogitsPath.PENALISED, LogitsPath.GREEDY) if b else (LogitsPath.GREEDY,):
                self._capture_mixed(b, num_tokens, bucket, path)
        for b in reversed(self.buckets):
            for path in reversed(LogitsPath):
                self._capture_bucket(b, path, plain_rounds)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def mixed_shapes(self, plain_rounds: bool = False) -> list[tuple[int, int | None, int]]:
        """(rows bucket, running rows' tokens or None for one decode token per row, chunk bucket) of
        the steps with prompt chunks a server meets: no running rows or any bucket's; every verify
        total of a round without chunks (the bucket times 1 .. verify length; a tree's full
        budget), or a plain round's one token per row (a plain runner's, or with ``plain_rounds``);
        every power-of-two chunk bucket up to ``GRAPH_CHUNK_TOKENS``; the larger buckets up to the
        capacity with the running rows' full verify only (``_mixed_step`` pads to it). A chunk bucket
        cut to a chunk's tokens plus a cache line (``_chunk_bucket``) is captured on first use."""
        cap = self.chunks.capacity
        buckets = [c for c in (1 << k for k in range(4, cap.bit_length())) if c < cap] + [cap]
        small = [c for c in buckets if not pads_verify(c)]
        large = [c for c in buckets if pads_verify(c)]
        running: list[int | None] = [None] if self.drafter is None or plain_rounds else []
        shapes = [(0, None, c) for c in buckets]
        for b in self.buckets:
            totals = [] if self.drafter is None else [b * k for k in self._verify_tokens_per_row()]
            shapes += [(b, n, c) for n in running + totals for c in small]
            shapes += [(b, n, c) for n in running + totals[-1:] for c in large]
        return shapes

    def _capture_mixed(self, b: int, num_tokens: int | None, bucket: int, path: LogitsPath) -> None:
        """Capture one step with prompt chunks: ``bucket`` tokens of chunks on the dummy line (each at
        most a line long), no seat; the running rows verify ``num_tokens / b`` tokens each."""
        if num_tokens is not None:
            self.host_lens.fill_(num_tokens // b)
            self.state.verify_lens[: self.max_batch].copy_(self.host_lens)
        lengths = [min(self.line, bucket - at) for at in range(0, bucket, self.line)][:MAX_CHUNKS]
        chunks = [PrefillChunk(slot=self.dummy_slot, start=0, token_ids=[0] * n, row=-1) for n in lengths]
        self.chunks.stage(chunks, bucket, self.dummy_slot, self.scratch_row)
        self._replay(("mixed", b, num_tokens, bucket, path), lambda: self._mixed_rows(b, num_tokens, bucket, path))

    def _verify_tokens_per_row(self) -> list[int]:
        """The verify lengths a round's graphs are captured for: a tree's full budget, a chain's 1 .. P + 1."""
        return [self.verify_len] if self.tree else list(range(1, self.verify_len + 1))

    def _capture_bucket(self, b: int, path: LogitsPath, plain_rounds: bool) -> None:
        if self.drafter is None:
            self._replay(("decode", b, 1, path), lambda: self._decode_rows(b, path))
            return
        for k in reversed(self._verify_tokens_per_row()):  # b * k flat tokens, largest first
            self.host_lens.fill_(k)
            self.state.verify_lens[: self.max_batch].copy_(self.host_lens)
            self._replay(("verify", b, b * k, path), lambda: self._verify_rows(b, b * k, path))
        self._draft(b, path)
        if plain_rounds:
            self._replay(("plain", b, path), lambda: self._decode_rows(b, path))
            for t in {1, self.verify_len}:
                self._context(b, t)
