"""``RoundPlanning``: what each round verifies and whether it drafts (``LLMEngine`` inherits it).

Before a step, ``_plan_round`` gives each running row its verify length (drafts + 1) from the
scheduler (``off`` / ``threshold`` / ``sps`` per row, ``cost`` across the batch: ``schedulers``)
on its signal -- the drafter's confidences or the online acceptance estimates
(``schedule_signal``) -- and, under the ``cost`` scheduler, whether the step drafts the next round
or the engine decodes plainly; after a step ``_count_round`` keeps what that choice reads (whether
the rows hold drafts, the run of plain rounds, the measured host times). It reads the engine's
``config``, ``scheduler``, ``runner``, ``metrics``, ``acceptance``, ``cost_table``, ``num_drafts``,
``max_model_len`` and ``max_num_batched_tokens``, takes the last draft pass's confidences
(``_unread``, ``_take_proposals``), and keeps ``_drafted``, ``_plain_rounds``, ``_redraft_doublings``,
``_redrafted``, ``_plain_rows``, ``_full_rounds_left`` and ``_host_ms`` (set where the engine is built).

The confidences are this round's, left by the last step's draft pass: reading them waits for it.
Where the cost scheduler verifies every draft whatever they are (``full_verify_wins``: the flat
start of the cost curve, a few rows), the verify lengths need none, so the step's target pass is
queued first and the drafting choice -- the only one that reads them -- is made between the
target pass and the draft pass (``StepPlan.draft`` a callable): the same choice, without the
device idling while the host waits, plans and launches. A little further up the curve -- where
verifying every draft takes at most ``FULL_CHOICE_MARGIN`` longer than any round that verifies
one draft a row or more -- once Algorithm 1 has verified every draft of every row, the next
``FULL_CHOICE_STEPS`` rounds do so as well without waiting: lengths chosen before this round's
confidences exist are as lossless as fixed blocks (nothing a round verifies depends on its own
drafts), with confident drafts Algorithm 1 keeps choosing them anyway, and a held round loses at
most that margin where the confidences fell. Further up (many rows) trimming gains more than the
wait costs, and every round plans.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .. import kernels as K
from .request import Sequence
from .schedulers import batch_schedule, drafting_pays, full_verify_wins

__all__ = ["FULL_CHOICE_MARGIN", "FULL_CHOICE_STEPS", "HOST_EMA", "PLAIN_CHOICE_SHRINK", "REDRAFT_DOUBLINGS",
           "REDRAFT_STEPS", "RoundPlanning"]

REDRAFT_STEPS = 16  # plain rounds in a row after which the cost scheduler drafts again (fresh confidences)
# each such round that finds drafting still does not pay doubles the wait, up to 16 x 2^4 = 256 plain
# rounds: at high load each costs a draft pass and a verify of every row (about 7 % of a 256-row
# H200 step's time at 16) and rarely finds anything new
REDRAFT_DOUBLINGS = 4
# in plain rounds the choice stands until the drafting rows fall below this share of those it was
# made for (then it is made again: drafting pays sooner on fewer rows)
PLAIN_CHOICE_SHRINK = 0.875
# rounds that verify every draft without planning after Algorithm 1 chose that for every row, where
# that round is within FULL_CHOICE_MARGIN of the fastest: the plan waits for the draft pass, the
# device idle meanwhile (0.33 ms of a 9 ms H100 step at 16 rows, where the full round is 11 % slower
# than the fastest; 16 % on an H200); at 64 rows (62 %) holding it cost 4 % against fixed blocks
FULL_CHOICE_STEPS = 8
FULL_CHOICE_MARGIN = 0.2
HOST_EMA = 0.1  # weight of the newest step in the host-time averages of the cost scheduler


class RoundPlanning:
    """The round's verify lengths and drafting choice (before a step) and what they read (after it)."""

    def _count_round(self, drafted: bool, host_s: float, captured: bool = False) -> None:
        """After a step: whether the rows hold drafts, the run of plain rounds, and (on a GPU) the
        average host time of the step's kind (drafting or plain) that the cost scheduler prices --
        not from a step that captured a graph (a one-off of tens of milliseconds, which would make
        drafting look unprofitable for many steps after)."""
        self._drafted = drafted
        self._plain_rounds = 0 if drafted else self._plain_rounds + 1
        self.metrics.plain_steps += not drafted and self.runner.drafter is not None
        self.metrics.graph_captures = self.runner.captures
        if self.runner.device.type == "cuda":  # a leak per request shows here (no synchronisation)
            self.metrics.device_memory = torch.cuda.memory_allocated(self.runner.device)
        if self.runner.device.type != "cuda" or captured:  # on the CPU the table prices the compute
            return
        kind = 0 if drafted else 1
        average = self._host_ms[kind]
        self._host_ms[kind] = 1000 * host_s if not average else (1 - HOST_EMA) * average + HOST_EMA * 1000 * host_s

    def _plan_round(self, outputs: list) -> tuple[list[int] | None, bool | Callable[[], bool]]:
        """This round's verify tokens per running row (None: a plain round, the rows hold no drafts)
        and whether it drafts the next round: always, except under the ``cost`` scheduler when no
        round Algorithm 1 would run on the rows' latest confidences is predicted to beat plain
        decoding (``drafting_pays``: verify, draft pass and measured host times) -- then the engine
        decodes plainly, drafting again after ``REDRAFT_STEPS`` plain rounds to refresh the
        confidences (twice as many after each such round that found drafting still does not pay,
        at most ``REDRAFT_DOUBLINGS`` times; back to ``REDRAFT_STEPS`` once it pays). That choice is
        a callable when the verify lengths need no confidence (module docstring). A failed draft
        pass fails the running rows (none left: a plain plan)."""
        if self.config.scheduler != "cost":
            if not self._proposals_taken(outputs):
                return None, True
            return (self._verify_lens(self._scheduled_drafts()) if self._drafted else None), True
        running = self.scheduler.running
        drafting = [i for i, seq in enumerate(running) if not seq.request.disable_spec_decode]
        if not drafting:  # every row opted out of drafting: plain rounds
            return None, False
        if self._plain_choice_holds(len(drafting)):
            return None, False
        # Algorithm 1 across the drafting rows on their signal (STS-calibrated confidences or the
        # online estimates) and the profiled cost table; the opted-out rows' anchors and the step's
        # prompt chunks share the forward (the chunks: at most what the budget leaves the longest verify)
        pending = sum(seq.prefill_len - seq.prefilled for seq in self.scheduler.prefilling)
        prefill = min(pending, max(0, self.max_num_batched_tokens - len(running) * (self.num_drafts + 1)))
        others = prefill + len(running) - len(drafting)
        gain, p = self.config.min_predicted_gain, self.num_drafts
        if self._unread and (self._holds_full_choice(len(drafting), others - prefill)
                             or full_verify_wins(self.cost_table, len(drafting), p, gain, self._host_ms[0], others)):
            lengths = [p] * len(drafting)
            return self._drafted_lens(drafting, lengths), lambda: self._drafting_pays(drafting, lengths, others)
        if not self._proposals_taken(outputs):
            return None, True
        signal = self._acceptance_signal([running[i] for i in drafting])
        scheduled = batch_schedule(signal, self.cost_table, gain, self._host_ms[0], others)
        self._full_rounds_left = FULL_CHOICE_STEPS if self._drafted and min(scheduled) == p else 0
        return self._drafted_lens(drafting, scheduled), self._drafting_pays(drafting, scheduled, others, signal)

    def _plain_choice_holds(self, rows: int) -> bool:
        """Whether a plain round's choice to go on decoding plainly stands without planning again:
        the rows hold no drafts, no refresh is due, and the drafting rows have not fallen below
        ``PLAIN_CHOICE_SHRINK`` of those it was made for -- the confidences it read are the same
        (no draft pass since), and drafting pays sooner on fewer rows. Planning took 0.67 ms a
        step at 256 rows (``bench.host --plan``), on the host while the device waits."""
        return (not self._drafted and self._plain_rows is not None
                and not self._refresh_due()
                and rows >= PLAIN_CHOICE_SHRINK * self._plain_rows)

    def _holds_full_choice(self, rows: int, others: int) -> bool:
        """Whether this round verifies every draft on a held choice (module docstring): rounds of
        one are left, the rows hold drafts, and the full round of these ``rows`` (beside ``others``
        opted-out rows' tokens) is within ``FULL_CHOICE_MARGIN`` of the fastest -- checked each
        round, as the rows change while a choice is held (at a ramp to 64 rows, a choice made at
        24), and without the step's prompt chunks, which come and go (they dilute the margin: at 56
        rows beside 1,500 prompt tokens verifying every draft is within 11 % of the fastest on an
        H100's table, 63 % without them)."""
        if not (self._drafted and self._full_rounds_left > 0):
            return False
        self._full_rounds_left -= 1
        held = full_verify_wins(self.cost_table, rows, self.num_drafts, FULL_CHOICE_MARGIN, self._host_ms[0], others)
        self.metrics.held_rounds += held
        return held

    def _refresh_due(self) -> bool:
        """Whether plain rounds have run long enough to draft again for fresh confidences."""
        return self._plain_rounds >= REDRAFT_STEPS << self._redraft_doublings

    def _drafted_lens(self, drafting: list[int], scheduled: list[int]) -> list[int] | None:
        """The verify lengths of the running rows when rows ``drafting`` verify ``scheduled`` drafts
        (the others none; None: a plain round)."""
        if not self._drafted:
            return None
        drafts = [0] * len(self.scheduler.running)
        for i, n in zip(drafting, scheduled):
            drafts[i] = n
        return self._verify_lens(drafts)

    def _drafting_pays(self, drafting: list[int], scheduled: list[int], others: int,
                       signal: np.ndarray | None = None) -> bool:
        """Whether the step drafts the next round (``_plan_round``) -- taking the proposals first
        (``signal``: the drafting rows' acceptance signal, where the plan read it already)."""
        self._take_proposals()
        if self._refresh_due():
            self._redrafted, self._plain_rows = True, None
            return True
        if signal is None:
            signal = self._acceptance_signal([self.scheduler.running[i] for i in drafting])
        # a plain round's host time is its own measurement, 0 until one ran: priced at a drafting round's
        # (12-15 ms a step at 256 rows on an H100) no plain round would run to measure it
        pays = drafting_pays(signal, self.cost_table, self.config.min_predicted_gain, tuple(self._host_ms), scheduled,
                             others)
        self._plain_rows = None if pays else len(drafting)
        if pays:
            self._redraft_doublings = 0
        else:
            self._full_rounds_left = 0  # after plain rounds, Algorithm 1 plans the first verify again
            if self._redrafted:  # the fresh confidences did not make drafting pay: wait longer next time
                self._redraft_doublings = min(self._redraft_doublings + 1, REDRAFT_DOUBLINGS)
        self._redrafted = False
        return pays

    def _acceptance_signal(self, rows: list[Sequence]) -> np.ndarray:
        """Each draft's conditional acceptance for ``rows`` ``[R, P]``: the drafter's confidences of
        their pending proposals, or the online estimator's estimates (``schedule_signal``). A row
        seated by a step that did not draft has no confidences yet: it takes the other rows' mean
        (all ones where none has any: drafting again finds out), which only the choice to draft reads
        -- rows that hold no drafts verify none."""
        if self.acceptance is not None:
            return self.acceptance.estimate([seq.slot for seq in rows])
        confidences = [seq.confidence for seq in rows]
        known = [c for c in confidences if c is not None]
        if len(known) == len(confidences):  # the usual case: no mean to take
            return np.stack(known)
        prior = np.mean(known, axis=0) if known else np.ones(self.num_drafts, dtype=np.float32)
        return np.stack([prior if c is None else c for c in confidences])

    def _scheduled_drafts(self) -> list[int]:
        """Drafts per running row under the ``off`` / ``threshold`` / ``sps`` schedulers: the drafter's
        proposal lengths, or on the online signal the same rule on the estimates."""
        running = self.scheduler.running
        if self.config.scheduler == "off":
            return [self.num_drafts] * len(running)
        if self.acceptance is None:
            return [seq.next_length for seq in running]
        rule = K.threshold_proposal_lengths if self.config.scheduler == "threshold" else K.sps_proposal_lengths
        estimate = torch.from_numpy(self._acceptance_signal(running)).float()
        return rule(estimate, self.config.threshold, min_proposal_len=self.config.min_proposal_len,
                    max_proposal_len=self.config.max_proposal_len).tolist()

    def _verify_lens(self, drafts: list[int]) -> list[int]:
        """Verify tokens per running row (drafts + 1), never past what the row may still produce (its
        ``max_new_tokens``, the context limit): a draft there could not be kept, and its position
        would lie beyond the context. At least one draft (the accept kernels walk >= 1), none for a
        request that opted out of drafting (``disable_spec_decode``: the verifier keeps its first
        token only); a tree verifies all its nodes (its depth is bounded where it is grown)."""
        if self.runner.tree is not None:
            return [self.runner.verify_len] * len(self.scheduler.running)
        return [1 + (0 if seq.request.disable_spec_decode else max(1, min(n, seq.room(self.max_model_len) - 1)))
                for n, seq in zip(drafts, self.scheduler.running)]
