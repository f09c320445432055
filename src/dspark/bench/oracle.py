"""Benchmark drafts: an ``LLMEngine`` whose accepted drafts are controlled, so that speed can be
measured at a chosen acceptance on random-weight models (``bench.engine``, ``bench.replay``).

``OracleEngine`` takes each request's known greedy continuation (``add_request(request,
oracle_ids=...)``) and installs ``OracleDrafts`` as its runner's draft override: after the real
drafter ran (its cost is paid), every row's drafts are replaced on the device by the continuation's
tokens or by a token the target rejects (the continuation's id + 1):

* ``acceptance=a``: each draft kept with probability ``a`` (request-stable uniforms of their own
  purpose, keyed by seed and anchor position), so tau follows ``a``;
* ``replay=True``: round r of the request's ``oracle_trace`` (cycling) is ``[accepted drafts,
  confidence_1 .. confidence_P]`` -- a recorded round whose acceptance and confidences are replayed,
  and the drafter's scheduler computes its lengths from those confidences.

The target still verifies for real, so the output is the target's own greedy output whatever the
drafts. The continuation and trace of a request sit in its cache slot's buffers, staged when the
request gets its slot, so nothing moves with rows and the override is captured in the CUDA graphs.
"""

from __future__ import annotations

import torch

from .. import kernels as K
from ..engine import EngineConfig, LLMEngine, Request, RequestOutput
from ..kernels._validate import Checker

__all__ = ["OracleDrafts", "OracleEngine", "PURPOSE_ORACLE", "TRACE_ROUNDS"]

PURPOSE_ORACLE = 0x3C6EF372FE94F82B  # the controlled acceptance's uniforms: a stream of their own
TRACE_ROUNDS = 512  # replayed rounds kept per request (a longer trace is cut; rounds cycle)


class OracleDrafts:
    """The runner's draft override (``ModelRunner.draft_override``): per-slot continuations and
    traces, and ``apply``, the device ops that replace a round's drafts (module docstring)."""

    def __init__(self, runner, *, acceptance: float | None = None, replay: bool = False):
        i32 = dict(dtype=torch.int32, device=runner.device)
        slots, p = runner.max_batch + 1, runner.num_drafts
        self.acceptance, self.replay = acceptance, replay
        self.ids = torch.zeros(slots, runner.line + runner.verify_len, **i32)
        self.trace = torch.zeros(slots, TRACE_ROUNDS if replay else 1, p + 1, device=runner.device)
        self.trace_len = torch.ones(slots, **i32)
        self.trace_round = torch.zeros(slots, **i32)

    def buffers(self) -> list[torch.Tensor]:
        """What a round writes here (restored after a CUDA graph's warm-up run)."""
        return [self.ids, self.trace, self.trace_len, self.trace_round]

    def stage(self, slot: int, prompt_len: int, oracle_ids: list[int], trace: list[list[float]] | None) -> None:
        """A request's continuation (after its ``prompt_len`` prompt tokens) and trace into ``slot``."""
        known = torch.tensor(list(oracle_ids)[: self.ids.shape[1] - prompt_len], dtype=torch.int32)
        self.ids[slot].zero_()
        self.ids[slot, prompt_len: prompt_len + known.numel()] = known.to(self.ids.device)
        if trace is not None:
            rounds = torch.tensor(trace[:TRACE_ROUNDS], dtype=torch.float32)
            self.trace[slot, : rounds.shape[0]] = rounds.to(self.trace.device)
            self.trace_len[slot], self.trace_round[slot] = rounds.shape[0], 0

    def apply(self, runner, b: int) -> None:
        """Replace rows ``0 .. b-1``'s drafts (and, replaying, confidences and lengths); captured."""
        s, p = runner.state, runner.num_drafts
        slots = s.slot_ids[:b].long()
        truth = self.ids[slots].gather(1, (s.anchor_pos[:b, None] + 1 + runner.offsets[:p]).long())
        wrong = (truth + 1) % runner.target.vocab_size
        if self.replay:
            index = (self.trace_round[slots] % self.trace_len[slots]).long()
            entry = self.trace[slots, index]
            keep = runner.offsets[:p].float() < entry[:, :1]
            s.confidence[:b] = entry[:, 1:]
            s.proposal_lengths[:b] = runner.drafter.proposal_lengths(entry[:, 1:].contiguous())
            self.trace_round.index_add_(0, slots, s.active[:b])  # padding rows: the dummy slot's
        else:
            keep = K.request_uniforms(s.seeds[:b], s.anchor_pos[:b], PURPOSE_ORACLE, p) < self.acceptance
        s.draft_tokens[:b] = torch.where(keep, truth, wrong)


