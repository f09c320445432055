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

Plain decoding (no draft) is ``decode(B)``: one target step per row, graphed the same way. All
randomness is request-stable (``K.request_uniforms``, keyed by the request's seed and the round's
anchor position), so a request's tokens do not depend on its batch. A batch whose rows share one
sampling setting runs its whole round inside the graphs; rows with different settings are grouped
and run eagerly (the same functions, without graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .. import kernels as K
from ..model.draft_runner import DraftRunner
from ..model.llama import AttentionBatch, TargetLM
from .drafting import Drafter, SamplingParams

__all__ = ["ModelRunner", "PrefillEntry", "batch_buckets", "PURPOSE_ORACLE"]

PURPOSE_ORACLE = 0x3C6EF372FE94F82B  # benchmarks' controlled acceptance: its own stream
TRACE_ROUNDS = 512  # replayed rounds kept per row (a longer trace is cut; rounds cycle)


@dataclass
class PrefillEntry:
    """A newly admitted request: its batch row, cache slot, prompt and sampling settings."""

    row: int
    slot: int
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    oracle_ids: list[int] | None = None
    oracle_trace: list[list[float]] | None = None


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
        self.use_graphs = cuda_graphs and dev.type == "cuda"
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

    def prefill(self, entries: list[PrefillEntry]) -> tuple[list[int], torch.Tensor]:
        """Run the prompts of newly admitted requests into their slots in one eager forward, set up
        their rows and return each one's first token (one sync: the first tokens stream at once)
        and the target's f32 logits ``[E, V]`` it came from."""
        dev, s = self.device, self.state
        if self.drafter is not None and any(not e.sampling.greedy for e in entries):
            self._ensure_probabilities()
        lengths = [len(e.prompt_ids) for e in entries]
        i32 = dict(dtype=torch.int32, device=dev)
        ids = torch.tensor([t for e in entries for t in e.prompt_ids], dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, **i32) for n in lengths])
        slots = torch.tensor([e.slot for e, n in zip(entries, lengths) for _ in range(n)], **i32)
        cu = torch.tensor([0] + lengths, **i32).cumsum(0, dtype=torch.int32)
        slot_ids = torch.tensor([e.slot for e in entries], **i32)
        batch = AttentionBatch(slot_ids, torch.zeros(len(entries), **i32), cu, max(lengths))
        capture = None
        if self.draft is not None:
            capture = torch.empty(ids.numel(), s["capture"].shape[-1], dtype=self.target.dtype, device=dev)
        logits = self.target.forward(ids, positions, slots, batch, self.cache, capture_out=capture,
                                     logits_rows=(cu[1:] - 1).long())
        if self.draft is not None:
            self.draft.context(capture, positions, slots)
        seeds = torch.tensor([_as_int64(e.seed) for e in entries], dtype=torch.int64, device=dev)
        last = torch.tensor(lengths, **i32) - 1
        tokens = torch.empty(len(entries), **i32)
        for mode in {_mode(e.sampling) for e in entries}:
            index = torch.tensor([i for i, e in enumerate(entries) if _mode(e.sampling) == mode], device=dev)
            tokens[index] = _sample_rows(logits[index], mode, seeds[index], last[index])
        rows = torch.tensor([e.row for e in entries], device=dev)
        for name, value in (("slot_ids", slot_ids), ("active", 1), ("anchor_pos", last + 1), ("ctx_pos", last + 1),
                            ("anchor", tokens), ("seeds", seeds)):
            s[name][rows] = value
        for e in entries:
            self.row_modes[e.row] = _mode(e.sampling)
            if e.oracle_ids is not None:
                known = torch.tensor(list(e.prompt_ids) + list(e.oracle_ids), **i32)[: s["oracle"].shape[1]]
                s["oracle"][e.row].zero_()
                s["oracle"][e.row, : known.numel()] = known
            if e.oracle_trace is not None:
                trace = torch.tensor(e.oracle_trace[:TRACE_ROUNDS], dtype=torch.float32, device=dev)
                s["trace"][e.row, : trace.shape[0]] = trace
                s["trace_len"][e.row], s["trace_round"][e.row] = trace.shape[0], 0
        return tokens.tolist(), logits

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

    def launch_round(self, rows: int, verify_lens: list[int], *, draft_first: bool) -> None:
        """Start one speculative round for the first ``rows`` rows (no wait; ``read`` collects it):
        row i verifies ``verify_lens[i] - 1`` drafts (1 .. P). ``draft_first``: newly admitted rows
        have no proposal yet."""
        b = self.bucket(rows)
        mode = self._batch_mode(rows)
        if draft_first:
            self._replay(("draft", b, 0, mode), lambda: self._draft_rows(b, rows, mode))
        lens = self.host_lens
        lens.fill_(1)  # padding rows verify their anchor only
        lens[:rows] = torch.tensor(verify_lens, dtype=torch.int32)
        self.state["verify_lens"].copy_(lens, non_blocking=True)  # pinned: no sync; the last readout freed it
        num_tokens = b * -(-sum(verify_lens[:rows] + [1] * (b - rows)) // b)  # a multiple of b: t graphs per b
        self._replay(("verify", b, num_tokens, mode), lambda: self._verify_rows(b, rows, num_tokens, mode))
        self._replay(("draft", b, 0, mode), lambda: self._draft_rows(b, rows, mode))

    def launch_decode(self, rows: int) -> None:
        """Start one plain decoding step for the first ``rows`` rows (no wait; ``read`` collects it)."""
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
        s, t, p = self.state, self.verify_len, self.num_drafts
        token_row, index, flat, cu = self._verify_layout(b, num_tokens)
        pads = torch.zeros(_pad_requests(b, t), dtype=torch.int32, device=self.device)
        slots = torch.cat([s["slot_ids"][:b], pads + self.dummy_slot])
        starts = torch.cat([s["anchor_pos"][:b], pads])
        tokens = torch.cat([K.build_verify_tokens(s["anchor"][:b], s["draft_tokens"][:b], p),
                            pads[:, None].expand(-1, t)])
        ids = tokens[token_row, index]
        capture = torch.empty(num_tokens, self.capture_rows.shape[1], dtype=self.capture_rows.dtype, device=self.device)
        logits = self.target.forward(ids.long(), starts[token_row] + index, slots[token_row],
                                     AttentionBatch(slots, starts, cu, t), self.cache, capture_out=capture)
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


def _as_int64(value: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit ``value``."""
    return value - (1 << 64) if value >= 1 << 63 else value
