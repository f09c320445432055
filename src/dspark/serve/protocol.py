"""Request and response bodies of the OpenAI API, shaped as vLLM's OpenAI-compatible server sends them.

Requests are validated strictly (a string is not a number, a float is not an int), and no field is
silently dropped: the fields the models below declare are honoured; the other OpenAI / vLLM fields
(``NOOP_VALUES``, per endpoint ``COMPLETION_NOOPS`` / ``CHAT_NOOPS``) are accepted only at values
that change nothing (``length_penalty: 1``, ``best_of`` equal to ``n``, any ``metadata``) and
refused otherwise; a field nobody defines is refused too (as OpenAI does:
"Unrecognized request argument"). ``OpenAIModel.refused_field`` finds the first, nested bodies
(messages, content parts, ``stream_options``) included. Beyond OpenAI, the vLLM extensions
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``bad_words``, ``stop_token_ids``,
``ignore_eos``, ``return_token_ids`` (token ids in every choice and chunk), ``disable_spec_decode``
(the request opts out of speculative decoding) and, for chat,
``add_generation_prompt`` and ``chat_template``. As vLLM: ``prompt`` may be a list of prompts (one
choice per prompt and sample), ``n`` samples per prompt, ``logprobs``
(completions: 0..``MAX_LOGPROBS`` alternatives; chat: ``logprobs`` + ``top_logprobs``),
``prompt_logprobs`` (0..``MAX_LOGPROBS``: each prompt token's log-probability, not streamed), structured
outputs (``response_format`` ``json_object`` / ``json_schema``, ``structured_outputs`` with ``json``,
``json_object``, ``regex``, ``choice``, ``grammar``, the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; at most one) and, for completions, ``echo`` (the prompt before the completion, in the text and the logprobs; with
``max_tokens`` 0 only the prompt, scored).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.drafting import PENALTY_LIMIT

MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default --max-logprobs; OpenAI's limit)

UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class SameAs:
    """A no-op value: whatever the request's own ``field`` is (``best_of`` equal to ``n``)."""

    field: str


@dataclass(frozen=True)
class AnyOf:
    """No-op values: any value of these JSON types (metadata, hints that change nothing here)."""

    types: tuple[type, ...]


# field -> the values that change nothing (accepted as if left out); any other value is refused.
NOOP_VALUES: dict[str, tuple] = {
    # sampling
    "allowed_token_ids": (None,), "best_of": (None, 1, SameAs("n")), "use_beam_search": (None, False),
    "length_penalty": (None, 1), "logits_processors": (None, []),
    # what the output holds
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False), "truncate_prompt_tokens": (None,), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "include_reasoning": (None, True),
    "verbosity": (None,), "web_search_options": (None,), "request_id": (None,),
    # structured outputs, tools
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False), "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # bookkeeping and hints: nothing here stores, tiers, prioritises or shares a prefix cache
    "metadata": (AnyOf((dict, type(None))),), "store": (None, False), "service_tier": (None, "auto", "default"),
    "safety_identifier": (AnyOf((str, type(None))),), "prompt_cache_key": (AnyOf((str, type(None))),),
    "cache_salt": (AnyOf((str, type(None))),), "priority": (None, 0), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "mm_processor_kwargs": (None, {}),
}
COMPLETION_NOOPS = {**NOOP_VALUES, "suffix": (None, ""), "add_special_tokens": (None, True), "prompt_embeds": (None,)}
CHAT_NOOPS = {**NOOP_VALUES, "add_special_tokens": (None, False), "continue_final_message": (None, False),
              "documents": (None,), "chat_template_kwargs": (None, {})}
MESSAGE_NOOPS = {"function_call": (None,), "refusal": (None,),
                 "audio": (None,), "reasoning_content": (None,), "reasoning": (None,)}


