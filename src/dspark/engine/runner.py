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

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .. import kernels as K
from ..model.draft_runner import DraftRunner
from ..model.llama import AttentionBatch, TargetLM
from .drafting import Drafter, SamplingParams

__all__ = ["ModelRunner", "PrefillChunk", "ForwardFailed", "batch_buckets", "PURPOSE_ORACLE"]

PURPOSE_ORACLE = 0x3C6EF372FE94F82B  # benchmarks' controlled acceptance: its own stream
TRACE_ROUNDS = 512  # replayed rounds kept per row (a longer trace is cut; rounds cycle)


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
    oracle_ids: list[int] | None = None
    oracle_trace: list[list[float]] | None = None


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
                 cuda_graphs: bool = True, oracle_acceptance: float | None = None, oracle_replay: bool = False):
        self.target, self.drafter = target, drafter
        self.device = dev = target.device
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.num_drafts = drafter.num_draft_tokens if drafter else 0
        self.verify_len = self.num_drafts + 1
        block = drafter.block_size if drafter else 1
        # a round writes past the committed tokens; padding tokens of a ragged verify use the dummy line
        line = max(max_model_len + self.verify_len + block, max_batch + 1)
        self.dummy_slot = max_batch
        self.cache = target.new_cache(max_batch + 1, line)
        self.draft = DraftRunner(drafter.model, max_batch + 1, line) if drafter else None
        self.buckets = batch_buckets(max_batch)
        self.use_graphs = cuda_graphs and dev.type == "cuda" and getattr(target, "graphable", True)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.oracle_acceptance, self.oracle_replay = oracle_acceptance, oracle_replay

        i32 = dict(dtype=torch.int32, device=dev)
        b, p, t = max_batch, self.num_drafts, self.verify_len
        self.state = {  # every per-row tensor; rows move together when a request leaves
            "slot_ids": torch.full((b,), self.dummy_slot, **i32), "active": torch.zeros(b, **i32),
            "anchor": torch.zeros(b, **i32), "anchor_pos": torch.zeros(b, **i32), "ctx_pos": torch.zeros(b, **i32),
            "seeds": torch.zeros(b, dtype=torch.int64, device=dev),
            "draft_tokens": torch.zeros(b, max(p, 1), **i32), "proposal_lengths": torch.full((b,), max(p, 1), **i32),
            "accepted": torch.zeros(b, t, **i32), "accept_length": torch.ones(b, **i32),
        }
        # flat [b*t + 1] rows: row*t + i is verify token i of a row (plain decoding: t = 1), the
        # last row takes padding tokens; read back for log-probabilities after the round
        self.logit_rows = torch.zeros(b * t + 1, target.vocab_size, device=dev)
        if drafter is not None:
            width = drafter.config.num_capture_layers * drafter.config.hidden_size
            self.capture_rows = torch.zeros(b * t + 1, width, dtype=target.dtype, device=dev)
            self.state["capture"] = self.capture_rows[: b * t].view(b, t, width)
            self.state["verify_lens"] = torch.ones(b, **i32)
            self.state["confidence"] = torch.zeros(b, p, device=dev)
            self.host_lens = torch.ones(b, dtype=torch.int32, pin_memory=dev.type == "cuda")
        if oracle_acceptance is not None or oracle_replay:
            self.state["oracle"] = torch.zeros(b, line + t, **i32)
        if oracle_replay:  # per row: its trace, the trace's length, the next round to replay
            self.state["trace"] = torch.zeros(b, TRACE_ROUNDS, p + 1, device=dev)
            self.state["trace_len"] = torch.ones(b, **i32)
            self.state["trace_round"] = torch.zeros(b, **i32)
        # accepted | accept length | verified drafts | next proposal length | next confidences (f32 bits)
        self.readout = torch.zeros(b, t + 3 + p, **i32)
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
        if "draft_probs" not in self.state:
            v = self.target.vocab_size
            self.state["draft_probs"] = torch.zeros(self.max_batch, self.num_drafts, v, device=self.device)
            self.graphs.clear()  # graphs captured before do not write them
            self.pool = None  # their memory pool went with them

    def move_row(self, src: int, dst: int) -> None:
        """Move a running request's row (its cache slot stays where it is)."""
        for t in self.state.values():
            t[dst] = t[src]
        self.row_modes[dst] = self.row_modes[src]
        self.clear_row(src)

    def clear_row(self, row: int) -> None:
        """Turn ``row`` into padding: dummy slot, position 0."""
        s = self.state
        s["slot_ids"][row] = self.dummy_slot
        for name in ("active", "anchor", "anchor_pos", "ctx_pos"):
            s[name][row] = 0
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
        self.state["verify_lens"].copy_(lens, non_blocking=True)  # pinned: no sync; the last readout freed it
        num_tokens = b * -(-sum(verify_lens + [1] * (b - rows)) // b) if b else 0  # a multiple of b: t graphs per b
        if chunks:
            self._mixed_step(b, rows, num_tokens, chunks)
            return
        mode = self._batch_mode(rows)
        self._replay(("verify", b, num_tokens, mode), lambda: self._verify_rows(b, rows, num_tokens, mode))
        self._replay(("draft", b, 0, mode), lambda: self._draft_rows(b, rows, mode))

    def launch_decode(self, rows: int, chunks: list[PrefillChunk] = ()) -> None:
        """Start one plain decoding step for the first ``rows`` rows (no wait; ``read`` collects it),
        with ``chunks`` as ``launch_round``."""
        if chunks:
            self._mixed_step(self.bucket(rows) if rows else 0, rows, None, chunks)
            return
        b = self.bucket(rows)
        mode = self._batch_mode(rows)
        self._replay(("decode", b, 1, mode), lambda: self._decode_rows(b, rows, mode))

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
            for k in range(1, self.verify_len + 1):  # k tokens per row: the graph of b * k flat tokens
                lens.fill_(k)
                self.state["verify_lens"].copy_(lens)
                self._replay(("verify", b, b * k, greedy), lambda: self._verify_rows(b, b, b * k, greedy))
            self._replay(("draft", b, 0, greedy), lambda: self._draft_rows(b, b, greedy))
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _batch_mode(self, rows: int) -> SamplingParams | None:
        """The rows' shared sampling setting, or None when they differ (grouped, eager)."""
        modes = set(self.row_modes[:rows])
        return modes.pop() if len(modes) == 1 else None

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

    def _replay(self, key: tuple, fn: Callable[[], None]) -> None:
        mode = key[-1]
        if not self.use_graphs or mode is None:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            saved = {k: v.clone() for k, v in self.state.items() if k not in ("capture", "draft_probs")}
            fn()  # warm-up: compiles kernels and sizes their scratch; its writes are undone below
            torch.cuda.synchronize(self.device)
            for k, v in saved.items():
                self.state[k].copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
            self.pool = graph.pool()
            self.graphs[key] = graph
        graph.replay()

    # ---- device work (captured) -----------------------------------------------------------------

    def _attention_batch(self, b: int, query_len: int) -> AttentionBatch:
        s = self.state
        return AttentionBatch(s["slot_ids"][:b], s["anchor_pos"][:b], self.cu[query_len][: b + 1], query_len)

    def _decode_rows(self, b: int, rows: int, mode) -> None:
        s = self.state
        logits = self.target.forward(s["anchor"][:b].long(), s["anchor_pos"][:b], s["slot_ids"][:b],
                                     self._attention_batch(b, 1), self.cache)
        self._decode_commit(b, rows, logits, mode)

    def _decode_commit(self, b: int, rows: int, logits, mode) -> None:
        s = self.state
        self.logit_rows[:b].copy_(logits)
        for index, sampling in self._groups(b, rows, mode):
            token = _sample_rows(logits[index], sampling, s["seeds"][index], s["anchor_pos"][index], self.workspace)
            s["accepted"][index, 0] = token
        s["accept_length"][:b] = 1
        self._advance(b, 1)

    def _verify_layout(self, b: int, num_tokens: int):
        """Flat layout of a ragged verify: request of each token (rows ``0 .. b-1``, then the padding
        requests on the dummy line), its index in the request, and its row in the flat capture /
        logit buffers; the requests' token offsets ``cu``."""
        s, t = self.state, self.verify_len
        n = b + _pad_requests(b, t)
        pad = num_tokens - s["verify_lens"][:b].sum()
        pad_counts = (pad - t * self.offsets_rows[: n - b]).clamp(0, t)
        counts = torch.cat([s["verify_lens"][:b], pad_counts])
        cu = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        cu[1:] = counts.cumsum(0)
        token_row = torch.repeat_interleave(self.offsets_rows[:n], counts, output_size=num_tokens)
        index = self.flat_offsets[:num_tokens] - cu[token_row]
        flat = torch.where(token_row < b, token_row * t + index, self.max_batch * t).long()
        return token_row, index, flat, cu

    def _verify_rows(self, b: int, rows: int, num_tokens: int, mode) -> None:
        ids, positions, slots, batch, flat = self._verify_inputs(b, num_tokens)
        capture = torch.empty(num_tokens, self.capture_rows.shape[1], dtype=self.capture_rows.dtype, device=self.device)
        logits = self.target.forward(ids, positions, slots, batch, self.cache, capture_out=capture)
        self._verify_commit(b, rows, flat, capture, logits, mode)

    def _verify_inputs(self, b: int, num_tokens: int):
        """Token ids, positions and cache lines of a ragged verify's ``num_tokens`` flat tokens, its
        ``AttentionBatch`` and each token's row in the flat capture / logit buffers."""
        s, t, p = self.state, self.verify_len, self.num_drafts
        token_row, index, flat, cu = self._verify_layout(b, num_tokens)
        pads = torch.zeros(_pad_requests(b, t), dtype=torch.int32, device=self.device)
        slots = torch.cat([s["slot_ids"][:b], pads + self.dummy_slot])
        starts = torch.cat([s["anchor_pos"][:b], pads])
        tokens = torch.cat([K.build_verify_tokens(s["anchor"][:b], s["draft_tokens"][:b], p),
                            pads[:, None].expand(-1, t)])
        ids = tokens[token_row, index]
        return ids.long(), starts[token_row] + index, slots[token_row], AttentionBatch(slots, starts, cu, t), flat

    def _verify_commit(self, b: int, rows: int, flat, capture, logits, mode) -> None:
        """Accept each row's prefix from the verify forward's captures and logits and advance."""
        s, t = self.state, self.verify_len
        self.capture_rows.index_copy_(0, flat, capture)
        self.logit_rows.index_copy_(0, flat, logits)
        verified = s["verify_lens"][:b] - 1
        padded = self.logit_rows[: b * t].view(b, t, -1)
        for rows_of, sampling in self._groups(b, rows, mode):
            accepted, n = self._accept(padded[rows_of], rows_of, verified[rows_of], sampling)
            s["accepted"][rows_of] = accepted
            s["accept_length"][rows_of] = n
        self.readout[:b, t + 1] = verified
        self._advance(b, t)

    def _accept(self, logits, index, verified, sampling: SamplingParams):
        """Accept rows ``index`` from their target logits ``[R, P+1, V]``, verifying ``verified``
        drafts each (rows past a row's length are never read)."""
        s, p = self.state, self.num_drafts
        drafts = s["draft_tokens"][index]
        if sampling.greedy:
            return K.greedy_accept(logits, drafts, verified, p, workspace=self.workspace)
        seeds, anchor_pos = s["seeds"][index], s["anchor_pos"][index]
        uniforms = torch.empty(seeds.shape[0], 2 * p + 1, device=self.device)
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_ACCEPT, p, out=uniforms[:, :p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_RESIDUAL, p, out=uniforms[:, p:2 * p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_BONUS, 1, out=uniforms[:, 2 * p:])
        probs = sampling.probabilities(logits.reshape(-1, logits.shape[-1]), self.workspace).view(logits.shape)
        return K.probabilistic_accept(probs, s["draft_probs"][index], drafts, verified, uniforms, p,
                                      workspace=self.workspace)

    def _advance(self, b: int, verify_len: int) -> None:
        """Commit the accepted prefix on the device: the caches' lengths are the anchor positions."""
        s = self.state
        n = s["accept_length"][:b]
        self.readout[:b, :verify_len] = s["accepted"][:b, :verify_len]
        self.readout[:b, self.verify_len] = n
        s["ctx_pos"][:b] = s["anchor_pos"][:b]
        s["anchor"][:b] = s["accepted"][:b].gather(1, (n - 1).long()[:, None]).squeeze(1)
        s["anchor_pos"][:b] += n * s["active"][:b]  # padding rows stay at position 0

    def _draft_rows(self, b: int, rows: int, mode) -> None:
        s, t, p = self.state, self.verify_len, self.num_drafts
        positions = (s["ctx_pos"][:b, None] + self.offsets[:t]).view(-1)
        self.draft.context(s["capture"][:b].reshape(b * t, -1), positions, s["slot_ids"][:b].repeat_interleave(t))
        hidden = self.draft.block(s["anchor"][:b], s["anchor_pos"][:b], s["slot_ids"][:b])
        logits = self.drafter.model.backbone_logits(hidden)
        n = self.drafter.block_size
        for index, sampling in self._groups(b, rows, mode):
            rows_of = (lambda x: x.view(b, n, -1)[index].reshape(-1, x.shape[-1]))
            uniforms = None
            if not sampling.greedy:
                uniforms = K.request_uniforms(s["seeds"][index], s["anchor_pos"][index], K.PURPOSE_PROPOSAL, p)
            proposal = self.drafter.propose_rows(rows_of(hidden), rows_of(logits), s["anchor"][index], sampling, uniforms)
            s["draft_tokens"][index] = proposal.token_ids
            s["proposal_lengths"][index] = proposal.proposal_lengths
            if proposal.confidence is not None:
                s["confidence"][index] = proposal.confidence
            if proposal.probabilities is not None:
                s["draft_probs"][index] = proposal.probabilities
        if self.oracle_acceptance is not None or self.oracle_replay:
            self._oracle_drafts(b)
        self.readout[:b, t + 2] = s["proposal_lengths"][:b]
        self.readout[:b, t + 3:] = s["confidence"][:b].view(torch.int32)

    # ---- steps with prompt chunks (eager) ---------------------------------------------------------

    def _mixed_step(self, b: int, rows: int, num_tokens: int | None, chunks: list[PrefillChunk]) -> None:
        """One eager forward over the running rows' tokens -- padded to bucket ``b`` as in the graphs
        (the same kernel configurations, the same numerics): ``num_tokens`` ragged verify tokens
        (None: one decode token per row) -- and the prompt chunks; then accept / sample as the
        graphed step does, write the chunks' draft context, seat the requests whose prompt ended
        (first token, row state) and draft every row. Raises ``ForwardFailed`` when the forward
        raised (no row state changed yet)."""
        if self.drafter is not None and any(not c.sampling.greedy for c in chunks):
            self._ensure_probabilities()
        mode = self._batch_mode(rows)
        try:
            positions, slots, flat, split, capture, logits = self._mixed_forward(b, num_tokens, chunks)
        except Exception as exc:  # noqa: BLE001
            raise ForwardFailed(f"{type(exc).__name__}: {exc}") from exc
        if b and num_tokens is not None:
            self._verify_commit(b, rows, flat, capture[:split], logits[:split], mode)
        elif b:
            self._decode_commit(b, rows, logits[:split], mode)
        if self.draft is not None:
            self.draft.context(capture[split:], positions[split:], slots[split:])
        joined = [c for c in chunks if c.row >= 0]
        if joined:
            self._seat(joined, logits[split:])
        total = rows + len(joined)
        if self.drafter is not None and total:
            b, mode = self.bucket(total), self._batch_mode(total)
            self._replay(("draft", b, 0, mode), lambda: self._draft_rows(b, total, mode))

    def _mixed_forward(self, b: int, num_tokens: int | None, chunks: list[PrefillChunk]):
        """The target forward of a mixed step (no row state changes): ``(positions, token slots,
        verify tokens' flat buffer rows, running tokens, captures or None, logits)`` -- logits of every
        running token, then of the last token of each prompt that ends."""
        ids, positions, slots, groups, flat, logit_rows, split = self._mixed_inputs(b, num_tokens, chunks)
        capture = None
        if self.draft is not None:
            capture = torch.empty(ids.numel(), self.capture_rows.shape[1], dtype=self.capture_rows.dtype,
                                  device=self.device)
        logits = self.target.forward(ids, positions, slots, groups, self.cache, capture_out=capture,
                                     logits_rows=logit_rows)
        return positions, slots, flat, split, capture, logits

    def _mixed_inputs(self, b: int, num_tokens: int | None, chunks: list[PrefillChunk]):
        """Flat inputs of a mixed step: bucket ``b``'s tokens (``num_tokens`` ragged verify tokens, or
        one decode token per row when None), then the chunks'; attention groups; the verify tokens'
        flat buffer rows; which rows need logits (every running token, the last token of each prompt
        that ends); the number of running tokens."""
        s, dev = self.state, self.device
        parts, groups, flat, split = [], [], None, 0
        if b and num_tokens is not None:
            ids, positions, slots, batch, flat = self._verify_inputs(b, num_tokens)
            parts.append((ids, positions, slots))
            split = num_tokens
        elif b:
            parts.append((s["anchor"][:b].long(), s["anchor_pos"][:b], s["slot_ids"][:b]))
            batch, split = self._attention_batch(b, 1), b
        if b:
            groups.append((0, split, batch))
        lengths = [len(c.token_ids) for c in chunks]
        host = torch.tensor([t for c in chunks for t in c.token_ids] +
                            [c.start + i for c in chunks for i in range(len(c.token_ids))] +
                            [c.slot for c, n in zip(chunks, lengths) for _ in range(n)] +
                            [c.slot for c in chunks] + [c.start for c in chunks] + [0] + lengths, dtype=torch.int64)
        n, m = sum(lengths), len(chunks)
        host = host.to(dev, non_blocking=True)
        meta = host[3 * n:].int()
        chunk_batch = AttentionBatch(meta[:m], meta[m:2 * m], meta[2 * m:].cumsum(0, dtype=torch.int32), max(lengths))
        groups.append((split, split + n, chunk_batch))
        parts.append((host[:n], host[n:2 * n].int(), host[2 * n:3 * n].int()))
        ids, positions, slots = (torch.cat([p[k] for p in parts]) for k in range(3))
        ends = [split + e - 1 for c, e in zip(chunks, torch.tensor(lengths).cumsum(0).tolist()) if c.row >= 0]
        logit_rows = torch.cat([torch.arange(split, device=dev), torch.tensor(ends, dtype=torch.int64, device=dev)])
        return ids, positions, slots, groups, flat, logit_rows, split

    def _seat(self, chunks: list[PrefillChunk], logits: torch.Tensor) -> None:
        """Rows for requests whose prompt ended: the first token from the last position's logits
        ``[J, V]`` (keyed as a round's draw: seed, position), row state, the readout as a one-token
        round, the logits kept for log-probabilities."""
        dev, s, t = self.device, self.state, self.verify_len
        i32 = dict(dtype=torch.int32, device=dev)
        rows = torch.tensor([c.row for c in chunks], device=dev)
        ends = torch.tensor([c.start + len(c.token_ids) for c in chunks], **i32)
        seeds = torch.tensor([c.sampling.seed_bits for c in chunks], dtype=torch.int64, device=dev)
        slots = torch.tensor([c.slot for c in chunks], **i32)
        tokens = torch.empty(len(chunks), **i32)
        for mode in {_mode(c.sampling) for c in chunks}:
            index = torch.tensor([i for i, c in enumerate(chunks) if _mode(c.sampling) == mode], device=dev)
            tokens[index] = _sample_rows(logits[index], mode, seeds[index], ends[index] - 1, self.workspace)
        for name, value in (("slot_ids", slots), ("active", 1), ("anchor_pos", ends), ("ctx_pos", ends),
                            ("anchor", tokens), ("seeds", seeds), ("accept_length", 1)):
            s[name][rows] = value
        s["accepted"][rows, 0] = tokens
        self.logit_rows[rows * t] = logits
        self.readout[rows, 0] = tokens
        self.readout[rows, t] = 1
        self.readout[rows, t + 1] = 0
        for c in chunks:
            self.row_modes[c.row] = _mode(c.sampling)
            if c.oracle_ids is not None:
                prompt_len = c.start + len(c.token_ids)
                known = torch.tensor(list(c.oracle_ids), **i32)[: s["oracle"].shape[1] - prompt_len]
                s["oracle"][c.row].zero_()
                s["oracle"][c.row, prompt_len: prompt_len + known.numel()] = known
            if c.oracle_trace is not None:
                trace = torch.tensor(c.oracle_trace[:TRACE_ROUNDS], dtype=torch.float32, device=dev)
                s["trace"][c.row, : trace.shape[0]] = trace
                s["trace_len"][c.row], s["trace_round"][c.row] = trace.shape[0], 0

    def probe(self, chunk: PrefillChunk) -> None:
        """Run one prompt chunk alone (the target forward and its draft context writes, no row state):
        after a failed mixed step, whether this request's own tokens fail."""
        positions, slots, _, _, capture, _ = self._mixed_forward(0, None, [replace(chunk, row=-1)])
        if self.draft is not None:
            self.draft.context(capture, positions, slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _oracle_drafts(self, b: int) -> None:
        """Benchmarks: each draft is the known continuation (which the greedy target accepts) or a
        token it rejects (the continuation's id + 1): per draft with probability ``oracle_acceptance``,
        or, replaying a trace, the first ``accepted`` of the round's entry; the entry's confidences
        then replace the drafter's and the scheduler's lengths follow from them."""
        s, p = self.state, self.num_drafts
        truth = s["oracle"][:b].gather(1, (s["anchor_pos"][:b, None] + 1 + self.offsets[:p]).long())
        wrong = (truth + 1) % self.target.vocab_size
        if self.oracle_replay:
            index = (s["trace_round"][:b] % s["trace_len"][:b]).long()
            entry = s["trace"][:b].gather(1, index[:, None, None].expand(b, 1, p + 1)).squeeze(1)
            keep = self.offsets[:p].float() < entry[:, :1]
            s["confidence"][:b] = entry[:, 1:]
            s["proposal_lengths"][:b] = self.drafter.proposal_lengths(entry[:, 1:].contiguous())
            s["trace_round"][:b] += s["active"][:b]
        else:
            keep = K.request_uniforms(s["seeds"][:b], s["anchor_pos"][:b], PURPOSE_ORACLE, p) < self.oracle_acceptance
        s["draft_tokens"][:b] = torch.where(keep, truth, wrong)


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
