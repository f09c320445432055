"""``LLMEngine``: continuous batching of DSpark speculative decoding (or plain decoding).

A nano-vllm-style engine a reader takes in at once (docs/architecture.md): ``EngineConfig``;
``Request`` / ``Sequence`` (request.py); the ``Scheduler`` (admission, paged KV blocks and the
prefix cache, preemption, prompt chunks, retiring) makes a ``StepPlan``; the ``ModelRunner`` runs
it (target pass, acceptance, CUDA graphs; its ``DSparkProposer`` the draft pass) and hands back a
``StepResult``. Each ``step()`` runs one round for every running request and returns what each
produced. ``LLMEngine`` inherits the round's plan (``round_plan.RoundPlanning``), the
log-probabilities requests ask for (``logprobs.LogprobScoring``), rank 0's side of tensor
parallelism (``rank_mirror.RankMirror``) and the offline calls (``offline.OfflineGeneration``)::

    engine = LLMEngine(target_dir, draft_dir, EngineConfig(max_batch=32))
    rid = engine.add_request(Request(prompt_ids, max_new_tokens=256))
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from ..kernels._validate import Checker
from ..model import hybrid
from ..model.llama import TargetLM
from ..model.parallel import SINGLE_RANK, TensorParallel
from .acceptance import OnlineAcceptance
from .block_manager import BlockManager, StateSnapshots, kv_blocks_from_memory, working_memory
from .config import (DEFAULT_BATCHED_TOKENS, DEFAULT_MAX_MODEL_LEN, DEFAULT_PROMPT_ROOM,
                     DEFAULT_STATE_SNAPSHOTS_PER_ROW, ENGINES, EngineConfig, engine_config)
from .drafting import Drafter
from .logprobs import LogprobScoring
from .offline import OfflineGeneration
from .rank_mirror import RankMirror
from .ranks import EngineDeadError, Op, RankGroup, rank_device
from .request import Request, RequestOutput, Sequence, SequenceStatus, token_logprobs
from .round_plan import RoundPlanning
from .rows import TreeSettings
from .runner import ForwardFailed, ModelRunner
from .scheduler import Scheduler
from .stats import EngineMetrics
from .step import StepPlan, StepResult
from .structured import StructuredStage
from .target import check_parallel_target, load_models

__all__ = ["ENGINES", "EngineConfig", "EngineDeadError", "LLMEngine", "engine_config", "token_logprobs"]

log = logging.getLogger("dspark.engine")

MIXED_STRIKES = 2  # failed mixed steps a request may sit in (its chunk alone passing) before it is failed



class LLMEngine(RankMirror, RoundPlanning, LogprobScoring, OfflineGeneration):
    """Serve many requests with one target (and optionally one DSpark draft) on one device.

    ``target``: a Hugging Face checkpoint directory or a loaded causal LM (Llama / Qwen2 / Qwen3 run
    the fused ``TargetLM``; any other decoder-only family its own modeling code, ``HFTarget``);
    ``draft``: a DSpark checkpoint directory, a ``DSparkDraftModel`` or None (plain decoding on the
    same runner -- the baseline). With ``config.tensor_parallel_size`` N > 1 this engine is rank 0
    of N (``ranks``: it starts the others, each building the same engine on its GPU, and sends them
    every call); ``rank`` is given only to the others' engines.
    """

    def __init__(self, target, draft=None, config: EngineConfig | None = None, *, rank: TensorParallel | None = None):
        config = config or EngineConfig()
        c = Checker("LLMEngine")
        self.ranks: RankGroup | None = None
        self.peers = None  # under tensor parallelism: who agrees on a request's failure (``ranks.agree``)
        self.tp = rank or SINGLE_RANK
        self._tokenizer = None
        size = config.tensor_parallel_size
        if size > 1 and rank is None:
            check_parallel_target(c, target, size)  # before any process starts
            self.ranks = RankGroup.start(size, rank_device(config.device, 0, size), self._rank_engine(), target,
                                         draft, config)
            self.tp, self.peers = self.ranks.tp, self.ranks
        if size > 1:
            config = replace(config, device=rank_device(config.device, self.tp.rank, size))
        try:
            self._build(c, target, draft, config)
            if self.ranks is not None:
                self.ranks.wait_ready()
        except (ValueError, TypeError):  # a check every rank makes alike: said as it is
            if self.ranks is not None:
                self.ranks.close(failed=True)
            raise
        except Exception as exc:
            if self.ranks is None:
                raise
            raise self.ranks.failure(exc) from exc

    def _build(self, c: Checker, target, draft, config: EngineConfig) -> None:
        self.target, self.draft_model, self.eos_ids = load_models(c, target, draft, config, self.tp)
        if config.gated_delta_checkpoints is None:  # the default: where the target has gated DeltaNet layers
            has_delta = hybrid.has_gated_deltanet(getattr(self.target, "stateful", {}))
            config = replace(config, gated_delta_checkpoints=has_delta)
        self.config = config
        positions = self.target.shape.max_positions
        self.max_model_len = limit = config.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN)
        if limit > positions:
            c.fail(f"max_model_len {limit} exceeds the target's max_position_embeddings {positions}")
        drafter = None
        if self.draft_model is not None:
            # the cost scheduler decides on the host from every position's confidence: the drafter
            # computes them (threshold 0 schedules every draft); on the online signal the host
            # schedules from what it observed, and the drafter computes no confidence
            per_row = ("off", 0.0) if config.schedule_signal == "online" else \
                ("threshold", 0.0) if config.scheduler == "cost" else (config.scheduler, config.threshold)
            drafter = Drafter(self.draft_model, scheduler=per_row[0], threshold=per_row[1],
                              min_proposal_len=config.min_proposal_len, max_proposal_len=config.max_proposal_len,
                              draft_candidates=config.draft_candidates, draft_successors=config.draft_successors)
        tree = None
        stateful = sorted(getattr(self.target, "stateful", {}))  # hybrid layers: states beside the KV cache
        if config.draft_top_k > 1:
            if stateful:
                c.fail(f"tree mode (draft_top_k > 1) is not supported on a hybrid target (layers {stateful} carry a "
                       "recurrent or convolution state): verifying a tree would need a state per tree node")
            if drafter is None or not isinstance(self.target, TargetLM):
                c.fail("tree mode (draft_top_k > 1) needs a draft and a Llama / Qwen target (TargetLM)")
            tree = TreeSettings(config.draft_top_k, config.tree_budget or drafter.block_size + 1,
                                config.threshold if config.scheduler != "off" else 0.0)
        verify_len = tree.budget if tree else drafter.num_draft_tokens + 1 if drafter is not None else 1
        rows_tokens = config.max_batch * verify_len
        budget = config.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, rows_tokens + DEFAULT_PROMPT_ROOM)
        if budget < rows_tokens:
            c.fail(f"max_num_batched_tokens must be at least max_batch x verify length = {config.max_batch} x "
                   f"{verify_len} = {rows_tokens} (every running row's tokens fit in a step), got {budget}")
        # a Mamba-2 dt limit makes a hybrid target's states depend on the prompt's length: no prefix cache
        caching = config.enable_prefix_caching and not hybrid.prompt_dependent(getattr(self.target, "stateful", {}))
        snapshots = self._state_snapshots(c, stateful, caching)
        self._check_gated_delta_checkpoints(c)
        self.working_memory = working_memory(self.target, self.draft_model, config, verify_len, budget,
                                             drafter.block_size if drafter is not None else 0, snapshots)
        blocks = config.num_kv_blocks or kv_blocks_from_memory(self.target, self.draft_model, config,
                                                              self.working_memory)
        if blocks is not None:  # the ranks' caches hold the same blocks: what every GPU can
            blocks = self.tp.min(blocks)
        self.runner = ModelRunner(self.target, drafter, max_batch=config.max_batch, max_model_len=limit,
                                  max_chunk_tokens=budget, cuda_graphs=config.cuda_graphs, tree=tree,
                                  num_kv_blocks=blocks, kv_block_size=config.kv_block_size, state_snapshots=snapshots,
                                  state_checkpoints=config.gated_delta_checkpoints)
        line_blocks = self.runner.block_tables.blocks_per_line
        if self.runner.num_kv_blocks <= line_blocks:
            c.fail(f"num_kv_blocks is {self.runner.num_kv_blocks}: a request of max_model_len {limit} needs "
                   f"{line_blocks} blocks of {config.kv_block_size} positions, plus the null block "
                   "(raise gpu_memory_utilization or num_kv_blocks, or lower max_model_len)")
        self.max_num_batched_tokens = budget
        self.metrics = EngineMetrics(self.runner.num_drafts)
        # positions a running request writes past its committed tokens in one step: the verify
        # window, then the draft block after the new anchor
        lookahead = verify_len + (drafter.block_size if drafter is not None else 0) - 1
        blocks = BlockManager(self.runner.num_kv_blocks, config.kv_block_size, caching,
                              StateSnapshots(snapshots) if snapshots else None)
        self.scheduler = Scheduler(self.runner, blocks, config.max_batch, lookahead, self.metrics)
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._launched: tuple | None = None  # (outputs so far, rows) of a round between launch and finish
        self._drafted = True  # whether the running rows hold drafts (the last step drafted them)
        self._plain_rounds = 0  # plain rounds in a row (the cost scheduler's fallback)
        self._redraft_doublings = 0  # how often the wait for a fresh draft doubled (round_plan.REDRAFT_DOUBLINGS)
        self._redrafted = False  # the running draft pass is a refresh after plain rounds
        self._plain_rows = None  # drafting rows when plain rounds were last chosen (None: drafting)
        self._full_rounds_left = 0  # rounds that verify every draft without planning (round_plan.FULL_CHOICE_STEPS)
        self._host_ms = [0.0, 0.0]  # average host time of a drafting round and of a plain one (measured)
        self._step_host = self._launch_time = 0.0  # the launched step's host seconds and launch seconds
        self._step_captures = 0  # the runner's capture count when the step was launched
        self.cost_table = config.cost_table
        # whether the host picks verify lengths from the drafter's proposals (threshold / sps / cost
        # on chains: the next plan waits for the step's draft pass), or only from what rows may still
        # produce (off, trees: the next step is launched behind the running draft pass)
        self._reads_proposals = drafter is not None and tree is None and drafter.scheduler != "off"
        self._unread: list[Sequence] = []  # rows of the last draft pass whose proposals are not read yet
        self._proposal_wait = 0.0  # seconds this launch waited for them
        self.acceptance = None  # the online acceptance estimator (schedule_signal "online")
        if drafter is not None and config.schedule_signal == "online":
            self.acceptance = OnlineAcceptance(config.max_batch + 1, drafter.num_draft_tokens)
        self._plain: LLMEngine | None = None
        self.structured = StructuredStage(self.runner, target)

    def _check_gated_delta_checkpoints(self, c: Checker) -> None:
        """``gated_delta_checkpoints`` needs gated DeltaNet layers."""
        if not self.config.gated_delta_checkpoints:
            return
        stateful = getattr(self.target, "stateful", {})
        if not hybrid.has_gated_deltanet(stateful):
            c.fail("gated_delta_checkpoints applies to a hybrid target's gated DeltaNet layers, and this target has "
                   f"none (stateful layers: {sorted(stateful) or 'none'}); leave it False")

    def _state_snapshots(self, c: Checker, stateful: list[int], caching: bool) -> int:
        """How many state snapshots a hybrid target's prefix cache keeps (0: not a hybrid target, or
        no prefix caching). Refused: blocks shorter than a conv's inputs before a position (a
        snapshot holds the conv inputs of its block's last ``kernel - 1`` positions)."""
        config = self.config
        if not stateful or not caching:
            return 0
        tail = hybrid.conv_tail(self.target.stateful)
        if config.kv_block_size < tail:
            c.fail(f"prefix caching on this hybrid target needs kv_block_size >= {tail} (its convolutions read "
                   f"{tail} inputs before each position, kept per block end), got {config.kv_block_size}; "
                   "or set enable_prefix_caching=False")
        return config.state_snapshots or DEFAULT_STATE_SNAPSHOTS_PER_ROW * config.max_batch

    @property
    def tokenizer(self):
        """What structured outputs compile against (None: the target directory's)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._mirror(Op("tokenizer", (tokenizer,)))

    # ---- requests -----------------------------------------------------------------------------

    @property
    def num_drafts(self) -> int:
        return self.runner.num_drafts

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Raises ValueError (naming the problem) for a prompt
        that does not fit the context, or a prompt, stop ids, logit bias or bad words holding ids
        outside the vocabulary."""
        stops = self.check_request(request)
        seq = Sequence(self._next_id, request, stops, prefill_len=len(request.prompt_ids))
        spec = request.sampling.structured_outputs
        if spec is not None:
            seq.grammar = self.structured.grammars(self.tokenizer, self.eos_ids).matcher(spec)
        seq.stats.num_drafts, seq.stats.prompt_tokens = self.num_drafts, len(request.prompt_ids)
        if request.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
        self._next_id += 1
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        self._mirror(Op("add", (request,)))
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
        for field, ids in (("logit_bias", [i for i, _ in request.sampling.logit_bias]),
                           ("bad_words", [i for word in request.sampling.bad_words for i in word])):
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                error = ValueError(f"add_request: {field} holds token id {bad}, outside the target's vocabulary "
                                   f"[0, {vocab})")
                error.param = field  # the request field at fault, for the server's 400 (kept when pickled)
                raise error
        if request.sampling.structured_outputs is not None:
            self.structured.check(request.sampling.structured_outputs, self.tokenizer, self.eos_ids)
        if request.disable_spec_decode and self.runner.tree is not None:
            error = ValueError("add_request: disable_spec_decode is not supported in tree mode (draft_top_k > 1): "
                               "every row of a round verifies its tree")
            error.param = "disable_spec_decode"
            raise error
        # a grammar's output ends at its stop token (the EOS), ignore_eos or not: a round that verified
        # past it must commit nothing after it (plain decoding ends there)
        constrained = request.sampling.structured_outputs is not None
        return (frozenset() if request.ignore_eos and not constrained else self.eos_ids) | frozenset(request.stop_ids)

    @torch.inference_mode()
    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Stop a request now (waiting, prefilling or running) with finish reason ``reason``; its
        slot and blocks are freed and it is forgotten. Unknown ids are ignored. (In inference mode, as the
        step: the rows it compacts are the step's.)"""
        if self._launched is not None:
            Checker("abort").fail("abort() between launch() and finish(): the launched round still runs")
        self._mirror(Op("abort", (request_id, reason)))
        seq = self.sequences.get(request_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        seq.finish_reason = reason
        self.scheduler.release([seq])
        self.sequences.pop(request_id, None)

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the CUDA graphs before serving -- each batch bucket and verify length, greedy and
        sampled, and the steps with prompt chunks (``ModelRunner.mixed_shapes``) -- so that no
        request waits for a capture later; returns how many exist (0 without CUDA graphs). Only
        while no request runs. In inference mode, as every step: with gradients on, a kernel given a
        tensor that requires them (a transformers model passed in) resolves to the reference, which
        cannot be captured."""
        if self.scheduler.running:
            Checker("capture_graphs").fail(f"capture_graphs needs an idle engine, but {len(self.scheduler.running)} "
                                           "requests run")
        self._mirror(Op("capture"))
        with self._rank_failures():
            try:
                return self.runner.capture_graphs(plain_rounds=self.config.scheduler == "cost")
            except torch.OutOfMemoryError as exc:
                raise torch.OutOfMemoryError(self._capture_memory_message()) from exc

    def _capture_memory_message(self) -> str:
        c = self.config
        return (f"capturing the CUDA graphs of max_batch {c.max_batch} ran out of GPU memory: the "
                f"{self.runner.num_kv_blocks} KV blocks took what gpu_memory_utilization {c.gpu_memory_utilization} "
                f"left after the weights and {self.working_memory.total / 2**30:.2f} GiB estimated for a step's "
                "work; lower gpu_memory_utilization or max_batch, or run "
                "eagerly (enforce_eager / cuda_graphs=False)")

    def plain(self) -> "LLMEngine":
        """Plain decoding on this engine's target runner (the baseline of ``--compare``), built once,
        with KV blocks for ``max_batch`` requests of ``max_model_len`` (this engine holds its share
        of the GPU's memory already: ``gpu_memory_utilization`` None)."""
        if self.tp.size > 1:
            Checker("plain").fail(f"the plain-decoding baseline runs on one GPU; this engine is tensor-parallel "
                                  f"(tensor_parallel_size {self.tp.size}): build one with tensor_parallel_size 1 and "
                                  "no draft to compare")
        if self._plain is None:
            self._plain = LLMEngine(self.target, None, replace(self.config, scheduler="off", schedule_signal="confidence",
                                                               draft_top_k=1, tree_budget=0, gpu_memory_utilization=None))
            self._plain.eos_ids = self.eos_ids
            self._plain.tokenizer, self._plain.structured.tokenizer_source = self.tokenizer, self.structured.tokenizer_source
            if self.runner.captures:  # captured up front as this engine (LLM): no timed call captures
                self._plain.capture_graphs()
        return self._plain

    def profile_costs(self, token_counts: list[int], *, context: int, tokens_per_row: int):
        """The ``cost`` scheduler's table of this engine's target (``engine.profile``: a verify
        forward per total token count and a plain forward per row count over ``context`` cached
        positions) and, with a draft, of its draft pass per batch bucket; under tensor parallelism
        every rank runs the forwards (rank 0's times). Only while no request runs."""
        if self.scheduler.running:
            Checker("profile_costs").fail(f"profile_costs needs an idle engine, but {len(self.scheduler.running)} "
                                          "requests run")
        return self.on_every_rank("_profile_costs", tuple(token_counts), context, tokens_per_row)

    def _profile_costs(self, token_counts, context: int, tokens_per_row: int):
        from .profile import profile_costs

        return profile_costs(self.target, list(token_counts), context=context, tokens_per_row=tokens_per_row,
                             engine=self if self.runner.drafter is not None else None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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
        # the host times are rank 0's: the cost scheduler's choice of a plain round is the same on every rank
        self._mirror(Op("launch", (tuple(self._host_ms),)))
        with self._rank_failures():
            self._launch()

    def _launch(self) -> None:
        start, outputs = time.perf_counter(), []
        self._step_captures, self._proposal_wait = self.runner.captures, 0.0
        self._admit()
        self.scheduler.reserve_running()
        plans = self.scheduler.running and self.runner.drafter is not None
        lens, draft = self._plan_round(outputs) if plans else (None, True)
        rows = len(self.scheduler.running)  # a failed draft pass failed them all
        chunks = self._plan_scored_chunks(self.max_num_batched_tokens - (sum(lens) if lens else rows), outputs)
        lens = self.structured.constrain(self.scheduler.running[:rows], lens, chunks)
        planned = time.perf_counter()
        overlapped = planned - start if self.runner.device_busy() else 0.0  # behind the last draft pass
        joined = self._run_step(StepPlan(rows, lens, draft, chunks), outputs)
        self._launched = (outputs, len(self.scheduler.running) - len(joined), joined, self.runner.drafted)
        end = time.perf_counter()
        host = end - start - self._proposal_wait
        self.metrics.record_host(end - start, host, overlapped, plan=planned - start, launch=end - planned)
        self._step_host, self._launch_time = host - overlapped, end - start

    def _run_step(self, plan: StepPlan, outputs) -> list[Sequence]:
        """Launch ``plan``; returns the requests whose prompt ended (now running, last rows). A failed
        forward with chunks is retried without them, and each chunk is probed alone: a request whose
        own tokens fail ends with ``"error"``, the others run again next step."""
        if not plan.rows and not plan.chunks:
            return []
        try:
            try:
                self.runner.launch(plan)
            except ForwardFailed as exc:
                if not plan.chunks:
                    raise
                # every rank retries, or none (a rank's retry would run collectives the others do not)
                self._agree("a step with prompt chunks", [seq.request_id for seq, _ in plan.chunks])
                log.warning("a step with prompt chunks failed (%s): retrying without them", exc)
                self._probe(plan.chunks, outputs)
                self._restart_stateful_prompts(plan.chunks)
                plan = replace(plan, chunks=[])
                if plan.rows:
                    self.runner.launch(plan)
        except EngineDeadError:  # the ranks did not agree
            raise
        except Exception as exc:  # noqa: BLE001 -- a batched round concerns every row in it
            self._fail_round(exc, outputs, [seq for seq, _ in plan.chunks])
            return []
        self.metrics.row_tokens += sum(plan.verify_lens) if plan.verify_lens else plan.rows
        joined = []
        for seq, chunk in plan.chunks:
            self.scheduler.ran_chunk(seq, chunk)
            self.metrics.prompt_tokens += len(chunk.token_ids)
            if chunk.row >= 0:
                joined.append(seq)
        self.scheduler.count()
        return joined

    def _restart_stateful_prompts(self, plan) -> None:
        """After a failed forward with prompt chunks, a hybrid target's chunk requests are queued
        again (first) to run their prompts from the cache's last snapshot, or from position 0: a
        K/V write the failed forward made is rewritten by the retry, but its layer-state writes may
        have landed on the state a chunk starts from."""
        if getattr(self.target, "stateful", None):
            for seq, _ in reversed(plan):
                if seq.status is SequenceStatus.PREFILLING:
                    self.scheduler.requeue(seq)

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
        self._mirror(Op("finish"))
        with self._rank_failures():
            return self._finish()

    def _finish(self) -> list[RequestOutput]:
        start = time.perf_counter()
        (outputs, rows, joined, drafted), self._launched = self._launched, None
        waited = hidden = 0.0
        if rows or joined:
            step_rows = list(self.scheduler.running)  # the result's rows (retiring reorders them)
            try:
                result = self.runner.read(len(step_rows))
            except Exception as exc:  # noqa: BLE001
                self._fail_round(exc, outputs)
            else:
                waited = time.perf_counter() - start
                committed = self._commit(result, outputs, {seq.request_id for seq in joined})
                hidden = committed if self.runner.device_busy() else 0.0  # the draft pass outlasted it
                if drafted and self._reads_proposals:
                    self._unread = step_rows  # read where the next plan needs them (``_take_proposals``)
        elapsed = time.perf_counter() - start
        self.metrics.record_host(elapsed, elapsed - waited, hidden, commit=elapsed - waited)
        self.metrics.steps += 1
        captured = self.runner.captures != self._step_captures
        self.metrics.capture_step_time += captured * (self._launch_time + elapsed)
        self._count_round(drafted, self._step_host + elapsed - waited - hidden, captured)
        return outputs

    def _admit(self) -> None:
        """Admission (``Scheduler.admit``; a benchmark's engine also stages what it admitted)."""
        self.scheduler.admit()

    def _commit(self, result: StepResult, outputs: list[RequestOutput], joined: set[int]) -> float:
        """Commit each row's tokens (``joined``: requests whose prompt ended in the step: their first
        token, or a preempted request's kept anchor), report them and retire the finished requests;
        returns the seconds it took."""
        t, now, max_len = self.runner.verify_len, time.perf_counter(), self.max_model_len
        speculative, times = self.runner.drafter is not None, self.runner.round_times
        running, kept_of, drafted_rows = list(self.scheduler.running), [], []  # retiring reorders the rows
        first = {seq.request_id for seq in running if seq.request_id in joined and not seq.output_ids}
        verified = result.verified.tolist()  # Python ints: a numpy scalar a row costs more at 256 rows
        for i, seq in enumerate(running):
            resumed = seq.request_id in joined and seq.request_id not in first
            if self.acceptance is not None and seq.request_id in joined:  # a new request in its slot
                self.acceptance.reset(seq.slot)
            kept = [] if resumed else seq.commit(result.tokens[i], max_len)
            # (advance even with nothing kept: it rolls back what the drafter's masks took ahead)
            if seq.grammar is not None and seq.grammar.advance(kept) and kept and seq.finish_reason is None:
                seq.finish_reason = "stop"  # the grammar is complete
            kept_of.append(kept)
            if seq.request_id in first:
                seq.stats.prefill_tokens, seq.stats.prefill_time = len(kept), now - seq.admitted_at
            elif resumed:
                continue
            elif speculative:
                seq.stats.record_round(verified[i], len(result.tokens[i]), len(kept))
                drafted_rows.append(i)
                if times is not None:  # each row's round took the whole step (a CPU's timing)
                    seq.stats.verify_time += times[0]
                    seq.stats.draft_time += times[1]
            else:
                seq.stats.record_round(0, 1, len(kept))
        if drafted_rows:
            rows_verified, accept_lengths = result.verified[drafted_rows], result.accept_lengths[drafted_rows]
            self.metrics.record_rounds(rows_verified, accept_lengths)
            if self.acceptance is not None:
                self.acceptance.observe([running[i].slot for i in drafted_rows], rows_verified, accept_lengths - 1)
        wanted = [i for i, seq in enumerate(running) if seq.request.logprobs is not None and kept_of[i]]
        lps = {}
        if wanted:
            flat = [i * t + j for i in wanted for j in range(len(kept_of[i]))]
            lps = self._logprobs([running[i] for i in wanted], self.runner.token_logits(flat),
                                 [kept_of[i] for i in wanted], outputs)
        for seq, kept in zip(running, kept_of):
            if seq.finish_reason != "error" and (kept or seq.request_id not in joined or seq.request_id in first):
                self._report(seq, kept, outputs, lps.get(seq.request_id), seq.request_id in first)
        self.scheduler.retire([s for s in self.scheduler.running if s.finish_reason is not None])
        return time.perf_counter() - now

    def _take_proposals(self) -> None:
        """Wait for the last draft pass and give each of its rows (``_unread``; retired ones too:
        harmless) the next round's proposal: how many drafts the drafter proposes, their
        confidences (numpy f32 rows of one array, which the cost scheduler stacks). Raises when the
        draft pass failed."""
        rows, self._unread = self._unread, []
        if not rows:
            return
        start = time.perf_counter()
        try:
            proposals = self.runner.read_proposals(len(rows))
        finally:
            self._proposal_wait += time.perf_counter() - start
        for seq, n, conf in zip(rows, proposals.lengths.tolist(), proposals.confidence):
            seq.next_length, seq.confidence = n, conf

    def _proposals_taken(self, outputs: list[RequestOutput]) -> bool:
        """``_take_proposals``; a failed draft pass fails the running rows (False)."""
        try:
            self._take_proposals()
        except Exception as exc:  # noqa: BLE001 -- the draft pass of every running row
            self._fail_round(exc, outputs)
            return False
        return True

    def _report(self, seq: Sequence, kept: list[int], outputs: list[RequestOutput], logprobs=None,
                first: bool = False) -> None:
        """``seq``'s output of this step (``first``: its first, with its prompt's log-probabilities
        and cached tokens)."""
        self.metrics.generated_tokens += len(kept)
        stop_token = kept[-1] if seq.finish_reason == "stop" and kept and kept[-1] in seq.stop_ids else None
        outputs.append(RequestOutput(seq.request_id, kept, seq.finish_reason is not None, seq.finish_reason,
                                     logprobs, seq.error, seq.prompt_logprobs if first else None,
                                     seq.stats.cached_tokens if first else None, stop_token))

    def _fail(self, seqs: list[Sequence], exc: Exception, outputs: list[RequestOutput], what: str) -> None:
        """End ``seqs`` with finish reason ``"error"`` (logged with the traceback); the rest go on.
        Under tensor parallelism only once every rank failed the same (``_agree``)."""
        self._agree(what, [q.request_id for q in seqs])
        log.error("%s failed for request(s) %s", what, [q.request_id for q in seqs], exc_info=exc)
        for seq in seqs:
            seq.finish_reason, seq.error = "error", f"{type(exc).__name__}: {exc}"
            self.metrics.errors += 1
            self._report(seq, [], outputs)
        self.scheduler.release(seqs)

    def _fail_round(self, exc: Exception, outputs: list[RequestOutput], chunked: list[Sequence] = ()) -> None:
        """A batched step failed: it concerns every row in it and the prompts it ran. They end
        with ``"error"``; waiting requests go on unless the device itself is broken (then
        ``EngineDeadError``)."""
        self._fail(list(self.scheduler.running) + [seq for seq in chunked if seq.status is not SequenceStatus.FINISHED],
                   exc, outputs, "the batched step")
        if self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception as dead:  # noqa: BLE001 -- a sticky CUDA error: nothing can run any more
                raise EngineDeadError(f"the device failed: {type(dead).__name__}: {dead}") from exc
