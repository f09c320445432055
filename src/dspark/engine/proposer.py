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

import torch

from .. import kernels as K
from ..model.draft_runner import DraftRunner, draft_cache
from .drafting import Drafter
from .penalties import PenaltyState
from .rows import LogitsPath, RowState, TreeSettings
from .structured import apply_bitmask

__all__ = ["DSparkProposer"]


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

    def context_rows(self, b: int, t: int | None = None) -> None:
        """The draft context of the last verify of rows ``0 .. b-1``: each row's captured states at
        its first ``t`` verify positions (default: all; a plain round's 1, its anchor -- the others
        lie beyond it, unseen, and are rewritten later, as those past an accepted prefix)."""
        s, t = self.state, t or self.verify_len
        positions = (s.ctx_pos[:b, None] + self.offsets[:t]).view(-1)
        self.draft.context(s.capture[:b, :t].reshape(b * t, -1), positions, s.slot_ids[:b].repeat_interleave(t))

    def propose_rows(self, b: int, path: LogitsPath) -> None:
        """The draft pass of rows ``0 .. b-1``: context, block, Markov chain, confidences, proposal
        lengths, trees (sampled: drafts drawn from each row's distribution, keyed by seed and anchor
        position; a tree is always grown from the greedy chain's depth rows). ``publish`` then puts
        the proposals in the readout."""
        s, p = self.state, self.drafter.num_draft_tokens
        self.context_rows(b)
        hidden = self.draft.block(s.anchor[:b], s.anchor_pos[:b], s.slot_ids[:b])
        logits = self.drafter.model.backbone_logits(hidden)
        self._mask_drafts(b, logits)
        sampling = uniforms = None
        if path.sampled and self.tree is None:
            sampling = s.sampling(b, self.penalties if path is LogitsPath.PENALISED else None)
            uniforms = K.request_uniforms(s.seeds[:b], s.anchor_pos[:b], K.PURPOSE_PROPOSAL, p)
        stacked = self.stacked[:b] if self.tree is not None else None
        bias = s.logit_bias[:b] if path.sampled else None  # a plain greedy batch has none: its rows' are zero
        # sampled drafts' distributions go straight to the rows' buffer (a copy would move 2 * b * P * V floats)
        out = s.draft_probs[:b] if sampling is not None else None
        proposal = self.drafter.propose_rows(hidden, logits, s.anchor[:b], sampling, uniforms, stacked, bias, out)
        s.draft_tokens[:b] = proposal.token_ids
        s.proposal_lengths[:b] = proposal.proposal_lengths
        if proposal.confidence is not None:
            s.confidence[:b] = proposal.confidence
        if self.tree is not None:
            self._grow_trees(b)

    def _mask_drafts(self, b: int, logits: torch.Tensor) -> None:
        """Each row's grammar masks of its block slots (``state.draft_mask``, slot k + offset: draft
        position k's; every bit set for a free row and where a constrained row's state depends on
        the drafts) on the block's backbone logits ``[b * N, V]``, in place: the Markov correction is
        additive, so the corrected logits (and a sampled draft's q, the distribution it is drawn
        from) carry them."""
        apply_bitmask(logits, self.state.draft_mask[:b].view(b * self.drafter.block_size, -1))

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
