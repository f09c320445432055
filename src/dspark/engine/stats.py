"""Statistics of one speculative ``generate`` call."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationStats:
    """Per-round records and the derived figures.

    Per round r: ``scheduled_lengths[r]`` drafts verified (P_v), ``accept_lengths[r]`` tokens the
    verification produced (accepted drafts + the bonus/correction token, in ``[1, P_v+1]``),
    ``committed[r]`` tokens appended to the output (fewer than ``accept_lengths[r]`` only when EOS
    or ``max_new_tokens`` cut the last round). ``prefill_tokens`` counts the token sampled from the
    prefill (1, or 0 when ``max_new_tokens`` is 0). ``cached_tokens``: prompt tokens whose K/V the
    prefix cache held (not run). Times are seconds.
    """

    num_drafts: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    scheduled_lengths: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    def record_round(self, scheduled: int, accepted: int, committed: int) -> None:
        self.scheduled_lengths.append(scheduled)
        self.accept_lengths.append(accepted)
        self.committed.append(committed)

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def generated_tokens(self) -> int:
        return self.prefill_tokens + sum(self.committed)

    @property
    def mean_accepted_length(self) -> float:
        """τ: mean tokens produced per verification round, bonus token included."""
        return sum(self.accept_lengths) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """Conditional acceptance of draft position k (1-based index k-1): among rounds that verified
        position k with positions 1..k-1 all accepted, the fraction accepting k (None if no trial)."""
        out = []
        for k in range(1, self.num_drafts + 1):
            trials = [a for a, s in zip(self.accept_lengths, self.scheduled_lengths) if s >= k and a >= k]
            out.append(sum(a > k for a in trials) / len(trials) if trials else None)
        return out

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def parts_timed(self) -> bool:
        """Whether draft and verify time were measured apart: on the CPU the engine times both parts
        of each round (steps that also ran prompt chunks excepted); a GPU round runs both without a
        host synchronisation between them, so they stay 0 there."""
        return bool(self.draft_time or self.verify_time) or not self.rounds

    def _part(self, seconds: float) -> float | None:
        return round(seconds, 6) if self.parts_timed else None

    def as_dict(self) -> dict:
        """The figures as JSON-ready values; τ and the mean verified drafts are None without a round."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "mean_accepted_length": round(self.mean_accepted_length, 4) if self.rounds else None,
            "acceptance_per_position": [None if a is None else round(a, 4) for a in self.acceptance_per_position],
            "scheduled_lengths": list(self.scheduled_lengths),
            "accept_lengths": list(self.accept_lengths),
            "mean_scheduled_length": round(sum(self.scheduled_lengths) / self.rounds, 4) if self.rounds else None,
            "prefill_time_s": round(self.prefill_time, 6),
            "draft_time_s": self._part(self.draft_time),
            "verify_time_s": self._part(self.verify_time),
            "total_time_s": round(self.total_time, 6),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


HOST_PHASES = ("plan", "launch", "commit")  # EngineMetrics.host_phases


class EngineMetrics:
    """Counters since the engine started (served as Prometheus metrics by ``dspark serve``)."""

    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts
        self.running = self.waiting = self.finished = 0  # running: with a cache slot (prefilling too, as vLLM)
        self.generated_tokens = 0
        self.rounds = 0  # per request
        self.steps = 0
        self.draft_tokens = 0  # drafts verified
        self.accepted_tokens = 0  # drafts accepted
        self.position_trials = [0] * num_drafts  # position k verified with 1..k-1 accepted
        self.position_accepts = [0] * num_drafts
        self.step_time = 0.0
        self.host_time = 0.0  # of step_time: all but waiting for the device's readout
        # host_time by phase: scheduling and admission (plan), the runner's staging and graph
        # launches (launch), committing the readout and retiring (commit)
        self.host_phases = dict.fromkeys(HOST_PHASES, 0.0)
        self.host_overlapped_time = 0.0  # of host_time: while the device still ran a draft pass (hidden)
        self.prompt_tokens = 0  # prompt tokens run in steps (chunks)
        self.row_tokens = 0  # the running rows' tokens run in steps (verify windows, or one a row in plain rounds)
        self.errors = 0  # requests the engine failed (finish reason "error")
        self.plain_steps = 0  # steps that did not draft the next round (the cost scheduler's fallback)
        self.held_rounds = 0  # steps that verified every draft on a held choice, without waiting for confidences
        self.graph_captures = 0  # CUDA graphs captured (a capture while serving stalls its step)
        self.capture_step_time = 0.0  # of step_time: the steps that captured a graph (a server captures first)
        self.device_memory = 0  # bytes torch's allocator holds for tensors on the engine's GPU (0 on the CPU)
        self.kv_blocks = self.kv_blocks_used = 0  # KV blocks (the null block aside) and those requests hold
        self.preemptions = 0  # requests taken out of the batch to run again later (KV blocks ran out)
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # prompt tokens looked up / found in the prefix cache

    def record_host(self, step: float, host: float, overlapped: float, **phases: float) -> None:
        """Seconds of one half of a step (launch or finish): in all, on the host, on the host while the
        device still ran a draft pass, and the host's per phase (``HOST_PHASES``)."""
        self.step_time += step
        self.host_time += host
        self.host_overlapped_time += overlapped
        for phase, seconds in phases.items():
            self.host_phases[phase] += seconds

    def record_rounds(self, verified: np.ndarray, accept_length: np.ndarray) -> None:
        """Count one step's speculative rounds: per row the drafts (tree nodes) it verified and its
        accept length (bonus included), int arrays ``[R]``."""
        self.rounds += len(verified)
        if not verified.any():  # a plain round: nothing verified, nothing accepted
            return
        accepted = np.minimum(accept_length - 1, verified)
        self.draft_tokens += int(verified.sum())
        self.accepted_tokens += int(accepted.sum())
        # position k was verified with k drafts accepted before it (a tree verifies more nodes than depths)
        k = np.arange(self.num_drafts)[None, :]
        tried = k < np.minimum(verified, accepted + 1)[:, None]
        trials, accepts = tried.sum(0).tolist(), (tried & (k < accepted[:, None])).sum(0).tolist()
        self.position_trials = [n + m for n, m in zip(self.position_trials, trials)]
        self.position_accepts = [n + m for n, m in zip(self.position_accepts, accepts)]

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0
