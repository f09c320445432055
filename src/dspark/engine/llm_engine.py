"""``LLMEngine``: continuous batching of DSpark speculative decoding (or plain decoding).

A nano-vllm-style engine a reader takes in at once: ``EngineConfig``; ``Request`` /
``Sequence`` (request.py); a slot pool (one KV-cache line per running request); the scheduler
below (admit waiting requests between rounds while rows, slots and context allow, retire finished
ones at once); and ``ModelRunner`` (runner.py: forwards, drafting, acceptance, CUDA graphs). Each
``step()`` runs one round for every running request and returns what each produced::

    engine = LLMEngine(target_dir, draft_dir, EngineConfig(max_batch=32))
    rid = engine.add_request(Request(prompt_ids, max_new_tokens=256))
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..kernels._validate import Checker
from ..kernels.tree import MAX_TREE_NODES, MAX_TREE_TOP_K
from ..model.hf_target import HFTarget
from ..model.llama import SUPPORTED_MODEL_TYPES, TargetLM
from .drafting import SCHEDULERS, Drafter
from .schedulers import SPSCostTable, batch_schedule, drafting_pays
from .request import (GenerationInterrupted, GenerationResult, Request, RequestOutput, Sequence, SequenceStatus,
                      TokenLogprobs)
from .runner import MAX_CHUNKS, ForwardFailed, ModelRunner, PrefillChunk, TreeSettings

__all__ = ["ENGINES", "EngineConfig", "EngineDeadError", "LLMEngine", "engine_config", "token_logprobs"]

log = logging.getLogger("dspark.engine")

DEFAULT_MAX_MODEL_LEN = 4096
ENGINE_SCHEDULERS = SCHEDULERS + ("cost",)
DEFAULT_BATCHED_TOKENS = 2048  # tokens per step (vLLM's default): running rows first, prompt chunks after
MIXED_STRIKES = 2  # failed mixed steps a request may sit in (its chunk alone passing) before it is failed
REDRAFT_STEPS = 16  # plain rounds in a row after which the cost scheduler drafts again (fresh confidences)
HOST_EMA = 0.1  # weight of the newest step in the host-time averages of the cost scheduler
ENGINES = ("auto", "batched", "reference")
HOST_PHASES = ("plan", "launch", "commit")  # EngineMetrics.host_phases
PROMPT_LOGITS_TOKENS = 512  # prompt tokens per eager forward that scores a prompt (its logits: [512, V] f32)


@dataclass
class EngineConfig:
    """``max_batch`` requests per round; ``max_model_len`` tokens per request, prompt included
    (default: the target's ``max_position_embeddings``, at most 4096); ``scheduler`` / ``threshold``
    / ``min_proposal_len`` / ``max_proposal_len`` as ``Drafter``, or ``scheduler="cost"``: the paper's
    Algorithm 1 across the batch with ``cost_table`` (an ``SPSCostTable`` or the JSON path that
    ``dspark profile`` writes) and ``min_predicted_gain``; ``cuda_graphs`` (CUDA only);
    ``device`` / ``dtype`` for checkpoints loaded from directories (dtype None: ``default_dtype``,
    float32 on a CPU, the checkpoint's half precision on a GPU); ``max_num_batched_tokens``
    tokens per step (vLLM's flag): the running rows' verify or decode tokens, then chunks of the
    prompts being admitted in the same forward (default: 2048, at least ``max_batch`` times the
    verify length, so that every running row always fits);
    ``draft_top_k`` > 1: tree mode (DDTree; greedy requests walk the target's argmax, sampled ones
    are verified losslessly by ``K.sampled_tree_accept``): each round verifies a token tree grown from
    that many drafter candidates per depth, ``tree_budget`` nodes per row with the root (default:
    block size + 1, as TensorRT-Edge-LLM), no deeper than ``threshold`` (the survival floor) allows
    under the threshold / sps schedulers, whose confidences also bias the tree's scores."""

    max_batch: int = 16
    max_model_len: int | None = None
    scheduler: str = "off"
    threshold: float = 0.0
    min_proposal_len: int = 1
    max_proposal_len: int = 0
    cuda_graphs: bool = True
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None
    cost_table: object = None
    min_predicted_gain: float = 0.04
    max_num_batched_tokens: int | None = None
    draft_top_k: int = 1
    tree_budget: int = 0

    def __post_init__(self):
        c = Checker("EngineConfig")
        c.integer("max_batch", self.max_batch, low=1)
        if self.max_model_len is not None:
            c.integer("max_model_len", self.max_model_len, low=2)
        if self.scheduler not in ENGINE_SCHEDULERS:
            c.fail(f"scheduler must be one of {list(ENGINE_SCHEDULERS)}, got {self.scheduler!r}")
        if self.scheduler == "cost":
            if self.cost_table is None:
                c.fail("scheduler 'cost' needs cost_table: a JSON cost table (written by `dspark profile`) or an SPSCostTable")
            if not isinstance(self.cost_table, SPSCostTable):
                self.cost_table = SPSCostTable.from_json(str(self.cost_table))
        c.real("min_predicted_gain", self.min_predicted_gain, low=0.0)
        if self.max_num_batched_tokens is not None:
            c.integer("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        c.integer("draft_top_k", self.draft_top_k, low=1, high=MAX_TREE_TOP_K)
        c.integer("tree_budget", self.tree_budget, low=0, high=MAX_TREE_NODES)
        if self.tree_budget == 1:
            c.fail(f"tree_budget must be 0 (the block size + 1) or in [2, {MAX_TREE_NODES}], got 1")
        if self.draft_top_k > 1 and self.scheduler == "cost":
            c.fail("tree mode (draft_top_k > 1) takes the off / threshold / sps schedulers")


def engine_config(engine: str, on_device, *, name: str = "engine", **fields) -> "EngineConfig":
    """The one engine choice of ``dspark.generate`` / ``LLM``, ``dspark generate`` and ``dspark eval``:
    the ``EngineConfig`` (``fields`` as there) of ``engine`` -- ``"batched"``: up to ``max_batch``
    requests decoded together, CUDA graphs on a GPU; ``"reference"``: one request at a time, eagerly
    (``max_batch`` 1, no CUDA graphs: the simplest run of the same engine, and on a CPU the
    fastest); ``"auto"``: batched on CUDA, reference elsewhere. ``on_device``: where the models run
    (None: the CPU). ValueError naming ``name`` for another engine."""
    if engine not in ENGINES:
        Checker(name).fail(f"engine must be 'auto', 'batched' or 'reference', got {engine!r}")
    on_cuda = on_device is not None and torch.device(on_device).type == "cuda"
    if engine == "reference" or engine == "auto" and not on_cuda:
        fields.update(max_batch=1, cuda_graphs=False)
    return EngineConfig(**fields)


class EngineDeadError(RuntimeError):
    """The device failed in a way no request can recover from (a sticky CUDA error): the engine
    cannot go on, and its owner should stop."""


class LLMEngine:
    """Serve many requests with one target (and optionally one DSpark draft) on one device.

    ``target``: a Hugging Face checkpoint directory or a loaded causal LM (Llama / Qwen2 / Qwen3 run
    the fused ``TargetLM``; any other decoder-only family its own modeling code, ``HFTarget``);
    ``draft``: a DSpark checkpoint directory, a ``DSparkDraftModel`` or None (plain decoding on the
    same runner -- the baseline).
    """

    def __init__(self, target, draft=None, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        c = Checker("LLMEngine")
        self.target, self.draft_model, self.eos_ids = _load_models(c, target, draft, config)
        limit = min(self.target.shape.max_positions, DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len is not None:
            if config.max_model_len > self.target.shape.max_positions:
                c.fail(f"max_model_len {config.max_model_len} exceeds the target's max_position_embeddings "
                       f"{self.target.shape.max_positions}")
            limit = config.max_model_len
        self.max_model_len = limit
        drafter = None
        if self.draft_model is not None:
            # the cost scheduler decides on the host from every position's confidence: the drafter
            # computes them (threshold 0 schedules every draft)
            per_row = ("threshold", 0.0) if config.scheduler == "cost" else (config.scheduler, config.threshold)
            drafter = Drafter(self.draft_model, scheduler=per_row[0], threshold=per_row[1],
                              min_proposal_len=config.min_proposal_len, max_proposal_len=config.max_proposal_len)
        tree = None
        if config.draft_top_k > 1:
            if drafter is None or not isinstance(self.target, TargetLM):
                c.fail("tree mode (draft_top_k > 1) needs a draft and a Llama / Qwen target (TargetLM)")
            tree = TreeSettings(config.draft_top_k, config.tree_budget or drafter.block_size + 1,
                                config.threshold if config.scheduler != "off" else 0.0)
        verify_len = tree.budget if tree else drafter.num_draft_tokens + 1 if drafter is not None else 1
        rows_tokens = config.max_batch * verify_len
        budget = config.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, rows_tokens)
        if budget < rows_tokens:
            c.fail(f"max_num_batched_tokens must be at least max_batch x verify length = {config.max_batch} x "
                   f"{verify_len} = {rows_tokens} (every running row's tokens fit in a step), got {budget}")
        self.runner = ModelRunner(self.target, drafter, max_batch=config.max_batch, max_model_len=limit,
                                  max_chunk_tokens=budget, cuda_graphs=config.cuda_graphs, tree=tree)
        self.max_num_batched_tokens = budget
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted (a cache slot), prompt partly run
        self.running: list[Sequence] = []  # running[i] sits in batch row i
        self.free_slots = list(range(config.max_batch))
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._launched: tuple | None = None  # (outputs so far, rows) of a round between launch and finish
        self._drafted = True  # whether the running rows hold drafts (the last step drafted them)
        self._plain_rounds = 0  # plain rounds in a row (the cost scheduler's fallback)
        self._host_ms = [0.0, 0.0]  # average host time of a drafting round and of a plain one (measured)
        self._step_host = 0.0
        self._step_captures = 0  # the runner's capture count when the step was launched
        self.metrics = EngineMetrics(self.runner.num_drafts)
        self.cost_table = config.cost_table
        # whether the host picks verify lengths from the drafter's proposals (threshold / sps / cost
        # on chains: a step waits for its draft pass), or only from what rows may still produce
        # (off, trees: the next step is launched behind the running draft pass)
        self._reads_proposals = drafter is not None and tree is None and config.scheduler != "off"
        self._plain: LLMEngine | None = None

    # ---- requests -----------------------------------------------------------------------------

    @property
    def num_drafts(self) -> int:
        return self.runner.num_drafts

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Raises ValueError (naming the problem) for a prompt
        that does not fit the context, or a prompt, stop ids or logit bias holding ids outside the
        vocabulary."""
        stops = self.check_request(request)
        seq = Sequence(self._next_id, request, stops)
        seq.stats.num_drafts, seq.stats.prompt_tokens = self.num_drafts, len(request.prompt_ids)
        if request.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
        self._next_id += 1
        self.sequences[seq.request_id] = seq
        self.waiting.append(seq)
        self._count()
        return seq.request_id

    def check_request(self, request: Request) -> frozenset[int]:
        """Validate ``request`` against this engine (ValueError / TypeError naming the problem);
        returns the token ids that end its output."""
        c = Checker("add_request")
        if not isinstance(request, Request):
            c.fail(f"request must be a Request, got {type(request).__name__}", TypeError)
        ids, vocab = request.prompt_ids, self.target.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            c.fail(f"prompt_ids holds token id {bad}, outside the target's vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            c.fail(f"the prompt has {len(ids)} tokens; the context limit (max_model_len) is {self.max_model_len}, "
                   "which must leave room for at least one new token")
        bad = next((i for i in request.stop_ids if i >= vocab), None)
        if bad is not None:
            c.fail(f"stop_ids holds token id {bad}, outside the target's vocabulary [0, {vocab})")
        bad = next((i for i, _ in request.sampling.logit_bias if i >= vocab), None)
        if bad is not None:
            error = ValueError(f"add_request: logit_bias holds token id {bad}, outside the target's vocabulary "
                               f"[0, {vocab})")
            error.param = "logit_bias"  # the request field at fault, for the server's 400 (kept when pickled)
            raise error
        return (frozenset() if request.ignore_eos else self.eos_ids) | frozenset(request.stop_ids)

    @torch.inference_mode()
    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Stop a request now (waiting, prefilling or running) with finish reason ``reason``; its
        cache line is freed and it is forgotten. Unknown ids are ignored. (In inference mode, as the
        step: the rows it compacts are the step's.)"""
        if self._launched is not None:
            Checker("abort").fail("abort() between launch() and finish(): the launched round still runs")
        seq = self.sequences.get(request_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        seq.finish_reason = reason
        self._release([seq])
        self.sequences.pop(request_id, None)

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs before serving -- each batch bucket and verify length, greedy and
        sampled, and the steps with prompt chunks (``ModelRunner.mixed_shapes``) -- so that no
        request waits for a capture later; returns how many exist (0 without CUDA graphs). Only
        while no request runs."""
        if self.running:
            Checker("capture_graphs").fail(f"capture_graphs needs an idle engine, but {len(self.running)} requests run")
        return self.runner.capture_graphs(plain_rounds=self.config.scheduler == "cost")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, run one round for every running request, retire finished ones
        (``launch`` + ``finish``); returns what each request produced."""
        self.launch()
        return self.finish()

    @torch.inference_mode()
    def launch(self) -> None:
        """The first half of ``step``: admit waiting requests and start one step on the device
        without waiting for it -- a round for every running request and, in the same forward,
        chunks of the admitted prompts within ``max_num_batched_tokens`` -- so that a server can
        hand the previous step's outputs to its clients meanwhile. ``finish`` must come next: until
        then only ``add_request`` may touch the engine. A failure fails the requests it concerns
        (finish reason ``"error"``) and the engine goes on; ``EngineDeadError`` when the device cannot."""
        if self._launched is not None:
            Checker("launch").fail("launch() was called twice: finish() collects the launched round first")
        start, outputs = time.perf_counter(), []
        self._step_captures = self.runner.captures
        self._admit()
        rows = len(self.running)
        lens, draft = self._plan_round() if rows and self.runner.drafter is not None else (None, True)
        plan = self._plan_scored_chunks(self.max_num_batched_tokens - (sum(lens) if lens else rows), outputs)
        planned = time.perf_counter()
        overlapped = planned - start if self.runner.device_busy() else 0.0  # behind the last draft pass
        joined = self._run_step(rows, lens, plan, outputs, draft)
        self._launched = (outputs, len(self.running) - len(joined), joined, self.runner.drafted)
        end = time.perf_counter()
        self.metrics.step_time += end - start
        self.metrics.host_time += end - start
        self.metrics.host_phases["plan"] += planned - start
        self.metrics.host_phases["launch"] += end - planned
        self.metrics.host_overlapped_time += overlapped
        self._step_host = end - start - overlapped

    def _run_step(self, rows: int, lens, plan: list[tuple[Sequence, PrefillChunk]], outputs,
                  draft: bool = True) -> list[Sequence]:
        """Launch the step (``lens`` None: a plain round; ``draft``: whether it drafts the next);
        returns the requests whose prompt ended (now running, last rows). A failed forward with
        chunks is retried without them, and each chunk is probed alone: a request whose own tokens
        fail ends with ``"error"``, the others run again next step."""
        launch = self.runner.launch_decode if self.runner.drafter is None else \
            (lambda r, chunks: self.runner.launch_round(r, lens, chunks, draft))
        chunks = [chunk for _, chunk in plan]
        if not rows and not chunks:
            return []
        try:
            try:
                launch(rows, chunks)
            except ForwardFailed as exc:
                if not chunks:
                    raise
                log.warning("a step with prompt chunks failed (%s): retrying without them", exc)
                self._probe(plan, outputs)
                plan = []
                if rows:
                    launch(rows, [])
        except Exception as exc:  # noqa: BLE001 -- a batched round concerns every row in it
            self._fail_round(exc, outputs, [seq for seq, _ in plan])
            return []
        joined = []
        for seq, chunk in plan:
            seq.prefilled += len(chunk.token_ids)
            self.metrics.prompt_tokens += len(chunk.token_ids)
            if chunk.row >= 0:
                self.prefilling.remove(seq)
                seq.status, seq.row = SequenceStatus.RUNNING, chunk.row
                self.running.append(seq)
                joined.append(seq)
        self._count()
        return joined

    def _probe(self, plan, outputs) -> None:
        for seq, chunk in plan:
            seq.strikes += 1
            try:
                self.runner.probe(chunk)
            except Exception as exc:  # noqa: BLE001
                self._fail([seq], exc, outputs, f"the prompt of request {seq.request_id}")
                continue
            if seq.strikes >= MIXED_STRIKES:
                self._fail([seq], RuntimeError(f"{MIXED_STRIKES} steps with this request's prompt failed"),
                           outputs, f"the prompt of request {seq.request_id}")

    @torch.inference_mode()
    def finish(self) -> list[RequestOutput]:
        """The second half of ``step``: wait for the launched step's target pass, commit its tokens
        (a request whose prompt ended gets its first token) and retire the finished requests while
        its draft pass runs, then, where the scheduler picks the next verify lengths from them, wait
        for the next round's proposals; returns the step's outputs."""
        if self._launched is None:
            Checker("finish").fail("finish() without launch()")
        start = time.perf_counter()
        (outputs, rows, joined, drafted), self._launched = self._launched, None
        waited = hidden = 0.0
        if rows or joined:
            step_rows = list(self.running)  # the readout's rows (retiring reorders self.running)
            try:
                readout = self.runner.read(len(step_rows))
            except Exception as exc:  # noqa: BLE001
                self._fail_round(exc, outputs)
            else:
                waited = time.perf_counter() - start
                committed = self._commit(readout, outputs, {seq.request_id for seq in joined})
                hidden = committed if self.runner.device_busy() else 0.0  # the draft pass outlasted it
                if drafted and self._reads_proposals:
                    waited += self._await_proposals(step_rows, outputs)
        elapsed = time.perf_counter() - start
        self.metrics.step_time += elapsed
        self.metrics.host_time += elapsed - waited
        self.metrics.host_phases["commit"] += elapsed - waited
        self.metrics.host_overlapped_time += hidden
        self.metrics.steps += 1
        self._count_round(drafted, self._step_host + elapsed - waited - hidden,
                          self.runner.captures != self._step_captures)
        return outputs

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

    def _plan_round(self) -> tuple[list[int] | None, bool]:
        """This round's verify tokens per running row (None: a plain round, the rows hold no drafts)
        and whether it drafts the next round: always, except under the ``cost`` scheduler when no
        round Algorithm 1 would run on the rows' latest confidences is predicted to beat plain
        decoding (``drafting_pays``: verify, draft pass and measured host times) -- then the engine
        decodes plainly, drafting again after ``REDRAFT_STEPS`` plain rounds to refresh the confidences."""
        if self.config.scheduler != "cost":
            return (self._verify_lens(self._scheduled_drafts()) if self._drafted else None), True
        # Algorithm 1 across the batch on the (STS-calibrated) confidences and the profiled cost table,
        # the step's prompt chunks in its forward (at most what the budget leaves the longest verify)
        confidence = np.stack([seq.confidence for seq in self.running])
        pending = sum(seq.prompt_len - seq.prefilled for seq in self.prefilling)
        prefill = min(pending, max(0, self.max_num_batched_tokens - len(self.running) * (self.num_drafts + 1)))
        gain = self.config.min_predicted_gain
        drafts = batch_schedule(confidence, self.cost_table, gain, self._host_ms[0], prefill)
        # until a plain round is measured, price its host time as a drafting round's (keep drafting)
        host = (self._host_ms[0], self._host_ms[1] or self._host_ms[0])
        draft = self._plain_rounds >= REDRAFT_STEPS or drafting_pays(confidence, self.cost_table, gain, host, drafts,
                                                                     prefill)
        return (self._verify_lens(drafts) if self._drafted else None), draft

    def _scheduled_drafts(self) -> list[int]:
        """Drafts per running row under the ``off`` / ``threshold`` / ``sps`` schedulers."""
        if self.config.scheduler == "off":
            return [self.num_drafts] * len(self.running)
        return [seq.next_length for seq in self.running]

    def _verify_lens(self, drafts: list[int]) -> list[int]:
        """Verify tokens per running row (drafts + 1), never past what the row may still produce (its
        ``max_new_tokens``, the context limit): a draft there could not be kept, and its position
        would lie beyond the context. At least one draft (the accept kernels verify >= 1); a tree
        verifies all its nodes (its depth is bounded where it is grown)."""
        if self.runner.tree is not None:
            return [self.runner.verify_len] * len(self.running)
        return [1 + max(1, min(n, seq.room(self.max_model_len) - 1)) for n, seq in zip(drafts, self.running)]

    def _admit(self) -> None:
        """Give waiting requests a cache slot while rows are free (their prompts then run in chunks)."""
        while self.waiting and self.free_slots and len(self.running) + len(self.prefilling) < self.config.max_batch:
            seq = self.waiting.popleft()
            seq.slot, seq.status, seq.next_length = self.free_slots.pop(0), SequenceStatus.PREFILLING, self.num_drafts
            seq.admitted_at = time.perf_counter()
            self.prefilling.append(seq)
        self._count()

    def _plan_chunks(self, budget: int) -> list[tuple[Sequence, PrefillChunk]]:
        """This step's prompt chunks (at most ``MAX_CHUNKS``), first come first served within
        ``budget`` tokens; a chunk that ends its prompt names the row its request takes."""
        plan, row = [], len(self.running)
        for seq in self.prefilling:
            if budget <= 0 or len(plan) == MAX_CHUNKS:
                break
            n = min(seq.prompt_len - seq.prefilled, budget)
            request, ends = seq.request, seq.prefilled + n == seq.prompt_len
            plan.append((seq, PrefillChunk(seq.slot, request.prompt_ids[seq.prefilled:seq.prefilled + n], seq.prefilled,
                                           row if ends else -1, request.sampling)))
            row += ends
            budget -= n
        return plan

    def _plan_scored_chunks(self, budget: int, outputs: list[RequestOutput]) -> list[tuple[Sequence, PrefillChunk]]:
        """``_plan_chunks``, the chunks of requests that want prompt log-probabilities scored first;
        a request whose scoring failed ends with ``"error"`` and the step is planned again without it
        (the chunks after it would take other rows)."""
        while True:
            plan = self._plan_chunks(budget)
            scored = [self._score(seq, chunk, outputs) for seq, chunk in plan if seq.prompt_logprobs is not None]
            if all(scored):
                return plan

    def _score(self, seq: Sequence, chunk: PrefillChunk, outputs: list[RequestOutput]) -> bool:
        """The log-probabilities of the prompt tokens that ``chunk``'s logits predict (each position's
        next token) into ``seq.prompt_logprobs``; a failure fails ``seq`` alone (False)."""
        ids, k = seq.request.prompt_ids, seq.request.prompt_logprobs
        try:
            for lo in range(0, len(chunk.token_ids), PROMPT_LOGITS_TOKENS):
                start = chunk.start + lo
                logits = self.runner.prompt_logits(chunk.slot, chunk.token_ids[lo:lo + PROMPT_LOGITS_TOKENS], start)
                following = ids[start + 1:start + 1 + logits.shape[0]]  # the last prompt position predicts none
                seq.prompt_logprobs[start + 1:start + 1 + len(following)] = token_logprobs(logits[:len(following)],
                                                                                           following, k)
        except Exception as exc:  # noqa: BLE001
            self._fail([seq], exc, outputs, f"the prompt log-probabilities of request {seq.request_id}")
            return False
        return True

    def _commit(self, readout: torch.Tensor, outputs: list[RequestOutput], joined: set[int]) -> float:
        """Commit each row's tokens (``joined``: requests whose first token this is), report them and
        retire the finished requests; returns the seconds it took."""
        t, now, max_len = self.runner.verify_len, time.perf_counter(), self.max_model_len
        speculative, times = self.runner.drafter is not None, self.runner.round_times
        running, kept_of, drafted_rows = list(self.running), [], []  # a failure below retires rows: keep this round's order
        for i, (seq, row) in enumerate(zip(running, readout[:, :t + 2].tolist())):
            n, verified = row[t], row[t + 1]
            kept = seq.commit(row[:n], max_len)
            kept_of.append(kept)
            if seq.request_id in joined:
                seq.stats.prefill_tokens, seq.stats.prefill_time = len(kept), now - seq.admitted_at
            elif speculative:
                seq.stats.record_round(verified, n, len(kept))
                drafted_rows.append(i)
                if times is not None:  # each row's round took the whole step (a CPU's timing)
                    seq.stats.verify_time += times[0]
                    seq.stats.draft_time += times[1]
            else:
                seq.stats.record_round(0, 1, len(kept))
        if drafted_rows:
            self.metrics.record_rounds(readout[drafted_rows, t + 1].numpy(), readout[drafted_rows, t].numpy())
        wanted = [i for i, seq in enumerate(running) if seq.request.logprobs is not None and kept_of[i]]
        lps = {}
        if wanted:
            flat = [i * t + j for i in wanted for j in range(len(kept_of[i]))]
            lps = self._logprobs([running[i] for i in wanted], self.runner.token_logits(flat),
                                 [kept_of[i] for i in wanted], outputs)
        for seq, kept in zip(running, kept_of):
            if seq.finish_reason != "error":
                self._report(seq, kept, outputs, lps.get(seq.request_id),
                             seq.prompt_logprobs if seq.request_id in joined else None)
        self._retire([s for s in self.running if s.finish_reason is not None])
        return time.perf_counter() - now

    def _await_proposals(self, rows: list[Sequence], outputs: list[RequestOutput]) -> float:
        """Wait for the step's draft pass and take the next round's proposal of each of the step's
        ``rows`` (retired ones too: harmless): how many drafts the drafter proposes, their
        confidences (numpy f32 rows of one array, which the cost scheduler stacks). Returns the
        seconds waited; a failed draft pass fails the rows still running."""
        start, t = time.perf_counter(), self.runner.verify_len
        try:
            readout = self.runner.read_proposals(len(rows))
        except Exception as exc:  # noqa: BLE001
            self._fail_round(exc, outputs)
            return time.perf_counter() - start
        waited = time.perf_counter() - start
        confidence = readout[:, t + 3:].view(torch.float32).numpy()
        for seq, n, conf in zip(rows, readout[:, t + 2].tolist(), confidence):
            seq.next_length, seq.confidence = n, conf
        return waited

    def _logprobs(self, seqs: list[Sequence], logits, tokens: list[list[int]],
                  outputs: list[RequestOutput]) -> dict[int, list[TokenLogprobs]]:
        """Per request id: the log-probabilities of ``tokens`` (each request's, in order) from the
        target's logits rows (one per token, flat); a failure fails those requests only."""
        if not seqs:
            return {}
        try:
            top = max(seq.request.logprobs for seq in seqs)
            flat = token_logprobs(logits, [t for ts in tokens for t in ts], top)
        except Exception as exc:  # noqa: BLE001
            self._fail(seqs, exc, outputs, "log-probabilities")
            return {}
        result, i = {}, 0
        for seq, ts in zip(seqs, tokens):
            k = seq.request.logprobs
            result[seq.request_id] = [replace(e, top=e.top[:k]) for e in flat[i:i + len(ts)]]
            i += len(ts)
        return result

    def _report(self, seq: Sequence, kept: list[int], outputs: list[RequestOutput], logprobs=None,
                prompt_logprobs=None) -> None:
        self.metrics.generated_tokens += len(kept)
        outputs.append(RequestOutput(seq.request_id, kept, seq.finish_reason is not None, seq.finish_reason,
                                     logprobs, seq.error, prompt_logprobs))

    def _fail(self, seqs: list[Sequence], exc: Exception, outputs: list[RequestOutput], what: str) -> None:
        """End ``seqs`` with finish reason ``"error"`` (logged with the traceback); the rest go on."""
        log.error("%s failed for request(s) %s", what, [q.request_id for q in seqs], exc_info=exc)
        for seq in seqs:
            seq.finish_reason, seq.error = "error", f"{type(exc).__name__}: {exc}"
            self.metrics.errors += 1
            self._report(seq, [], outputs)
        self._release(seqs)

    def _fail_round(self, exc: Exception, outputs: list[RequestOutput], chunked: list[Sequence] = ()) -> None:
        """A batched step failed: it concerns every row in it and the prompts it ran. They end
        with ``"error"``; waiting requests go on unless the device itself is broken (then
        ``EngineDeadError``)."""
        self._fail(list(self.running) + [seq for seq in chunked if seq.status is not SequenceStatus.FINISHED],
                   exc, outputs, "the batched step")
        if self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception as dead:  # noqa: BLE001 -- a sticky CUDA error: nothing can run any more
                raise EngineDeadError(f"the device failed: {type(dead).__name__}: {dead}") from exc

    def _release(self, seqs: list[Sequence]) -> None:
        """End ``seqs`` wherever they are (waiting, prefilling, running): slots and rows freed."""
        for seq in seqs:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.PREFILLING:
                self.prefilling.remove(seq)
                bisect.insort(self.free_slots, seq.slot)
            elif seq.status is SequenceStatus.RUNNING:
                self._retire([seq])
                continue
            seq.status, seq.row, seq.slot = SequenceStatus.FINISHED, -1, -1
        self._count()

    def _count(self) -> None:
        """The waiting / running gauges (a request prefilling has its slot: it counts as running, as vLLM's)."""
        self.metrics.waiting = len(self.waiting)
        self.metrics.running = len(self.running) + len(self.prefilling)

    def _retire(self, finished: list[Sequence]) -> None:
        """Free finished requests' slots and keep the running rows dense (the last row moves in)."""
        for seq in finished:
            last = self.running[-1]
            if last is not seq:
                self.runner.move_row(last.row, seq.row)
                self.running[seq.row], last.row = last, seq.row
            else:
                self.runner.clear_row(seq.row)
            self.running.pop()
            bisect.insort(self.free_slots, seq.slot)
            seq.status, seq.row, seq.slot = SequenceStatus.FINISHED, -1, -1
            self.metrics.finished += 1
        self._count()

    # ---- convenience --------------------------------------------------------------------------

    def generate(self, requests: list[Request],
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[GenerationResult]:
        """Run ``requests`` to completion (together with any already queued); results in input order."""
        ids = [self.add_request(r) for r in requests]
        seqs = {i: self.sequences[i] for i in ids}
        self._drive(set(ids), on_output)
        return [GenerationResult(s.output_ids, s.stats, s.finish_reason, error=s.error) for s in seqs.values()]

    def generate_requests(self, requests: list[Request], *,
                          on_tokens: Callable[[int, list[int]], "bool | None"] | None = None) -> list[GenerationResult]:
        """Run ``requests`` to completion; one ``GenerationResult`` per request, in order. Every
        request is checked before any runs; ``on_tokens(i, tokens)`` streams request i's tokens as
        they are committed (returning True ends it with finish reason ``"stop"``); Ctrl-C raises
        ``GenerationInterrupted`` with every request's output so far."""
        if on_tokens is not None and not callable(on_tokens):
            Checker("generate_requests").fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
        for request in requests:
            self.check_request(request)
        ids = [self.add_request(r) for r in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        seqs = [self.sequences[i] for i in ids]

        def forward(out: RequestOutput) -> None:
            if on_tokens is not None and out.new_token_ids and on_tokens(index[out.request_id], out.new_token_ids):
                if not out.finished:
                    self.abort(out.request_id, "stop")

        def results(interrupted: bool = False):
            return [GenerationResult(s.output_ids, s.stats, s.finish_reason or ("interrupted" if interrupted else "length"))
                    for s in seqs]

        try:
            self._drive(set(ids), forward)
        except KeyboardInterrupt:
            for seq in seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    _stop_clock(seq)
                    self.abort(seq.request_id, "interrupted")
            raise GenerationInterrupted(results(True)) from None
        failed = next((i for i, s in enumerate(seqs) if s.finish_reason == "error"), None)
        if failed is not None:
            raise RuntimeError(f"request {failed} failed in the engine: {seqs[failed].error}")
        return results()

    def _drive(self, wanted: set[int], on_output: Callable[[RequestOutput], None] | None) -> None:
        """Step until every request in ``wanted`` has finished (aborted ones included)."""
        seqs = {i: self.sequences[i] for i in wanted}
        while any(s.status is not SequenceStatus.FINISHED for s in seqs.values()):
            for out in self.step():
                if out.request_id in wanted:
                    if on_output is not None:
                        on_output(out)
                    if seqs[out.request_id].status is SequenceStatus.FINISHED:  # on_output may abort it
                        _stop_clock(seqs[out.request_id])
        for i in wanted:
            self.sequences.pop(i, None)

    def plain(self) -> "LLMEngine":
        """Plain decoding on this engine's target runner (the baseline of ``--compare``), built once."""
        if self._plain is None:
            self._plain = LLMEngine(self.target, None, replace(self.config, scheduler="off", draft_top_k=1,
                                                               tree_budget=0))
            self._plain.eos_ids = self.eos_ids
            if self.runner.captures:  # captured up front as this engine (LLM): no timed call captures
                self._plain.capture_graphs()
        return self._plain


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
        self.errors = 0  # requests the engine failed (finish reason "error")
        self.plain_steps = 0  # steps that did not draft the next round (the cost scheduler's fallback)
        self.graph_captures = 0  # CUDA graphs captured (a capture while serving stalls its step)
        self.device_memory = 0  # bytes torch's allocator holds for tensors on the engine's GPU (0 on the CPU)

    def record_rounds(self, verified: np.ndarray, accept_length: np.ndarray) -> None:
        """Count one step's speculative rounds: per row the drafts (tree nodes) it verified and its
        accept length (bonus included), int arrays ``[R]``."""
        accepted = np.minimum(accept_length - 1, verified)
        self.rounds += len(verified)
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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of ``token_ids[i]`` under the f32 logits row ``logits[i]`` ``[N, V]``: its
    log-softmax, rank and the ``top`` most likely tokens' (one host transfer each)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logp.gather(1, ids[:, None])
    ranks = (logp > chosen).sum(-1) + 1
    values, index = logp.topk(top, dim=-1) if top else (logp[:, :0], ids[:, None][:, :0])
    return [TokenLogprobs(t, c, list(zip(i, v)), r) for t, c, r, i, v in
            zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(), index.tolist(), values.tolist())]


def _stop_clock(seq: Sequence) -> None:
    """A request's total time: from its admission (its time queued is not its own) until now."""
    if seq.admitted_at:
        seq.stats.total_time = time.perf_counter() - seq.admitted_at


def _load_models(c: Checker, target, draft, config: EngineConfig):
    """(TargetLM, draft model or None, EOS ids) from directories or loaded models."""
    from ..model import check_target_compatible, load_draft
    from .target import check_target_checkpoint, default_dtype, eos_token_ids

    device = torch.device(config.device) if config.device is not None else None
    # where a target directory loads: the device asked for, else a loaded draft's, else the CPU (load_draft's)
    dev = device or (draft.device if isinstance(draft, torch.nn.Module) else torch.device("cpu"))
    dtype = config.dtype
    if isinstance(target, (str, Path)):
        check_target_checkpoint(target)  # missing, a file, pickle-only, truncated: said before any loader runs
        if dtype is None:  # the CLI's --dtype auto: float32 on a CPU, the checkpoint's half precision on a GPU
            dtype = default_dtype(dev, target)
    draft_model = draft
    if isinstance(draft, (str, Path)):  # weights a speculators 0.9 draft leaves out come from the target
        draft_model = load_draft(draft, target=target if isinstance(target, (str, Path, torch.nn.Module)) else None,
                                 device=device, dtype=dtype)
    capture = list(draft_model.config.capture_layer_ids) if draft_model is not None else []
    # TargetLM: the fused forward of the families it knows; any other causal LM runs its own
    # modeling code through the same runner contract (HFTarget)
    if isinstance(target, (str, Path)):
        runner = TargetLM if _model_type(c, Path(target)) in SUPPORTED_MODEL_TYPES else HFTarget
        lm = runner.from_pretrained(target, capture, device=dev, dtype=dtype)
        eos = frozenset(_directory_eos(Path(target)) or _config_eos(lm.config))
    elif isinstance(target, torch.nn.Module):
        fused = getattr(target.config, "model_type", None) in SUPPORTED_MODEL_TYPES
        lm = TargetLM.from_hf_model(target, capture) if fused else HFTarget(target, capture)
        eos = frozenset(eos_token_ids(target))
    elif isinstance(target, TargetLM):  # another engine's runner (same weights); EOS ids set by the caller
        lm = TargetLM(target.config, dict(embed=target.embed, layers=target.layers, norm=target.norm,
                                          lm_head=target.lm_head), capture)
        eos = frozenset(_config_eos(target.config))
    elif isinstance(target, HFTarget):
        lm = HFTarget(target.model, capture)
        eos = frozenset(_config_eos(target.config))
    else:
        c.fail(f"target must be a checkpoint directory or a Hugging Face causal LM, got {type(target).__name__}", TypeError)
    if draft_model is not None:
        check_target_compatible(draft_model.config, lm.config)
        if draft_model.device != lm.device:
            c.fail(f"the draft is on {draft_model.device} but the target on {lm.device}")
    return lm, draft_model, eos


def _model_type(c: Checker, path: Path) -> str | None:
    """``model_type`` of a checkpoint directory's config.json (None when it has none: the loader
    then reports the directory)."""
    from ..model.checkpoint import read_json_object

    if not (path / "config.json").is_file():
        return None
    config = read_json_object(path / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get("model_type") or config.get("model_type")


def _config_eos(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _directory_eos(path: Path) -> list[int]:
    """EOS ids of ``generation_config.json`` (what transformers' generate would stop on)."""
    import json

    file = path / "generation_config.json"
    if not file.is_file():
        return []
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except ValueError:
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
