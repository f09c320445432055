"""``OnlineAcceptance``: the online acceptance estimator, the schedulers' alternative signal to the
confidence head (``EngineConfig.schedule_signal = "online"``).

A verified round of a chain tells, for each position j up to its first rejection, whether draft j
was accepted given that drafts ``< j`` were: positions before the first rejection were, the first
rejection was not, and nothing is known past it or past the drafts verified. The estimator keeps
exponentially weighted counts of these outcomes per cache slot (the request in it) and pooled over
every request, and estimates the conditional acceptance of a request's position j as its own counts
shrunk towards the pooled rate::

    c[r, j] = (hits[r, j] + k * pooled[j]) / (trials[r, j] + k)
    pooled[j] = (H[j] + k0 * prior) / (T[j] + k0)

Each round of a request multiplies its counts by ``decay`` (the pooled ones by ``pooled_decay`` per
step), so a position the scheduler stopped verifying drifts back to the pooled rate as its evidence
ages and is verified again. ``prior`` 1.0 (optimistic): until something is observed every draft is
worth verifying, as under fixed blocks. Host-side numpy on what each step's readout brings anyway
(accept lengths, drafts verified): no device work, no extra synchronisation -- and a scheduler on
this signal needs nothing from the draft pass, so the next step is planned while it runs.
"""

from __future__ import annotations

import numpy as np

from ..kernels._validate import Checker

__all__ = ["OnlineAcceptance", "round_outcomes", "ROW_DECAY", "ROW_PRIOR_WEIGHT", "POOLED_DECAY"]

ROW_DECAY = 0.9  # weight of a request's past rounds after each new one (about 10 rounds of memory)
ROW_PRIOR_WEIGHT = 2.0  # the pooled rate counts as this many of a request's own observations
POOLED_DECAY = 0.99  # weight of the pooled counts after each step
PRIOR_WEIGHT = 1.0  # the initial prior counts as this many pooled observations


def round_outcomes(num_drafts: int, verified: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What rounds observed: ``(tried, hit)`` float64 ``[R, P]`` -- position j was verified with drafts
    ``< j`` accepted, and was accepted -- from the drafts each round verified and accepted (int
    ``[R]``, ``accepted <= verified``)."""
    k = np.arange(num_drafts)[None, :]
    accepted = np.minimum(accepted, verified)[:, None]
    tried = k < np.minimum(verified[:, None], accepted + 1)
    return tried.astype(np.float64), (k < accepted).astype(np.float64)


class OnlineAcceptance:
    """Per-slot and pooled estimates of the conditional acceptance of each draft position
    (module docstring). ``slots``: cache slots (rows of the count arrays); ``num_drafts`` P."""

    def __init__(self, slots: int, num_drafts: int, *, decay: float = ROW_DECAY,
                 prior_weight: float = ROW_PRIOR_WEIGHT, pooled_decay: float = POOLED_DECAY, prior: float = 1.0):
        c = Checker("OnlineAcceptance")
        c.integer("slots", slots, low=1)
        self.num_drafts = c.integer("num_drafts", num_drafts, low=1)
        for name, value in (("decay", decay), ("pooled_decay", pooled_decay), ("prior", prior)):
            c.real(name, value, low=0.0, high=1.0)
        if c.real("prior_weight", prior_weight, low=0.0) <= 0.0:
            c.fail(f"prior_weight must be > 0, got {prior_weight}")
        self.decay, self.prior_weight, self.pooled_decay = float(decay), float(prior_weight), float(pooled_decay)
        self.hits = np.zeros((slots, num_drafts))
        self.trials = np.zeros((slots, num_drafts))
        self.pooled_hits = np.full(num_drafts, PRIOR_WEIGHT * prior)
        self.pooled_trials = np.full(num_drafts, PRIOR_WEIGHT)

    def reset(self, slot: int) -> None:
        """A new request takes ``slot``: it starts from the pooled rate."""
        self.hits[slot] = 0.0
        self.trials[slot] = 0.0

    def observe(self, slots: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """One step's rounds: row i (cache slot ``slots[i]``, each once) verified ``verified[i]``
        drafts and accepted ``accepted[i]`` of them (int ``[R]``). A row that verified none (a plain
        round, a request that opted out of drafting) observed nothing: its counts stay as they are."""
        verified, accepted, slots = np.asarray(verified), np.asarray(accepted), np.asarray(slots)
        rows = verified > 0
        if not rows.any():  # a plain round: nothing to update (the pooled ratio would not move either)
            return
        tried, hit = round_outcomes(self.num_drafts, verified[rows], accepted[rows])
        slots = slots[rows]
        self.hits[slots] = self.decay * self.hits[slots] + hit
        self.trials[slots] = self.decay * self.trials[slots] + tried
        self.pooled_hits = self.pooled_decay * self.pooled_hits + hit.sum(0)
        self.pooled_trials = self.pooled_decay * self.pooled_trials + tried.sum(0)

    @property
    def pooled(self) -> np.ndarray:
        """float64 ``[P]``: the pooled conditional acceptance of each position."""
        return self.pooled_hits / self.pooled_trials

    def estimate(self, slots) -> np.ndarray:
        """float64 ``[R, P]``: the conditional acceptance of each position for the requests in
        ``slots`` (int ``[R]``), what the schedulers read in place of the confidences."""
        slots = np.asarray(slots)
        k = self.prior_weight
        return (self.hits[slots] + k * self.pooled) / (self.trials[slots] + k)
