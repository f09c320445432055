"""The OpenAI-compatible HTTP server: ``create_app(engine, tokenizer, model_name)`` -> a FastAPI app.

Endpoints as vLLM's server: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
server-sent-event streaming), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (with an API key,
the ``/v1`` routes need it: ``BearerAuth``). The engine runs
on the ``EngineLoop`` thread (or in its own process, ``EngineClient``); each HTTP request has an asyncio queue that the loop feeds (one per
request, shared by its choices: a list of prompts and ``n`` samples each are one engine request per
choice). Every refusal is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status, unknown routes and methods included; a 500 names what failed: the engine failing
one request (``finish_reason`` ``"error"``) fails that request alone, an exception escaping the
engine fails every request in flight and the server (``/health`` 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..engine.api import encode_bad_words
from ..engine.drafting import LOGIT_BIAS_LIMIT, SamplingParams
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request, RequestOutput, TokenLogprobs
from ..engine.structured import StructuredOutputs
from .engine_loop import ACCEPTED, EngineDead, EngineLoop, Handle, QueueFull, ServerClosing
from .engine_process import EngineClient
from .tools import ToolCallStream, ToolChoice, ToolError, ToolParser, parse_calls, parser_for_template, tool_parser
from .metrics import Latency, ServerCounters, registry
from .protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                       CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, ErrorInfo,
                       ErrorResponse, ModelCard, ModelList, PromptLogprob, PromptLogprobs, SamplingFields, TopLogprob,
                       PromptTokensDetails, UINT64_MAX, UsageInfo, random_id, short_repr)
from ..engine.text import TextOutput

__all__ = ["APIError", "create_app"]

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
LOGPROB_FLOOR = -9999.0  # vLLM's: -inf (a token the filters excluded) is not JSON


class APIError(Exception):
    """An OpenAI error response: ``status``, ``message`` and the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=self.status, headers=self.headers)


