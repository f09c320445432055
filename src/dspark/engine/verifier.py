"""``Verifier``: the target pass's side of a round -- what each row sends through the target and
what it keeps of it (vLLM's rejection sampler, with the verify layout).

Each running row verifies its anchor and drafts (a chain, ragged: each row its own length, padded
to a multiple of the batch bucket by padding requests on the dummy line) or its token tree, or, in a
plain round, decodes its anchor alone. From the target's logits it accepts greedily (the longest
prefix the argmax follows) or by speculative sampling (lossless: ``K.probabilistic_accept``, keyed by
the request's seed and the round's anchor position), moves an accepted tree path's K/V to
consecutive positions, and advances each row to its new anchor. Device ops with fixed shapes per
bucket: the runner captures them in its CUDA graphs.
"""

from __future__ import annotations

import torch

from .. import kernels as K
from ..model.llama import AttentionBatch
from .drafting import RowSampling
from .penalties import PenaltyState, Window
from .rows import LogitsPath, RowState, TreeSettings
from .structured import apply_bitmask

__all__ = ["Verifier", "pad_requests", "sample_rows"]


class Verifier:
    """The target pass over ``state`` (the runner's rows ``0 .. max_batch``, the last a scratch
    row) and ``penalties`` (the state the penalties read, per slot: each position's logits processed
    with the window's tokens before it, committed tokens appended): ``verify_len`` tokens per row at
    most (the chain's anchor and ``num_drafts`` drafts, or a tree's ``budget`` nodes), the readout's
    target-pass columns (``readout``, ``columns``), ``cache`` (an accepted tree path's K/V move
    there), the kernels' ``workspace``. Owns the flat per-token buffers the runner's steps fill:
    ``logit_rows`` f32 ``[max_batch * T + 1, V]`` (row ``r * T + i``: verify token i of row r; the
    last takes padding tokens; read back for log-probabilities) and, with a drafter,
    ``capture_rows`` ``[max_batch * T + 1, width]`` (the hidden states the draft context is made
    from; ``state.capture`` is its view)."""

    def __init__(self, state: RowState, penalties: PenaltyState, readout: torch.Tensor, columns: dict[str, slice],
                 cache, *, max_batch: int, verify_len: int, num_drafts: int, tree: TreeSettings | None,
                 dummy_slot: int, vocab_size: int, capture_width: int | None, capture_dtype: torch.dtype, workspace):
        self.state, self.readout, self.columns, self.cache, self.workspace = state, readout, columns, cache, workspace
        self.penalties = penalties
        self.max_batch, self.verify_len, self.num_drafts, self.tree = max_batch, verify_len, num_drafts, tree
        self.dummy_slot = dummy_slot
        b, t, dev = max_batch, verify_len, state.anchor.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.device = dev
        self.logit_rows = torch.zeros(b * t + 1, vocab_size, device=dev)
        self.capture_rows = None
        if capture_width is not None:
            self.capture_rows = torch.zeros(b * t + 1, capture_width, dtype=capture_dtype, device=dev)
            state.capture = self.capture_rows[: b * t].view(b, t, capture_width)
        if tree is not None:
            self.tree_nodes_accepted = torch.full((b, tree.budget), -1, **i32)  # the last walk's path
        self.offsets = torch.arange(t, **i32)
        self.offsets_rows = torch.arange(b + pad_requests(b, t, full=True), **i32)
        self.flat_offsets = torch.arange(b * t, **i32)
        self.cu = {n: torch.arange(0, (b + 1) * n, n, **i32) for n in range(1, t + 1)}

    def attention_batch(self, b: int, query_len: int) -> AttentionBatch:
        s = self.state
        return AttentionBatch(s.slot_ids[:b], s.anchor_pos[:b], self.cu[query_len][: b + 1], query_len)

    def decode_commit(self, b: int, logits, path: LogitsPath, capture=None) -> None:
        """Commit one token per row from the logits ``[b, V]`` of the anchors (and, in a DSpark
        runner, their captured states ``[b, width]``: verify token 0 of a round that verified none)."""
        s, t = self.state, self.verify_len
        apply_bitmask(logits, s.grammar_mask[:b, 0].contiguous())
        self.logit_rows[: b * t].view(b, t, -1)[:, 0] = logits
        if capture is not None:
            s.capture[:b, 0] = capture
            self.readout[:b, t + 1] = 0  # drafts verified
        sampling = self._sampling(b, path) if path.sampled else None
        s.accepted[:b, 0] = sample_rows(logits, sampling, s.seeds[:b], s.anchor_pos[:b], self.workspace)
        s.accept_length[:b] = 1
        self.advance(b, 1)

    def _layout(self, b: int, num_tokens: int, full: bool = False):
        """Flat layout of a ragged verify: request of each token (rows ``0 .. b-1``, then the padding
        requests on the dummy line), its index in the request, and its row in the flat capture /
        logit buffers; the requests' token offsets ``cu``. ``full``: padded to ``b * t`` tokens."""
        s, t = self.state, self.verify_len
        n = b + pad_requests(b, t, full)
        pad = num_tokens - s.verify_lens[:b].sum()
        pad_counts = (pad - t * self.offsets_rows[: n - b]).clamp(0, t)
        counts = torch.cat([s.verify_lens[:b], pad_counts])
        cu = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        cu[1:] = counts.cumsum(0)
        token_row = torch.repeat_interleave(self.offsets_rows[:n], counts, output_size=num_tokens)
        index = self.flat_offsets[:num_tokens] - cu[token_row]
        flat = torch.where(token_row < b, token_row * t + index, self.max_batch * t).long()
        return token_row, index, flat, cu

    def inputs(self, b: int, num_tokens: int, full: bool = False):
        """Token ids, positions, cache rows (the positions, except for tree nodes) and cache lines of
        a verify's ``num_tokens`` flat tokens (``full``: padded to ``b * t``), its ``AttentionBatch``
        and each token's row in the flat capture / logit buffers."""
        if self.tree is not None:
            return self._tree_inputs(b)
        s, t, p = self.state, self.verify_len, self.num_drafts
        token_row, index, flat, cu = self._layout(b, num_tokens, full)
        pads = torch.zeros(pad_requests(b, t, full), dtype=torch.int32, device=self.device)
        slots = torch.cat([s.slot_ids[:b], pads + self.dummy_slot])
        starts = torch.cat([s.anchor_pos[:b], pads])
        tokens = torch.cat([K.build_verify_tokens(s.anchor[:b], s.draft_tokens[:b], p),
                            pads[:, None].expand(-1, t)])
        ids = tokens[token_row, index]
        positions = starts[token_row] + index
        return ids.long(), positions, positions, slots[token_row], AttentionBatch(slots, starts, cu, t), flat

    def _tree_inputs(self, b: int):
        """``inputs`` of tree rows: every row's ``budget`` nodes, RoPE at anchor position +
        depth, K/V at anchor position + node index, each node seeing its ancestors."""
        s, size = self.state, self.verify_len
        base = s.anchor_pos[:b, None]
        positions = (base + s.tree_depths[:b]).reshape(-1)
        cache_rows = (base + self.offsets[:size]).reshape(-1)
        batch = AttentionBatch(s.slot_ids[:b], s.anchor_pos[:b], self.cu[size][: b + 1], size,
                               tree_mask=s.tree_bits[:b].reshape(-1))
        return (s.tree_tokens[:b].reshape(-1).long(), positions, cache_rows, s.slot_ids[:b].repeat_interleave(size),
                batch, self.flat_offsets[: b * size].long())

    def store(self, flat, capture, logits) -> None:
        """A verify forward's captured states ``[N, width]`` and f32 logits ``[N, V]`` into the flat
        buffers at rows ``flat`` int64 ``[N]``. The caller drops its ``logits`` before ``commit``, whose
        ``[rows, V]`` temporaries then reuse that memory (``WorkingMemory``)."""
        self.capture_rows.index_copy_(0, flat, capture)
        self.logit_rows.index_copy_(0, flat, logits)

    def commit(self, b: int, path: LogitsPath) -> None:
        """Accept each row's prefix from the verify forward's captures and logits (``store``) and advance."""
        s, t = self.state, self.verify_len
        # each verify position's grammar mask (every bit set for a free row): what acceptance and
        # the log-probabilities see is the masked distribution
        apply_bitmask(self.logit_rows[: b * t], s.grammar_mask[:b].view(b * t, -1))
        if self.tree is not None:
            self._tree_commit(b, path)
            return
        verified = s.verify_lens[:b] - 1
        accepted, n = self._accept(self.logit_rows[: b * t].view(b, t, -1), b, verified, path)
        # the accept kernels walk at least one draft; a row verifying none (verify length 1: a
        # request that opted out of drafting) keeps only its first token -- the argmax of its
        # anchor's logits, or speculative sampling's first token, which is distributed as the target's
        n = torch.minimum(n, s.verify_lens[:b])
        s.accepted[:b] = torch.where(self.offsets[None, :] < n[:, None], accepted, 0)
        s.accept_length[:b] = n
        self.readout[:b, t + 1] = verified
        self.advance(b, t)

    def _tree_commit(self, b: int, path: LogitsPath) -> None:
        """Tree acceptance -- greedy (the longest root path the target's argmax follows) or, with
        sampled rows, sampled (``K.sampled_tree_accept``: lossless, keyed by seed and anchor position;
        a greedy row's one-hot distribution walks its argmax path) -- then the accepted path's K/V,
        captures and logits moved to consecutive positions, and advance."""
        s, size, p = self.state, self.verify_len, self.num_drafts
        logits = self.logit_rows[: b * size].view(b, size, -1)
        tree = K.TreeBatch(s.tree_tokens[:b], s.tree_parents[:b], s.tree_depths[:b], None, None, s.tree_nodes[:b],
                           None, None)
        if path.sampled:
            window = Window.tree(s.tree_tokens[:b], s.tree_depths[:b], s.tree_bits[:b])  # a node after its path
            probs = self._sampling(b, path).probabilities(logits, window, workspace=self.workspace)
            uniforms = K.request_uniforms(s.seeds[:b], s.anchor_pos[:b], K.PURPOSE_TREE,
                                          (p + 1) * (self.tree.top_k + 1)).view(b, p + 1, self.tree.top_k + 1)
            accepted, nodes, n = K.sampled_tree_accept(probs, tree, uniforms, max_depth=p)
        else:
            accepted, nodes, n = K.greedy_tree_accept(logits, tree, max_depth=p)
        s.accepted[:b], s.accept_length[:b] = accepted, n
        self.tree_nodes_accepted[:b] = nodes
        # path position i (0: the root) holds node index[:, i] (i <= P); fixed shapes, so a graph holds it
        width = min(size, p + 1)
        keep = self.offsets[:width].long()
        index = keep.repeat(b, 1)
        index[:, 1:] = torch.where(nodes[:, :width - 1] >= 0, nodes[:, :width - 1].long(), index[:, 1:])
        slots = s.slot_ids[:b, None].expand(b, width).reshape(-1)
        base = s.anchor_pos[:b, None].long()
        src, dst = (self.cache.index(slots, (base + i).reshape(-1)) for i in (index, keep))
        for cache in (self.cache.k, self.cache.v):
            cache[:, dst[0], dst[1]] = cache[:, src[0], src[1]]
        for rows in (self.capture_rows, self.logit_rows):
            view = rows[: b * size].view(b, size, -1)
            view[:, :width] = view.gather(1, index[..., None].expand(-1, -1, view.shape[-1]))
        self.readout[:b, size + 1] = s.tree_nodes[:b] - 1
        self.advance(b, size)

    def _accept(self, logits, b: int, verified, path: LogitsPath):
        """Accept rows ``0 .. b-1`` from their target logits ``[b, P+1, V]``, verifying ``verified``
        drafts each (rows past a row's length are never read). With sampled rows every row takes
        speculative sampling: a greedy row's one-hot target distribution accepts exactly the drafts
        that equal its argmax and then emits the argmax, whatever its drafts' q. A plain greedy batch
        takes the argmax of the raw logits (no row has a bias or a penalty there)."""
        s, p = self.state, self.num_drafts
        drafts = s.draft_tokens[:b]
        if not path.sampled:
            return K.greedy_accept(logits, drafts, verified, p, workspace=self.workspace)
        seeds, anchor_pos = s.seeds[:b], s.anchor_pos[:b]
        uniforms = torch.empty(b, 2 * p + 1, device=self.device)
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_ACCEPT, p, out=uniforms[:, :p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_RESIDUAL, p, out=uniforms[:, p:2 * p])
        K.request_uniforms(seeds, anchor_pos, K.PURPOSE_BONUS, 1, out=uniforms[:, 2 * p:])
        window = Window.chain(torch.cat([s.anchor[:b, None], drafts], 1))  # position j follows drafts 1..j
        probs = self._sampling(b, path).probabilities(logits, window, workspace=self.workspace)
        return K.probabilistic_accept(probs, s.draft_probs[:b], drafts, verified, uniforms, p,
                                      workspace=self.workspace)

    def _sampling(self, b: int, path: LogitsPath) -> RowSampling:
        """Rows ``0 .. b-1``'s settings, with their slots' penalty state on the ``PENALISED`` path."""
        return self.state.sampling(b, self.penalties if path is LogitsPath.PENALISED else None)

    def advance(self, b: int, verify_len: int) -> None:
        """Commit the accepted prefix on the device: the caches' lengths are the anchor positions, the
        tokens join their slots' penalty state (padding rows' none)."""
        s = self.state
        n = s.accept_length[:b]
        self.penalties.commit(s.slot_ids[:b], s.accepted[:b, :verify_len], n * s.active[:b])
        self.readout[:b, :verify_len] = s.accepted[:b, :verify_len]
        self.readout[:b, self.verify_len] = n
        s.ctx_pos[:b] = s.anchor_pos[:b]
        s.anchor[:b] = s.accepted[:b].gather(1, (n - 1).long()[:, None]).squeeze(1)
        s.anchor_pos[:b] += n * s.active[:b]  # padding rows stay at position 0