def short_repr(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class RefusedField:
    """A field the server does not act on, sent at a value that would change the output."""

    path: str  # as OpenAI names it: "min_p", "messages[0].tool_calls"
    value: object
    noops: tuple | None  # the accepted values; None: a field this server does not know

    @property
    def message(self) -> str:
        got = short_repr(self.value)
        if self.noops is None:
            return f"unrecognized request field {self.path} (got {got}): this server refuses what it would ignore"
        if isinstance(self.noops[0], AnyOf):
            return f"{self.path} must be {_describe(self.noops[0])}, got {got}"
        return (f"{self.path} is not supported by this server yet: got {got}, and only "
                f"{', '.join(map(_describe, self.noops))} (which change nothing) are accepted")


def _describe(noop) -> str:
    if isinstance(noop, SameAs):
        return f"the value of {noop.field}"
    if isinstance(noop, AnyOf):
        return " or ".join({dict: "an object", str: "a string", type(None): "null"}[t] for t in noop.types)
    return short_repr(noop)


def _same(value, noop) -> bool:
    """JSON equality, types kept apart (``true`` is not ``1``, ``0.0`` is ``0``)."""
    if isinstance(value, (bool, type(None))) or isinstance(noop, (bool, type(None))):
        return value is noop
    numbers = (int, float)
    if isinstance(value, numbers) and isinstance(noop, numbers):
        return value == noop
    return type(value) is type(noop) and value == noop


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    noop_values: ClassVar[dict[str, tuple]] = {}  # the undeclared fields accepted, at these values

    def refused_field(self, prefix: str = "") -> RefusedField | None:
        """The first field sent that this server would not act on (here or in a nested body), or None."""
        for name, value in (self.model_extra or {}).items():
            noops = self.noop_values.get(name)
            if noops is None or not any(self._matches(value, noop) for noop in noops):
                return RefusedField(prefix + name, value, noops)
        for name in type(self).model_fields:
            value = getattr(self, name)
            parts = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, part in parts:
                if isinstance(part, OpenAIModel):
                    refused = part.refused_field(f"{prefix}{name}{'' if i is None else f'[{i}]'}.")
                    if refused is not None:
                        return refused
        return None

    def _matches(self, value, noop) -> bool:
        if isinstance(noop, AnyOf):
            return isinstance(value, noop.types)
        return _same(value, getattr(self, noop.field) if isinstance(noop, SameAs) else noop)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """The generation fields completions and chat share. Sampling as vLLM's sampler (the engine's
    ``SamplingParams``): ``logit_bias`` (OpenAI's: token ids as strings -> bias in [-100, 100], added
    to the logits, greedy requests' too), ``min_tokens`` (the stop / EOS ids banned and stop strings
    not matched until that many tokens were generated), ``bad_words`` (strings tokenized as vLLM),
    ``repetition_penalty`` (> 0, over prompt and output), ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], over the output), temperature, ``min_p``, ``top_k``, ``top_p``
    (the standard nucleus); the ids are checked against the vocabulary by the engine."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    bad_words: list[str] | None = None
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: Union[str, list[str], list[int], None] = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    disable_spec_decode: bool = False  # this request verifies no draft (plain decoding in the DSpark batch)
    return_token_ids: bool = False
    skip_special_tokens: bool = True  # false: special tokens' text kept in the output text (vLLM's field)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    # structured outputs (vLLM's fields; at most one): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* (``app.structured_outputs`` reads them)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    noop_values = COMPLETION_NOOPS
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    noop_values = MESSAGE_NOOPS
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, to the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatCompletionRequest(SamplingFields):
    noop_values = CHAT_NOOPS
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's echo of the last message: refused (not implemented)
    tools: list[dict] | None = None  # OpenAI's function tools (``tools.ToolChoice``)
    tool_choice: Union[str, dict, None] = None


# ---- responses ---------------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache held (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completion logprobs: per token its text, logprob, the alternatives (the token
    itself and the top ``logprobs``, by text) and where its text starts in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[Union[dict[int, PromptLogprob], None]]  # per prompt position; None at the first


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "dspark"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