def create_app(engine: LLMEngine | EngineClient, tokenizer, model_name: str, *, max_waiting: int | None = None,
               chat_template: str | None = None, trust_request_chat_template: bool = False,
               model_root: str | None = None, api_key: str | None = None, tool_call_parser: str | None = None,
               on_engine_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` (it starts the engine thread on startup, stops it on shutdown).

    ``engine``: an ``LLMEngine`` (run on an ``EngineLoop`` thread of this process) or an
    ``EngineClient`` (the engine in its own process, as ``dspark serve`` runs it; it was given its
    own ``max_waiting`` and ``on_failure``, so these two arguments must stay unset).

    ``tokenizer``: a transformers tokenizer, or None (then prompts must be token ids, the text of
    every response is empty and ``return_token_ids`` carries the output); ``model_name``: the only
    name ``model`` may take; ``max_waiting``: requests waiting beyond the running batch before new
    ones get 429 (None: unbounded); ``chat_template``: a Jinja template replacing the tokenizer's;
    ``trust_request_chat_template``: let a chat request bring its own ``chat_template`` (as vLLM's
    flag of that name; off by default: a template is code the server renders); ``api_key``: every
    ``/v1`` route then needs ``Authorization: Bearer <api_key>`` (401 otherwise; ``/health`` and
    ``/metrics`` stay open, as vLLM's ``--api-key``); ``tool_call_parser``: the format of the calls
    that ``tool_choice: "auto"`` reads, a name of ``tools.TOOL_PARSERS`` (vLLM's ``--tool-call-parser``;
    None: the one the chat template's format calls for, ``tools.parser_for_template``; ValueError
    naming the known ones for another name);
    ``on_engine_failure(exc)``: called on the engine thread when an exception escaped the engine
    (``dspark serve`` shuts down then); ``app.state.server.loop.error`` keeps it.
    """
    if isinstance(engine, EngineClient):
        if max_waiting is not None or on_engine_failure is not None:
            raise TypeError("create_app: an EngineClient takes max_waiting and on_failure itself")
        loop = engine
    else:
        loop = EngineLoop(engine, max_waiting, on_engine_failure)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    parser = tool_parser(tool_call_parser or parser_for_template(template))
    server = _Server(loop, tokenizer, model_name, chat_template, trust_request_chat_template, model_root, parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        # uvicorn ran this after the connections drained: what is still in flight has no client.
        await asyncio.to_thread(server.loop.stop, 60.0)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(JSONBody)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)  # added last: runs first
    app.add_exception_handler(APIError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda _, exc: _validation_error(exc).response())
    app.add_exception_handler(HTTPException, _http_error)
    # a bug still answers in OpenAI's shape (Starlette logs the traceback on the server side)
    app.add_exception_handler(Exception, lambda _, exc: APIError(500, f"internal error: {type(exc).__name__}: {exc}")
                              .response())
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


class JSONBody:
    """ASGI middleware: every POST body is read as JSON whatever its Content-Type (the API takes
    nothing else), as vLLM does: ``curl -d`` sends form-urlencoded, some clients text/plain or none."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BearerAuth:
    """ASGI middleware: a request to ``/v1...`` without ``Authorization: Bearer <api_key>`` gets
    OpenAI's 401 (``invalid_api_key``). The key is compared in constant time (as digests, so its
    length does not show either) and never written anywhere."""

    def __init__(self, app, api_key: str):
        self.app, self.digest = app, _digest(api_key.encode("utf-8"))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            refusal = self._refusal(dict(scope["headers"]).get(b"authorization"))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, header: bytes | None) -> APIError | None:
        scheme, _, key = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            message = "no API key: send it in an Authorization header using Bearer auth (Authorization: Bearer KEY)"
        elif not secrets.compare_digest(_digest(key.strip()), self.digest):
            message = "incorrect API key provided"
        else:
            return None
        return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _http_error(raw: HTTPRequest, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors (404 unknown route, 405 wrong method) in OpenAI's shape."""
    where = f"{raw.method} {raw.url.path}"
    if exc.status_code == 404:
        message = f"no such endpoint: {where} (this server has /v1/completions, /v1/chat/completions, " \
                  "/v1/models, /health, /metrics)"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {raw.method} is not allowed on {raw.url.path}" + (f"; use {allowed}" if allowed else "")
    else:
        message = f"{where}: {exc.detail}"
    return APIError(exc.status_code, message, headers=exc.headers).response()


STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs keys we take


def structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
    """The request's structured output from whichever field carries it (``response_format``,
    ``structured_outputs``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``), or None; 400 naming the field when it is malformed or more than one is set.
    Whether it compiles the engine says (400 too)."""
    given = []
    if isinstance(body, ChatCompletionRequest):
        tools = _tool_choice(body)
        schema = None if tools is None else tools.schema()
        if schema is not None:
            given.append(("tool_choice", {"json": schema}))
    fmt = body.response_format
    if fmt is not None and fmt != {"type": "text"}:
        given.append(("response_format", _response_format(fmt)))
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise APIError(400, f"structured_outputs: unsupported key(s) {unknown}; this server takes "
                                f"{list(STRUCTURED_KEYS)}", "structured_outputs")
        given.append(("structured_outputs", {k: v for k, v in body.structured_outputs.items() if v is not None}))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(body, field) is not None:
            given.append((field, {key: getattr(body, field)}))
    if len(given) > 1:
        raise APIError(400, f"at most one structured output per request, got {', '.join(f for f, _ in given)}",
                       given[1][0])
    if not given:
        return None
    (field, spec), = given
    try:
        return StructuredOutputs(**spec)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def _tool_choice(body: ChatCompletionRequest) -> ToolChoice | None:
    """The request's ``tools`` / ``tool_choice`` (``tools.ToolChoice``); 400 naming the field."""
    try:
        return ToolChoice.of(body.tools, body.tool_choice)
    except ToolError as exc:
        raise APIError(400, str(exc), exc.param) from None


def _response_format(fmt: dict) -> dict:
    """OpenAI's ``response_format`` as ``StructuredOutputs`` fields."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise APIError(400, "response_format: type json_schema needs json_schema.schema", "response_format")
        return {"json": schema}
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {short_repr(kind)}",
                   "response_format")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids spelled as decimal strings -> bias in [-100, 100]) with int
    ids; a 400 naming the entry, what it must be and what was given otherwise."""
    checked = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {short_repr(key)}",
                           "logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise APIError(400, f"logit_bias[{short_repr(key)}] must be in [-{LOGIT_BIAS_LIMIT:g}, "
                                f"{LOGIT_BIAS_LIMIT:g}], got {short_repr(value)}", "logit_bias")
        if int(key) in checked:
            raise APIError(400, f"logit_bias names token id {int(key)} twice (as {short_repr(key)})", "logit_bias")
        checked[int(key)] = value
    return checked


def _field_named(message: str) -> str | None:
    """The request field an engine error (``"SamplingParams: bad_words may ..."``) names, if any."""
    words = message.split(": ", 1)[-1].replace("[", " ").split()
    return words[0] if words and words[0] in SamplingFields.model_fields else None


def _validation_error(exc: RequestValidationError) -> APIError:
    """One 400 naming the first field at fault (pydantic reports each member of a union apart)."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(p) for p in first["loc"] if p != "body"]
    if not loc and first["type"] == "missing":
        return APIError(400, "the request body is empty: send a JSON object")
    if not loc:
        return APIError(400, f"the request body must be a JSON object, got {short_repr(first.get('input'))}")
    param = loc[0]
    same = list(dict.fromkeys(e["msg"] for e in errors if [str(p) for p in e["loc"] if p != "body"][:1] == [param]))
    where = ".".join(loc) if len(same) == 1 else param
    value = "" if first["type"] == "missing" else f", got {short_repr(first.get('input'))}"
    return APIError(400, f"{where}: {'; or '.join(same)}{value}", param=param)


@dataclass
class Piece:
    """What one engine step added to a choice: text, token ids (their logprobs when asked for), and
    the end when it ended."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


class Generation:
    """One choice: one engine request, its outputs turned into ``Piece`` s (``piece``).

    ``reason``: how it ended as the client saw it (``"abort"`` when closed early, ``"error"``);
    ``index``: its place in the response's ``choices``; ``prompt_logprobs``: the engine's, from the
    request's first output, when the request asked for them.
    """

    def __init__(self, index: int, request: Request, text: TextOutput | None, stop_ids: frozenset[int],
                 latency: Latency):
        self.index, self.request, self.text, self.stop_ids, self.latency = index, request, text, stop_ids, latency
        self.loop: EngineLoop | None = None
        self.handle: Handle | None = None
        self.completion_tokens = 0
        self.finished = False
        self.reason: str | None = None
        self.arrival, self.last = time.perf_counter(), None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache held (its first output says)

    def close(self) -> None:
        """Abort the request unless it ended (a client gone, a stop string, a sibling's error)."""
        if not self.finished:
            self.finished, self.reason = True, self.reason or "abort"
            if self.handle is not None:
                self.loop.abort(self.handle)

    def piece(self, item) -> Piece:
        if isinstance(item, BaseException):  # the engine failed for good (EngineDead)
            self.finished, self.reason = True, "error"
            raise APIError(500, f"generation failed: {item}", code="engine_dead")
        out: RequestOutput = item
        if out.finish_reason == "error":  # the engine failed this request alone, and ended it
            self.finished, self.reason = True, "error"
            raise APIError(500, f"generation failed: {out.error or 'the engine gave no reason'}", code="engine_error")
        kept, text, logprobs = out.new_token_ids, "", out.logprobs
        if out.cached_tokens is not None:
            self.cached_tokens = out.cached_tokens
        if self.request.logprobs is not None and kept and (logprobs is None or len(logprobs) < len(kept)):
            self._fail(f"the engine returned logprobs for {0 if logprobs is None else len(logprobs)} of "
                       f"{len(kept)} tokens of a request that asked for them")
        if self.request.prompt_logprobs is not None and self.prompt_logprobs is None:  # its first output
            scored = out.prompt_logprobs
            if scored is None or len(scored) != len(self.request.prompt_ids):
                self._fail(f"the engine returned prompt logprobs for {0 if scored is None else len(scored)} of "
                           f"{len(self.request.prompt_ids)} prompt tokens of a request that asked for them")
            self.prompt_logprobs = scored
        if self.text is not None:  # the stop / EOS token that ended the output is no text (vLLM's rule)
            text_ids = kept if out.stop_token_id is None else kept[:-1]
            text, used = self.text.add(text_ids)
            kept = kept[:used] if used < len(text_ids) else kept
        logprobs = (logprobs or [])[:len(kept)] if self.request.logprobs is not None else None  # none: no tokens
        self.completion_tokens += len(kept)
        self._observe(bool(kept))
        if self.text is not None and self.text.stopped is not None:
            self._end("stop")
            self.close()  # the engine would go on generating
            return Piece(text, kept, "stop", self.text.stopped, logprobs)
        if not out.finished:
            return Piece(text, kept, logprobs=logprobs)
        self.finished = True
        self._end(out.finish_reason)
        if self.text is not None:
            text += self.text.flush()
        # vLLM's stop_reason: the stop token id that ended it (None for EOS)
        stop_reason = kept[-1] if out.finish_reason == "stop" and kept and kept[-1] in self.stop_ids else None
        return Piece(text, kept, out.finish_reason, stop_reason, logprobs)

    def _fail(self, message: str):
        self.reason = "error"
        self.close()
        raise APIError(500, message, code="engine_error")

    def _observe(self, tokens: bool) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.latency.ttft.observe(now - self.arrival)
        else:
            self.latency.itl.observe(now - self.last)
        self.last = now

    def _end(self, reason: str) -> None:
        self.reason = reason
        if reason in ("stop", "length"):
            self.latency.e2e.observe(time.perf_counter() - self.arrival)


class Choices:
    """The choices of one HTTP request, their outputs from one queue of ``(index, item)``; iterating
    yields ``(generation, piece)`` until every choice ended. Closing (at the end, or early) aborts
    the choices still running and counts each one's end in ``counters``."""

    def __init__(self, gens: list[Generation], queue: asyncio.Queue, counters: ServerCounters, prompt_tokens: int):
        self.gens, self.queue, self.counters, self.prompt_tokens = gens, queue, counters, prompt_tokens
        self.early: list[tuple[int, object]] = []  # outputs that came while others waited for acceptance
        self.counted = False

    async def accepted(self) -> None:
        """Wait until the engine queued every choice; its refusal of one (400) drops them all."""
        waiting = {g.index for g in self.gens}
        try:
            while waiting:
                index, item = await self.queue.get()
                if item is ACCEPTED:
                    waiting.discard(index)
                elif isinstance(item, (ValueError, TypeError)):  # the engine names the field when not the prompt
                    raise APIError(400, str(item), getattr(item, "param", "prompt"))
                elif isinstance(item, BaseException):
                    raise APIError(500, f"generation failed: {item}", code="engine_dead")
                else:
                    self.early.append((index, item))
        except BaseException:
            self.close(count=False)  # the client never saw these
            raise

    async def __aiter__(self) -> AsyncIterator[tuple[Generation, Piece]]:
        by_index = {g.index: g for g in self.gens}
        try:
            while not all(g.finished for g in self.gens):
                index, item = self.early.pop(0) if self.early else await self.queue.get()
                gen = by_index[index]
                if not gen.finished:  # else: what was in flight when it stopped early
                    yield gen, gen.piece(item)
        finally:
            self.close()

    def close(self, count: bool = True) -> None:
        for gen in self.gens:
            gen.close()
        if count and not self.counted:
            for gen in self.gens:
                self.counters.finished[gen.reason] += 1
        self.counted = True

    @property
    def usage(self) -> UsageInfo:
        p, c = self.prompt_tokens, sum(g.completion_tokens for g in self.gens)
        cached = max(g.cached_tokens for g in self.gens)  # the one prompt's tokens found in the cache
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class _Server:
    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, chat_template: str | None,
                 trust_request_chat_template: bool, model_root: str | None, tool_parser: ToolParser):
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.tool_parser = tool_parser  # reads the calls of tool_choice "auto"
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.model_root = model_root
        self.counters = ServerCounters()
        self.registry, self.latency = registry(loop, self.counters, model_name)
        self._token_texts: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.loop.max_model_len

    # ---- endpoints ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: HTTPRequest):
        self._check(body)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (the prompt echoed and scored, nothing generated)",
                           "max_tokens")
        prompts = self._completion_prompts(body.prompt)
        limits = [self._max_tokens(p, body.max_tokens, "prompt", j if len(prompts) > 1 else None)
                  for j, p in enumerate(prompts)]
        # echo with logprobs scores the prompt as vLLM does: its tokens' logprobs come first
        prompt_k = max((k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None),
                       default=None)
        choices = await self._start(body, prompts, limits, body.logprobs, prompt_k)
        rid, tokens = random_id("cmpl"), body.return_token_ids
        echoes = [self._echo_text(ids, sent) for ids, sent in zip(prompts, _prompt_list(body.prompt))] if body.echo \
            else []
        offsets = {g.index: 0 for g in choices.gens}  # text sent so far per choice (logprobs' text_offset)

        def choice(gen: Generation, pieces: list[Piece], first: bool) -> CompletionChoice:
            echoing = body.echo and first
            echo, start = echoes[gen.index // body.n] if echoing else "", offsets[gen.index]
            text = echo + "".join(p.text for p in pieces)
            logprobs = None
            if body.logprobs is not None:
                prompt = zip(gen.request.prompt_ids, gen.prompt_logprobs) if echoing else ()
                logprobs = self._completion_logprobs([(lp.token_id, lp) for p in pieces for lp in p.logprobs],
                                                     body.logprobs, start + len(echo),
                                                     self._completion_logprobs(prompt, body.logprobs, start))
            offsets[gen.index] += len(text)
            scored = self._prompt_logprobs(gen.prompt_logprobs, body.prompt_logprobs) if first else None
            return CompletionChoice(
                index=gen.index, text=text, logprobs=logprobs, finish_reason=pieces[-1].finish_reason,
                stop_reason=pieces[-1].stop_reason, prompt_logprobs=scored,
                prompt_token_ids=gen.request.prompt_ids if tokens and first else None,
                token_ids=[t for p in pieces for t in p.token_ids] if tokens else None)

        def response(choice_list: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
            return CompletionResponse(id=rid, model=self.model_name, choices=choice_list, usage=usage)

        if body.stream:
            return self._sse(choices, body, lambda gen, piece, first, usage: response([choice(gen, [piece], first)], usage),
                             lambda usage: response([], usage))
        pieces = await self._collect(raw, choices)
        return response([choice(g, pieces[g.index], True) for g in choices.gens], choices.usage)

    async def chat(self, body: ChatCompletionRequest, raw: HTTPRequest):
        self._check(body)
        if body.echo:
            raise APIError(400, "echo is not supported on chat completions by this server: use /v1/completions "
                                "with echo: true", "echo")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, f"top_logprobs ({body.top_logprobs}) needs logprobs: true", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        tools = _tool_choice(body)
        parser = None if tools is None else tools.parser(self.tool_parser)
        prompt_ids = self._chat_prompt(body, tools)
        wanted = body.max_completion_tokens or body.max_tokens
        keep_special = parser is not None and parser.reads_special_tokens
        choices = await self._start(body, [prompt_ids], [self._max_tokens(prompt_ids, wanted, "messages")], k,
                                    body.prompt_logprobs, keep_special)
        rid, tokens = random_id("chatcmpl"), body.return_token_ids
        prompt_out = prompt_ids if tokens else None

        def logprobs(pieces: list[Piece]) -> ChatLogprobs | None:
            return None if k is None else self._chat_logprobs([lp for p in pieces for lp in p.logprobs], k)

        if body.stream:
            streams = {g.index: ToolCallStream(parser) for g in choices.gens} if parser is not None else {}

            def chunk(gen: Generation, piece: Piece, first: bool, usage: UsageInfo | None) -> ChatCompletionChunk:
                content, calls, finish = piece.text, None, piece.finish_reason
                stream = streams.get(gen.index)
                if stream is not None:
                    content, calls = _tool_delta(stream, piece)
                    finish = _tool_finish(finish, stream.calls)
                choice = ChatStreamChoice(
                    index=gen.index, delta=DeltaMessage(role="assistant" if first else None, content=content,
                                                        tool_calls=calls),
                    logprobs=logprobs([piece]), finish_reason=finish, stop_reason=piece.stop_reason,
                    token_ids=piece.token_ids if tokens else None)
                return ChatCompletionChunk(id=rid, model=self.model_name, choices=[choice], usage=usage,
                                           prompt_token_ids=prompt_out if first else None)

            return self._sse(choices, body, chunk,
                             lambda usage: ChatCompletionChunk(id=rid, model=self.model_name, choices=[], usage=usage))
        pieces = await self._collect(raw, choices)

        def message(ps: list[Piece]) -> tuple[AssistantMessage, str | None]:
            text = "".join(p.text for p in ps)
            if parser is None:
                return AssistantMessage(content=text), ps[-1].finish_reason
            content, calls = parse_calls(parser, text)
            return AssistantMessage(content=content, tool_calls=calls), _tool_finish(ps[-1].finish_reason, len(calls))

        choice_list = [ChatChoice(index=g.index, message=msg, logprobs=logprobs(ps), finish_reason=finish,
                                  stop_reason=ps[-1].stop_reason,
                                  token_ids=[t for p in ps for t in p.token_ids] if tokens else None)
                       for g in choices.gens for ps in [pieces[g.index]] for msg, finish in [message(ps)]]
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=choice_list, usage=choices.usage,
                                      prompt_token_ids=prompt_out,
                                      prompt_logprobs=self._prompt_logprobs(choices.gens[0].prompt_logprobs,
                                                                            body.prompt_logprobs))

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)])

    async def health(self) -> Response:
        if not self.loop.alive:
            error = self.loop.error
            reason = f"the engine stopped: {type(error).__name__}: {error}" if error else "the engine is not running"
            raise APIError(503, reason, code="unavailable")
        return Response(status_code=200)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- requests to engine requests ------------------------------------------------------------

    def _check(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")
        refused = body.refused_field()
        if refused is not None:
            raise APIError(400, refused.message, refused.path)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true (as vLLM)", "prompt_logprobs")
        if self.tokenizer is None and self._stop_strings(body):
            raise APIError(400, "stop strings need a tokenizer and this server has none: use stop token ids", "stop")

    @staticmethod
    def _stop_strings(body: SamplingFields) -> list[str]:
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        return [s for s in stop if isinstance(s, str)]

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """The prompts as token ids: a text, token ids, or a list of either (vLLM's batch)."""
        prompts = _prompt_list(prompt)
        many = prompts is prompt
        out = []
        for j, one in enumerate(prompts):
            name = f"prompt[{j}]" if many else "the prompt"
            if isinstance(one, str):
                if self.tokenizer is None:
                    raise APIError(400, "this server has no tokenizer: send the prompt as token ids", "prompt")
                one = self.tokenizer(one)["input_ids"]
            if not one:
                raise APIError(400, f"{name} is empty", "prompt")
            out.append(list(one))
        return out

    def _echo_text(self, prompt_ids: list[int], sent) -> str:
        """A prompt as echo returns it: the text sent, or its token ids decoded (no tokenizer: no text)."""
        if isinstance(sent, str):
            return sent
        return "" if self.tokenizer is None else self.tokenizer.decode(prompt_ids)

    def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolChoice | None) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer, which chat needs: use /v1/completions with token ids",
                           "messages")
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "this server does not take chat templates from requests "
                                "(start it with --trust-request-chat-template)", "chat_template")
        template = body.chat_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, f"the tokenizer of `{self.model_name}` has no chat template, so chat completions are "
                                "not available: use /v1/completions, or start the server with --chat-template FILE",
                           "messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                     else "".join(part.text for part in m.content), **({"name": m.name} if m.name else {}),
                     **({"tool_calls": _template_calls(m.tool_calls)} if m.tool_calls else {}),
                     **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                    for m in body.messages]
        tools = None if tools is None else list(tools.tools)
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools,
                                                      add_generation_prompt=body.add_generation_prompt)
        except TemplateError as exc:
            raise APIError(400, f"the chat template failed on these messages: {exc}", "messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote any BOS
        if not ids:
            raise APIError(400, "the messages make an empty prompt", "messages")
        return ids

    def _max_tokens(self, prompt_ids: list[int], wanted: int | None, prompt_field: str,
                    which: int | None = None) -> int:
        limit, n = self.max_model_len, len(prompt_ids)
        prompt = prompt_field if which is None else f"{prompt_field}[{which}]"
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {prompt} has "
                                f"{n} tokens, which leaves no room for a completion. Please shorten the prompt.",
                           prompt_field)
        if wanted is None:
            return limit - n
        if n + wanted > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n + wanted} tokens ({n} in the {prompt}, {wanted} for the completion). "
                                "Please reduce the length of the prompt or max_tokens.", "max_tokens")
        return wanted

    async def _start(self, body: SamplingFields, prompts: list[list[int]], max_tokens: list[int],
                     logprobs: int | None, prompt_logprobs: int | None = None, keep_special: bool = False) -> Choices:
        """Queue ``body.n`` requests per prompt (choice ``prompt_index * n + i``); returns once the
        engine has accepted all of them (or raises the refusal). The text keeps special tokens when
        the request asks (``skip_special_tokens`` false) or its tool parser reads them (``keep_special``)."""
        total, capacity = len(prompts) * body.n, self.loop.capacity
        if capacity is not None and total > capacity:
            raise APIError(400, f"{len(prompts)} prompt(s) x n={body.n} make {total} choices, more than this server "
                                f"holds in flight ({capacity}): send fewer prompts or a smaller n", "n")
        stop = [body.stop] if isinstance(body.stop, (str, int)) else body.stop or []
        stop_ids = frozenset([s for s in stop if isinstance(s, int)] + (body.stop_token_ids or []))
        bad_words = self._bad_words(body)
        gens = []
        for j, (prompt_ids, limit) in enumerate(zip(prompts, max_tokens)):
            for i in range(body.n):
                request = self._request(body, prompt_ids, limit, self._seed(body.seed, i), stop_ids, bad_words,
                                        logprobs, prompt_logprobs)
                text = None
                if self.tokenizer is not None:
                    text = TextOutput(self.tokenizer, prompt_ids, self._stop_strings(body), body.min_tokens or 0,
                                      skip_special_tokens=body.skip_special_tokens and not keep_special)
                gens.append(Generation(j * body.n + i, request, text, stop_ids, self.latency))
        queue: asyncio.Queue = asyncio.Queue()
        choices = Choices(gens, queue, self.counters, sum(len(p) for p in prompts))
        try:
            for gen in gens:
                gen.loop, gen.handle = self.loop, self._submit(gen.request, queue, gen.index)
        except APIError:
            choices.close(count=False)
            raise
        await choices.accepted()
        self.counters.prompt_tokens += sum(len(g.request.prompt_ids) for g in gens)
        return choices

    @staticmethod
    def _seed(seed: int | None, sample: int) -> int:
        """Sample ``sample``'s seed: random without a request seed (unseeded requests differ), else
        ``seed + sample`` (vLLM's rule: the n samples differ and each repeats)."""
        return secrets.randbits(64) if seed is None else (seed + sample) % (UINT64_MAX + 1)

    def _bad_words(self, body: SamplingFields) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` tokenized as vLLM (``encode_bad_words``); a 400 naming the field otherwise."""
        try:
            return encode_bad_words(body.bad_words or [], self.tokenizer, name="request")
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), "bad_words") from None

    @staticmethod
    def _request(body: SamplingFields, prompt_ids: list[int], max_tokens: int, seed: int, stop_ids: frozenset[int],
                 bad_words: tuple[tuple[int, ...], ...], logprobs: int | None, prompt_logprobs: int | None) -> Request:
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0  # vLLM's -1 / 0: off
        logit_bias = _logit_bias(body.logit_bias)
        if (body.min_tokens or 0) > max_tokens:
            raise APIError(400, f"min_tokens must be at most max_tokens ({max_tokens}), got {body.min_tokens}",
                           "min_tokens")
        structured = structured_outputs(body)
        try:
            sampling = SamplingParams(
                1.0 if body.temperature is None else body.temperature, top_k, 1.0 if body.top_p is None else body.top_p,
                seed, body.min_p or 0.0, logit_bias, structured, presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                min_tokens=body.min_tokens or 0, bad_words=bad_words)
            return Request(prompt_ids, max_tokens, sampling, stop_ids=tuple(sorted(stop_ids)),
                           ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                           disable_spec_decode=body.disable_spec_decode)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), _field_named(str(exc))) from None

    def _submit(self, request: Request, queue: asyncio.Queue, index: int) -> Handle:
        event_loop = asyncio.get_running_loop()

        def sink(item) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is listening
                event_loop.call_soon_threadsafe(queue.put_nowait, (index, item))

        try:
            return self.loop.submit(request, sink)
        except QueueFull as exc:
            self.counters.rejected += 1
            raise APIError(429, str(exc), code="queue_full") from None
        except (ServerClosing, EngineDead) as exc:
            raise APIError(503, str(exc), code="unavailable") from None

    # ---- logprobs -------------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        """A token's text alone (special tokens spelled out), as in OpenAI's logprobs; without a
        tokenizer vLLM's ``token_id:N``."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def _completion_logprobs(self, tokens, k: int, offset: int, out: CompletionLogprobs | None = None
                             ) -> CompletionLogprobs:
        """OpenAI's legacy shape of ``tokens`` ``(token id, TokenLogprobs or None)`` appended to ``out``;
        ``top_logprobs``: the chosen token and the ``k`` most likely (so k or k + 1 entries, as
        OpenAI), both null for a token without logprobs (an echoed prompt's first); ``offset``: where
        this text starts in the choice's text."""
        out = out if out is not None else CompletionLogprobs()
        for token_id, lp in tokens:
            token = self._token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_floor(lp.logprob))
            top = {token: _floor(lp.logprob)}
            for top_id, value in lp.top[:k]:
                top.setdefault(self._token_text(top_id), _floor(value))
            out.top_logprobs.append(top)
        return out

    def _prompt_logprobs(self, scored: list[TokenLogprobs | None] | None, k: int | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` (None unless asked for: ``k``): per prompt position, by token id,
        the prompt's token and the ``k`` most likely (ranks 1 .. k); None at the first."""
        if k is None:
            return None

        def entry(token_id: int, value: float, rank: int | None) -> PromptLogprob:
            return PromptLogprob(logprob=_floor(value), rank=rank, decoded_token=self._token_text(token_id))

        out: PromptLogprobs = []
        for lp in scored:
            if lp is None:
                out.append(None)
                continue
            tokens = {lp.token_id: entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, value) in enumerate(lp.top[:k], 1):
                tokens.setdefault(token_id, entry(token_id, value, rank))
            out.append(tokens)
        return out

    def _chat_logprobs(self, logprobs: list[TokenLogprobs], k: int) -> ChatLogprobs:
        def entry(token_id: int, value: float) -> dict:
            token = self._token_text(token_id)
            return {"token": token, "logprob": _floor(value), "bytes": list(token.encode("utf-8"))}

        return ChatLogprobs(content=[ChatTokenLogprob(**entry(lp.token_id, lp.logprob),
                                                      top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top[:k]])
                                     for lp in logprobs])

    # ---- responses ------------------------------------------------------------------------------

    async def _collect(self, raw: HTTPRequest, choices: Choices) -> dict[int, list[Piece]]:
        """Every choice's pieces; a client that disconnects first has its requests aborted."""

        async def pieces() -> dict[int, list[Piece]]:
            out: dict[int, list[Piece]] = {g.index: [] for g in choices.gens}
            async for gen, piece in choices:
                out[gen.index].append(piece)
            return out

        work = asyncio.ensure_future(pieces())
        gone = asyncio.ensure_future(_disconnected(raw))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            choices.close()
            raise APIError(499, "the client disconnected")  # nobody reads it (499: nginx's "client closed request")
        return work.result()

    def _sse(self, choices: Choices, body: SamplingFields, chunk, usage_chunk) -> StreamingResponse:
        """``chunk(generation, piece, first, usage)`` per piece with tokens (or the end), then the
        usage chunk (``stream_options.include_usage``) and ``[DONE]``; an error, once the stream
        began, as an in-band ``{"error": ...}`` event (as vLLM), the other choices aborted."""
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats

        async def events():
            started: set[int] = set()
            try:
                async for gen, piece in choices:
                    if not piece.token_ids and piece.finish_reason is None:
                        continue
                    first = gen.index not in started
                    started.add(gen.index)
                    yield f"data: {chunk(gen, piece, first, choices.usage if continuous else None).model_dump_json()}\n\n"
                if include_usage:
                    yield f"data: {usage_chunk(choices.usage).model_dump_json()}\n\n"
                yield "data: [DONE]\n\n"
            except APIError as exc:
                info = ErrorInfo(message=exc.message, type=ERROR_TYPES.get(exc.status, "server_error"), param=exc.param,
                                 code=exc.code)
                yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\ndata: [DONE]\n\n"
            finally:
                choices.close()

        return StreamingResponse(events(), media_type="text/event-stream")


def _tool_delta(stream: ToolCallStream, piece: Piece) -> tuple[str | None, list[dict] | None]:
    """A streamed piece's content and tool-call deltas (the calls completed at the end)."""
    content, calls = stream.feed(piece.text)
    if piece.finish_reason is not None:
        more, finished = stream.finish()
        content, calls = (content or "") + (more or "") or None, calls + finished
    return content, calls or None


def _tool_finish(reason: str | None, calls: int) -> str | None:
    """An answer that ended by itself with tool calls ends with ``"tool_calls"`` (OpenAI's)."""
    return "tool_calls" if reason == "stop" and calls else reason


def _template_calls(calls: list[dict]) -> list[dict]:
    """An assistant turn's ``tool_calls`` as chat templates read them: Qwen's and Hermes' write
    ``function.arguments`` as JSON, so a string of it is parsed back (others stay as sent)."""
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        out.append({**call, "function": function})
    return out


def _prompt_list(prompt) -> list:
    """A completion's ``prompt`` as a list of prompts (the same list when it is one, vLLM's batch)."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return prompt if many else [prompt]


def _floor(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


async def _disconnected(raw: HTTPRequest) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
