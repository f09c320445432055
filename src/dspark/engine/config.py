"""``EngineConfig``: every choice an ``LLMEngine`` is built with, checked; ``engine_config``: the
one engine choice (``batched`` / ``reference`` / ``auto``) of every entry point."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels._validate import Checker
from ..kernels.tree import MAX_TREE_NODES, MAX_TREE_TOP_K
from .drafting import SCHEDULERS
from .schedulers import SPSCostTable

__all__ = ["DEFAULT_BATCHED_TOKENS", "DEFAULT_DRAFT_CANDIDATES", "DEFAULT_DRAFT_SUCCESSORS", "DEFAULT_MAX_MODEL_LEN",
           "DEFAULT_PROMPT_ROOM", "DEFAULT_STATE_SNAPSHOTS_PER_ROW", "ENGINES", "ENGINE_SCHEDULERS", "SCHEDULE_SIGNALS",
           "EngineConfig", "engine_config"]

DEFAULT_MAX_MODEL_LEN = 4096
ENGINE_SCHEDULERS = SCHEDULERS + ("cost",)
# what the threshold / sps / cost schedulers read as each draft's conditional acceptance: the drafter's
# confidence head, or the online estimator of the acceptances observed (acceptance.OnlineAcceptance);
# the confidence head stays the default until the H200 frontier compares them (docs/serving.md: the CPU
# replay favours the online estimator, but it prices rounds by a table)
SCHEDULE_SIGNALS = ("confidence", "online")
DEFAULT_BATCHED_TOKENS = 2048  # tokens per step (vLLM's default): running rows first, prompt chunks after
# prompt-chunk tokens a default step budget leaves beside every running row's full verify: at 2048
# (256 rows x 8) nothing was left, and rows whose request ended waited idle for their next prompt
DEFAULT_PROMPT_ROOM = 1024
ENGINES = ("auto", "batched", "reference")
# sampled drafts over 64 backbone candidates + 16 bigram successors: 97.7 % of the full vocabulary's
# tau on the demo pair at T 1 and 106 % under top-p 0.9, and a 64-row mixed-settings step 29.5 ms
# against 41.4 (H100): docs/serving.md
DEFAULT_DRAFT_CANDIDATES, DEFAULT_DRAFT_SUCCESSORS = 64, 16
# a hybrid target's prefix-cache state snapshots per batch row (each about a prompt's, or a leaving
# request's, last full block: docs/engine.md has their bytes)
DEFAULT_STATE_SNAPSHOTS_PER_ROW = 2


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
    prompts being admitted in the same forward (default: 2048, and at least ``max_batch`` times the
    verify length plus ``DEFAULT_PROMPT_ROOM``, so that every running row always fits and prompts
    still progress);
    ``draft_top_k`` > 1: tree mode (DDTree; greedy requests walk the target's argmax, sampled ones
    are verified losslessly by ``K.sampled_tree_accept``): each round verifies a token tree grown from
    that many drafter candidates per depth, ``tree_budget`` nodes per row with the root (default:
    block size + 1, as TensorRT-Edge-LLM), no deeper than ``threshold`` (the survival floor) allows
    under the threshold / sps schedulers, whose confidences also bias the tree's scores.
    ``draft_candidates`` C > 0: sampled chain drafts are drawn over each slot's top-C backbone logits
    and the previous token's ``draft_successors`` likeliest Markov successors (``Drafter``; exact:
    verification sees the distribution each draft came from; successors ignored at C = 0); 0: over the
    vocabulary. ``schedule_signal``: what the threshold / sps / cost schedulers read as each draft's
    conditional acceptance -- ``"confidence"`` (the drafter's confidence head) or ``"online"`` (the
    acceptances observed so far, ``acceptance.OnlineAcceptance``: host-side, no confidence head
    needed; chains only).

    KV memory is paged (``block_manager``): ``kv_block_size`` positions per block; on a GPU as many
    blocks as ``gpu_memory_utilization`` of its memory leaves after the weights and the step's
    working memory (vLLM's rule; one such engine per GPU), elsewhere -- or with
    ``gpu_memory_utilization`` None, for engines that share a GPU -- enough for ``max_batch``
    requests of ``max_model_len``; ``num_kv_blocks`` sets the count. When blocks run out a running request is preempted (its
    blocks freed, its tokens run again later: vLLM's recompute). ``enable_prefix_caching``: full
    blocks of committed tokens are shared between requests whose tokens start alike (target and
    draft K/V alike); a hybrid target's with snapshots of its layers' states at block ends, at most
    ``state_snapshots`` of them (None: ``DEFAULT_STATE_SNAPSHOTS_PER_ROW`` x ``max_batch``; their
    bytes: docs/engine.md). ``gated_delta_checkpoints``: a hybrid target's gated DeltaNet layers keep
    per slot two checkpoints and their last window's inputs, the next window's kernel replaying its
    accepted prefix (``K.gated_delta_replay_scan``), instead of the state after every position of a
    window (docs/engine.md: which costs less); with prefix caching also the state after the last
    block end each slot's committed tokens passed. None (the default): True where the target has
    gated DeltaNet layers (faster at 64 rows on an H200 and a third of the memory), False elsewhere.

    ``tensor_parallel_size`` N > 1: the target sharded over N processes, one per GPU (rank r on
    ``cuda:r``; gloo processes on the CPU), the draft replicated on each (``ranks``); the engine
    the caller holds is rank 0, which drives the others."""

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
    enable_prefix_caching: bool = True
    kv_block_size: int = 16
    gpu_memory_utilization: float | None = 0.9
    num_kv_blocks: int | None = None
    draft_candidates: int = DEFAULT_DRAFT_CANDIDATES
    draft_successors: int = DEFAULT_DRAFT_SUCCESSORS
    schedule_signal: str = "confidence"
    state_snapshots: int | None = None
    gated_delta_checkpoints: bool | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self):
        c = Checker("EngineConfig")
        c.integer("max_batch", self.max_batch, low=1)
        if not isinstance(self.enable_prefix_caching, bool):
            c.fail(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}", TypeError)
        if self.gated_delta_checkpoints is not None:
            c.boolean("gated_delta_checkpoints", self.gated_delta_checkpoints)
        c.integer("kv_block_size", self.kv_block_size, low=1, high=1024)
        if self.gpu_memory_utilization is not None and \
                not 0.0 < c.real("gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0):
            c.fail(f"gpu_memory_utilization must be in (0, 1] or None, got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None:
            c.integer("num_kv_blocks", self.num_kv_blocks, low=2)
        if self.state_snapshots is not None:
            c.integer("state_snapshots", self.state_snapshots, low=1)
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
        c.integer("draft_candidates", self.draft_candidates, low=0)
        c.integer("draft_successors", self.draft_successors, low=0)
        c.integer("tensor_parallel_size", self.tensor_parallel_size, low=1)
        if self.tree_budget == 1:
            c.fail(f"tree_budget must be 0 (the block size + 1) or in [2, {MAX_TREE_NODES}], got 1")
        if self.draft_top_k > 1 and self.scheduler == "cost":
            c.fail("tree mode (draft_top_k > 1) takes the off / threshold / sps schedulers")
        if self.schedule_signal not in SCHEDULE_SIGNALS:
            c.fail(f"schedule_signal must be one of {list(SCHEDULE_SIGNALS)}, got {self.schedule_signal!r}")
        if self.schedule_signal == "online" and (self.scheduler == "off" or self.draft_top_k > 1):
            c.fail("schedule_signal 'online' needs the threshold, sps or cost scheduler on chains (draft_top_k 1), "
                   f"got scheduler {self.scheduler!r} with draft_top_k {self.draft_top_k}")


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
