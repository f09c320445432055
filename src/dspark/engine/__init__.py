"""The DSpark speculative decoding engine for Hugging Face causal LMs.

``llm_engine`` (``LLMEngine``: continuous batching over ``runner.ModelRunner`` -- the target runner
``model.llama.TargetLM`` and the batched draft ``model.draft_runner.DraftRunner`` with CUDA graphs --
the one decoding engine, and ``engine_config``, the one engine choice), ``request`` (``Request``, its
state in the engine, ``GenerationResult``), ``target`` (loading a Hugging Face target, its EOS ids),
``drafting`` (one drafting round: draft block, Markov loop, confidence scheduling), ``decoder``
(``SpeculativeDecoder``: one prompt at a time on the engine), ``api`` (the
user-facing ``generate``: text or token-id prompts, one or many, decoded text, stop strings),
``schedulers`` (the paper's batch prefix scheduler and SPS cost tables), ``stats`` (per-call statistics),
``structured`` (structured outputs: xgrammar grammars, their verify-position masks),
``text`` (incremental detokenisation with stop strings: the server's, the API's and the CLI's).
"""

from .api import encode_bad_words, encode_prompts, generate, generate_texts, load_tokenizer
from .decoder import SpeculativeDecoder
from .drafting import SCHEDULERS, Drafter, Proposal, SamplingParams
from .llm_engine import ENGINES, EngineConfig, LLMEngine, engine_config
from .request import FINISH_REASONS, GenerationInterrupted, GenerationResult, Request, RequestOutput
from .schedulers import SPSCostTable, batch_schedule, prefix_schedule, prefix_survival
from .stats import GenerationStats
from .structured import StructuredOutputs
from .text import TextOutput, TextStream
from .target import check_target_directory, default_dtype, eos_token_ids, load_target_model, resolve_device

__all__ = [
    "TextOutput", "TextStream", "encode_bad_words", "encode_prompts", "generate", "generate_texts", "load_tokenizer",
    "FINISH_REASONS", "GenerationInterrupted", "GenerationResult", "SpeculativeDecoder",
    "SCHEDULERS", "Drafter", "Proposal", "SamplingParams",
    "ENGINES", "EngineConfig", "LLMEngine", "engine_config", "Request", "RequestOutput",
    "SPSCostTable", "batch_schedule", "prefix_schedule", "prefix_survival",
    "GenerationStats", "StructuredOutputs",
    "check_target_directory", "default_dtype", "eos_token_ids", "load_target_model", "resolve_device",
]
