"""The DSpark speculative decoding engine for Hugging Face causal LMs.

``llm_engine`` (``LLMEngine``: continuous batching over ``runner.ModelRunner`` -- the target runner
``model.llama.TargetLM`` and the batched draft ``model.draft_runner.DraftRunner`` with CUDA graphs;
the fast path), ``target`` (the Hugging Face adapter: prefill / verify with captured hidden states, KV rollback),
``drafting`` (one drafting round: draft block, Markov loop, confidence scheduling), ``decoder`` (the
lossless decoding loop, ``SpeculativeDecoder``, ``Request`` and ``generate_requests``), ``api`` (the
user-facing ``generate``: text or token-id prompts, one or many, decoded text, stop strings),
``schedulers`` (the paper's batch prefix scheduler and SPS cost tables), ``stats`` (per-call statistics),
``text`` (incremental detokenisation with stop strings: the server's, the API's and the CLI's).
"""

from .api import encode_prompts, generate, generate_texts, load_tokenizer
from .decoder import (FINISH_REASONS, GenerationInterrupted, GenerationResult, Request, SpeculativeDecoder,
                      autoregressive_generate, generate_requests)
from .drafting import SCHEDULERS, Drafter, Proposal, SamplingParams
from .llm_engine import EngineConfig, LLMEngine, RequestResult
from .request import Request, RequestOutput
from .schedulers import SPSCostTable, batch_schedule, prefix_schedule, prefix_survival
from .stats import GenerationStats
from .text import TextOutput, TextStream
from .target import (TargetModel, TargetOutput, check_target_directory, eos_token_ids, load_target_model,
                     resolve_device)

__all__ = [
    "TextOutput", "TextStream", "encode_prompts", "generate", "generate_texts", "load_tokenizer",
    "FINISH_REASONS", "GenerationInterrupted", "GenerationResult", "Request", "SpeculativeDecoder",
    "autoregressive_generate", "generate_requests",
    "SCHEDULERS", "Drafter", "Proposal", "SamplingParams",
    "EngineConfig", "LLMEngine", "RequestResult", "Request", "RequestOutput",
    "SPSCostTable", "batch_schedule", "prefix_schedule", "prefix_survival",
    "GenerationStats",
    "TargetModel", "TargetOutput", "check_target_directory", "eos_token_ids", "load_target_model", "resolve_device",
]
