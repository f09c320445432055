"""The DSpark speculative decoding engine for Hugging Face causal LMs.

``llm_engine`` (``LLMEngine``: continuous batching over ``runner.ModelRunner`` -- the target runner
``model.llama.TargetLM`` and the batched draft ``model.draft_runner.DraftRunner`` with CUDA graphs;
the fast path), ``target`` (the Hugging Face adapter: prefill / verify with captured hidden states, KV rollback),
``drafting`` (one drafting round: draft block, Markov loop, confidence scheduling), ``decoder`` (the
lossless decoding loop, ``SpeculativeDecoder`` and ``generate``), ``schedulers`` (the paper's batch
prefix scheduler and SPS cost tables), ``stats`` (per-call statistics).
"""

from .decoder import GenerationResult, SpeculativeDecoder, autoregressive_generate, generate
from .drafting import SCHEDULERS, Drafter, Proposal, SamplingParams
from .llm_engine import EngineConfig, LLMEngine, RequestResult
from .request import Request, RequestOutput
from .schedulers import SPSCostTable, prefix_schedule, prefix_survival
from .stats import GenerationStats
from .target import TargetModel, TargetOutput, eos_token_ids

__all__ = [
    "GenerationResult", "SpeculativeDecoder", "autoregressive_generate", "generate",
    "SCHEDULERS", "Drafter", "Proposal", "SamplingParams",
    "EngineConfig", "LLMEngine", "RequestResult", "Request", "RequestOutput",
    "SPSCostTable", "prefix_schedule", "prefix_survival",
    "GenerationStats",
    "TargetModel", "TargetOutput", "eos_token_ids",
]
