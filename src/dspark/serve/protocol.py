"""Request and response bodies of the OpenAI API, shaped as vLLM's OpenAI-compatible server sends them.

Requests are validated strictly (a string is not a number, a float is not an int); unknown fields
are ignored, as vLLM does, except the OpenAI features this server does not implement
(``UNSUPPORTED``), which are refused when set to anything but their default. Beyond OpenAI, the vLLM
extensions ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids`` (token ids in every
choice and chunk) and, for chat, ``add_generation_prompt`` and ``chat_template``. As vLLM:
``prompt`` may be a list of prompts (one choice per prompt and sample), ``n`` samples per prompt,
``logprobs`` (completions: 0..``MAX_LOGPROBS`` alternatives; chat: ``logprobs`` + ``top_logprobs``),
``prompt_logprobs`` (0..``MAX_LOGPROBS``: each prompt token's log-probability, not streamed) and, for
completions, ``echo`` (the prompt before the completion, in the text and the logprobs; with
``max_tokens`` 0 only the prompt, scored).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# field -> default: an OpenAI feature this server does not implement, refused when set otherwise
UNSUPPORTED = {
    "best_of": None, "suffix": None,
    "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0, "tools": None, "tool_choice": None,
    "response_format": None, "functions": None, "function_call": None, "min_tokens": 0,
    "repetition_penalty": 1,
}
CHAT_DEFAULTS = UNSUPPORTED

MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default --max-logprobs; OpenAI's limit)

UINT64_MAX = 2**64 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def unsupported_fields(self, defaults: dict = UNSUPPORTED) -> list[str]:
        """Extra fields naming an unimplemented feature and set to a non-default value."""
        extra = self.model_extra or {}
        return [k for k, v in extra.items() if k in defaults and v not in (defaults[k], None)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """The generation fields completions and chat share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: Union[str, list[str], list[int], None] = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's echo of the last message: refused (not implemented)


# ---- responses ---------------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: None = None


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