def pad_requests(b: int, t: int, full: bool = False) -> int:
    """Padding requests of a ragged verify in bucket ``b``: its padding tokens go to requests of at
    most ``t`` tokens on the dummy line, so attention sees rows of <= t queries. A verify of a
    multiple of ``b`` tokens pads fewer than ``b``; one padded to the ``full`` ``b * t`` (a mixed
    step with many chunk tokens) up to ``b * (t - 1)``."""
    return b if full else -(-b // t)


def sample_rows(logits: torch.Tensor, sampling: RowSampling | None, seeds: torch.Tensor, positions: torch.Tensor,
                 workspace=None):
    """One target token per row (int32 ``[R]``) from f32 logits ``[R, V]``: the argmax when every row
    is plain greedy (``sampling`` None), else an inverse-CDF draw keyed by (seed, position) from each
    row's distribution through the request stage (a greedy row's is the one-hot argmax of its biased
    logits)."""
    if sampling is None:
        return logits.argmax(-1).to(torch.int32)
    uniforms = K.request_uniforms(seeds, positions, K.PURPOSE_TARGET_SAMPLE, 1)
    token = torch.zeros(logits.shape[0], 1, dtype=torch.int32, device=logits.device)
    K.sample_probability_rows(sampling.probabilities(logits, workspace=workspace), uniforms, token, 0,
                              workspace=workspace)
    return token[:, 0]