class OracleEngine(LLMEngine):
    """``LLMEngine`` with benchmark drafts: ``acceptance`` (a probability) or ``replay`` (module
    docstring); every request comes with ``oracle_ids`` (and, replaying, ``oracle_trace``) and must
    be greedy. Chain mode only."""

    def __init__(self, target, draft, config: EngineConfig, *, acceptance: float | None = None, replay: bool = False,
                 rank=None):
        c = Checker("OracleEngine")
        if (acceptance is None) == (not replay):
            c.fail("give acceptance (a probability) or replay=True, one of the two")
        if acceptance is not None:
            c.real("acceptance", acceptance, low=0.0, high=1.0)
        super().__init__(target, draft, config, rank=rank)
        if self.runner.drafter is None or self.runner.tree is not None:
            c.fail("benchmark drafts need a draft in chain mode (draft_top_k 1)")
        self.runner.draft_override = OracleDrafts(self.runner, acceptance=acceptance, replay=replay)
        self._oracles: dict[int, tuple[list[int], list[list[float]] | None]] = {}

    def add_request(self, request: Request, oracle_ids: list[int] | None = None,
                    oracle_trace: list[list[float]] | None = None) -> int:
        self.check_oracle(request, oracle_ids, oracle_trace)
        request_id = super().add_request(request)
        self._oracles[request_id] = (oracle_ids, oracle_trace)
        return request_id

    def check_oracle(self, request: Request, oracle_ids, oracle_trace) -> None:
        """ValueError / TypeError naming what is wrong with a request's benchmark drafts."""
        c, p = Checker("OracleEngine.add_request"), self.num_drafts
        if oracle_ids is None:
            c.fail("oracle_ids (the request's known greedy continuation) is required")
        if isinstance(request, Request) and not request.sampling.greedy:
            c.fail("oracle_ids (benchmark drafts) need greedy sampling")
        replay = self.runner.draft_override.replay
        if (oracle_trace is not None) != replay:
            c.fail("oracle_trace goes with replay=True and only with it")
        if oracle_trace is None:
            return
        if isinstance(oracle_trace, (str, bytes)) or not isinstance(oracle_trace, (list, tuple)) or not oracle_trace:
            c.fail(f"oracle_trace must be a non-empty list of rounds, got {type(oracle_trace).__name__}", TypeError)
        for r, entry in enumerate(oracle_trace):
            numbers = isinstance(entry, (list, tuple)) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in entry)
            if not numbers or len(entry) != p + 1 or not 0 <= entry[0] <= p or entry[0] != int(entry[0]) \
                    or not all(0.0 <= x <= 1.0 for x in entry[1:]):
                c.fail(f"oracle_trace[{r}] must be [accepted drafts in 0..{p}, {p} confidences in [0, 1]], "
                       f"got {list(entry)[:p + 2]}")

    def abort(self, request_id: int, reason: str = "abort") -> None:
        self._oracles.pop(request_id, None)  # aborted before it got a slot
        super().abort(request_id, reason)

    def _admit(self) -> None:
        """Admission, then each newly admitted request's drafts into its slot (no step is in flight
        that reads the slot: its last owner was retired after its step's readout). A request
        preempted (KV blocks ran out) is admitted again, into another slot: its drafts are kept
        until it finishes, and its trace replays from its first round."""
        before = {seq.request_id for seq in self.scheduler.prefilling}
        super()._admit()
        for seq in self.scheduler.prefilling:
            if seq.request_id not in before:
                ids, trace = self._oracles[seq.request_id]
                self.runner.draft_override.stage(seq.slot, seq.prompt_len, ids, trace)

    def finish(self) -> list[RequestOutput]:
        outputs = super().finish()
        for out in outputs:
            if out.finished:
                self._oracles.pop(out.request_id, None)
        return outputs
