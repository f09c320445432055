"""``DSparkProposer``: the draft pass of a step -- the one speculative method the runner knows.

After the target pass of a step, every row's draft context is brought up to date (the drafter's K/V
of the verified positions, projected from the target's captured hidden states), then one parallel
forward drafts a block per row, the Markov head corrects it position by position, the confidence
head scores it, and the scheduler's proposal length is chosen (``Drafter.propose_rows``); in tree
mode the drafter's per-depth candidates grow each row's next token tree. Everything runs on the
device with fixed shapes per batch bucket (the runner replays it as a CUDA graph) and writes the
runner's row state: the next round's drafts, their distributions, confidences and proposal
lengths, and the readout's proposal columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels as K
from ..model.draft_runner import DraftRunner, draft_cache
from .drafting import Drafter
from .penalties import PenaltyState
from .rows import LogitsPath, RowState, TreeSettings
from .structured import apply_bitmask

__all__ = ["DSparkProposer", "Redrafts"]


class DSparkProposer:
    """The draft pass over ``state`` (the runner's rows), drafting with ``drafter`` over paged draft
    K/V (``paged`` = ``(num_blocks, block_size, block_table)``: the target's block table, so a block
    id names both caches' K/V); ``readout``: the runner's readout rows (its ``columns``);
    ``max_model_len``: a tree never grows past it; ``vocab_size``: the target's."""

    def __init__(self, drafter: Drafter, state: RowState, penalties: PenaltyState, readout: torch.Tensor,
                 columns: dict[str, slice], paged: tuple, verify_len: int, max_model_len: int,
                 tree: TreeSettings | None, vocab_size: int):
        self.drafter, self.state, self.penalties = drafter, state, penalties
        self.readout, self.columns = readout, columns
        self.draft = DraftRunner(drafter.model, draft_cache(drafter.model, paged=paged))
        self.verify_len, self.max_model_len, self.tree = verify_len, max_model_len, tree
        device = state.anchor.device
        self.offsets = torch.arange(verify_len, dtype=torch.int32, device=device)
        if tree is not None:  # the drafter's depth rows of every batch row, which the trees grow from
            rows, p = readout.shape[0] - 1, drafter.num_draft_tokens
            self.stacked = torch.zeros(rows, p + 1, vocab_size, device=device)

    def write_context(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Draft context K/V of ``M`` tokens: captured target states ``[M, m*H]`` at ``positions`` /
        cache lines ``slots`` int ``[M]`` (a prompt chunk's tokens)."""
        self.draft.context(hidden, positions, slots)

    def context_rows(self, b: int) -> None:
        """The draft context of the last verify of rows ``0 .. b-1``: each row's captured states at
        their positions (those past the accepted prefix lie beyond the anchor, unseen, and are
        rewritten later)."""
        s, t = self.state, self.verify_len
        positions = (s.ctx_pos[:b, None] + self.offsets[:t]).view(-1)
        self.draft.context(s.capture[:b].reshape(b * t, -1), positions, s.slot_ids[:b].repeat_interleave(t))

    def propose_rows(self, b: int, path: LogitsPath) -> None:
        """The draft pass of rows ``0 .. b-1``: context, block, Markov chain, confidences, proposal
        lengths, trees (sampled: drafts drawn from each row's distribution, keyed by seed and anchor
        position; a tree is always grown from the greedy chain's depth rows). ``publish`` then puts
        the proposals in the readout."""
        s, p = self.state, self.drafter.num_draft_tokens
        self.context_rows(b)
        hidden = self.draft.block(s.anchor[:b], s.anchor_pos[:b], s.slot_ids[:b])
        s.block_hidden[:b] = hidden.view(b, self.drafter.block_size, -1)  # what ``redraft`` drafts again from
        logits = self.drafter.model.backbone_logits(hidden)
        self._mask_drafts(b, logits)
        sampling = uniforms = None
        if path.sampled and self.tree is None:
            sampling = s.sampling(b, self.penalties if path is LogitsPath.PENALISED else None)
            uniforms = K.request_uniforms(s.seeds[:b], s.anchor_pos[:b], K.PURPOSE_PROPOSAL, p)
        stacked = self.stacked[:b] if self.tree is not None else None
        bias = s.logit_bias[:b] if path.sampled else None  # a plain greedy batch has none: its rows' are zero
        proposal = self.drafter.propose_rows(hidden, logits, s.anchor[:b], sampling, uniforms, stacked, bias)
        s.draft_tokens[:b] = proposal.token_ids
        s.proposal_lengths[:b] = proposal.proposal_lengths
        if proposal.confidence is not None:
            s.confidence[:b] = proposal.confidence
        if proposal.probabilities is not None:
            s.draft_probs[:b] = proposal.probabilities
        if self.tree is not None:
            self._grow_trees(b)

    def _mask_drafts(self, b: int, logits: torch.Tensor) -> None:
        """Each row's grammar masks of its block slots (``state.draft_mask``, slot k + offset: draft
        position k's; every bit set for a free row and where a constrained row's state depends on
        the drafts) on the block's backbone logits ``[b * N, V]``, in place: the Markov correction is
        additive, so the corrected logits (and a sampled draft's q, the distribution it is drawn
        from) carry them."""
        apply_bitmask(logits, self.state.draft_mask[:b].view(b * self.drafter.block_size, -1))

    def redrafts(self) -> "Redrafts":
        """A round's greedy redrafts (``Redrafts``), for the host's grammar walk."""
        return Redrafts(self)

    def publish(self, b: int) -> None:
        """Rows ``0 .. b-1``'s proposal lengths and confidences into the readout."""
        s = self.state
        self.readout[:b, self.columns["proposal_length"]] = s.proposal_lengths[:b, None]
        self.readout[:b, self.columns["confidence"]] = s.confidence[:b].view(torch.int32)

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


@dataclass
class _Chain:
    """A row's Markov chain between ``Redrafts`` calls: the next ``position`` whose bias it gives,
    the token before it (``prev``), the Markov state there (an rnn head's ``[R]``, else None) and
    the backbone logits of the row's draft slots (f32 ``[P, V]``, one ``lm_head`` pass per row and
    round)."""

    position: int
    prev: int
    state: torch.Tensor | None
    backbone: torch.Tensor


class Redrafts:
    """One round's greedy drafts made again outside the draft pass (``walk_windows`` asks position by
    position): row ``rows[i]``'s draft at ``positions[i]`` after the drafts ``prefixes[i]`` before it
    (its own tokens, which may differ from what the pass drafted) is the argmax of the drafter's
    Markov-corrected logits there -- the chain stepped from the row's anchor through ``prefixes[i]``
    over the block hidden states the last draft pass kept -- masked by ``masks`` int32
    ``[len(rows), width]`` (host). A greedy row's acceptance never reads how its drafts were made,
    so any draft keeps it exact; these are the drafter's best guesses under the grammar. A row that
    redrafts a position redrafts every later one: its chain is kept between calls, so a call steps
    it from where it stopped (from the anchor only the first time). One host read per call."""

    def __init__(self, proposer: DSparkProposer):
        self.proposer, self.chains = proposer, {}

    def __call__(self, rows: list[int], positions: list[int], prefixes: list[list[int]],
                 masks: torch.Tensor) -> list[int]:
        s, model = self.proposer.state, self.proposer.drafter.model
        offset, device = self.proposer.drafter.slot_offset, s.anchor.device
        index = torch.tensor(rows, device=device)
        hidden = s.block_hidden[index]  # [n, N, H]
        kept = [self.chains.get(row) for row in rows]
        starts = [0 if c is None or c.position > at else c.position for c, at in zip(kept, positions)]
        prev = s.anchor[index].clone()
        state = model.markov_start_state(hidden[:, 0], prev)
        for i, (chain, start) in enumerate(zip(kept, starts)):
            if start:  # the kept chain's token and state
                prev[i] = chain.prev
                if state is not None:
                    state[i] = chain.state
        first, last = min(starts), max(positions)
        tokens = torch.tensor([prefix[:last] + [0] * (last - min(len(prefix), last)) for prefix in prefixes],
                              dtype=torch.int32, device=device).view(len(rows), last)
        begin, at = torch.tensor(starts, device=device), torch.tensor(positions, device=device)
        bias = None
        for step in range(first, last + 1):  # each row from its start to its own position
            live = (begin <= step) & (step <= at)
            step_bias, after = model.markov_bias(hidden[:, step + offset], prev, state)
            bias = step_bias if bias is None else torch.where((at == step)[:, None], step_bias, bias)
            if state is not None:
                state = torch.where(live[:, None], after, state)
            if step < last:
                prev = torch.where(live & (step < at), tokens[:, step].to(prev.dtype), prev)
        backbone = self._backbone(kept, starts, hidden[:, offset:])
        logits = torch.stack([table[position] for table, position in zip(backbone, positions)]) + bias
        apply_bitmask(logits, masks.to(device))
        drafted = logits.argmax(-1).tolist()
        for i, (row, position, token) in enumerate(zip(rows, positions, drafted)):
            self.chains[row] = _Chain(position + 1, token, None if state is None else state[i].clone(), backbone[i])
        return drafted

    def _backbone(self, kept: list, starts: list[int], slots: torch.Tensor) -> list[torch.Tensor]:
        """Each row's backbone logits of its draft slots (``slots`` ``[n, P, H]``): a kept chain's,
        the others' from one ``lm_head`` pass."""
        fresh = [i for i, start in enumerate(starts) if not start]
        tables = [kept[i].backbone if start else None for i, start in enumerate(starts)]
        if fresh:
            model = self.proposer.drafter.model
            block = model.backbone_logits(slots[fresh].reshape(-1, slots.shape[-1]))
            block = block.view(len(fresh), slots.shape[1], -1)
            for j, i in enumerate(fresh):
                tables[i] = block[j]
        return tables
