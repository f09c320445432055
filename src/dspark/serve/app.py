"""The OpenAI-compatible HTTP server: ``create_app(engine, tokenizer, model_name)`` -> a FastAPI app.

Endpoints as vLLM's server: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
server-sent-event streaming), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. The engine runs
on the ``EngineLoop`` thread; each request has an asyncio queue that the loop feeds. Every refusal
is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (5xx
only when the engine itself failed); it touches no other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.drafting import SamplingParams
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request, RequestOutput
from .engine_loop import ACCEPTED, EngineDead, EngineLoop, Handle, QueueFull, ServerClosing
from .metrics import ServerCounters, registry
from .protocol import (CHAT_DEFAULTS, AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatStreamChoice, CompletionChoice, CompletionRequest,
                       CompletionResponse, DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                       SamplingFields, UsageInfo, random_id)
from .text import TextOutput

__all__ = ["APIError", "create_app"]

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An OpenAI error response: ``status``, ``message`` and the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=self.status)


def create_app(engine: LLMEngine, tokenizer, model_name: str, *, max_waiting: int | None = None,
               chat_template: str | None = None, trust_request_chat_template: bool = False,
               model_root: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` (it starts the engine thread on startup, stops it on shutdown).

    ``tokenizer``: a transformers tokenizer, or None (then prompts must be token ids, the text of
    every response is empty and ``return_token_ids`` carries the output); ``model_name``: the only
    name ``model`` may take; ``max_waiting``: requests waiting beyond the running batch before new
    ones get 429 (None: unbounded); ``chat_template``: a Jinja template replacing the tokenizer's;
    ``trust_request_chat_template``: let a chat request bring its own ``chat_template`` (as vLLM's
    flag of that name; off by default: a template is code the server renders).
    """
    server = _Server(EngineLoop(engine, max_waiting), tokenizer, model_name, chat_template,
                     trust_request_chat_template, model_root)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        # uvicorn ran this after the connections drained: what is still in flight has no client.
        await asyncio.to_thread(server.loop.stop, 60.0)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(APIError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda _, exc: _validation_error(exc).response())
    # a bug still answers in OpenAI's shape (Starlette logs the traceback on the server side)
    app.add_exception_handler(Exception, lambda _, exc: APIError(500, f"internal error: {type(exc).__name__}: {exc}")
                              .response())
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


def _validation_error(exc: RequestValidationError) -> APIError:
    """One 400 naming the first field at fault (pydantic reports each member of a union apart)."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(p) for p in first["loc"] if p != "body"]
    if not loc:
        return APIError(400, f"the request body must be a JSON object, got {_short(first.get('input'))}")
    param = loc[0]
    same = list(dict.fromkeys(e["msg"] for e in errors if [str(p) for p in e["loc"] if p != "body"][:1] == [param]))
    where = ".".join(loc) if len(same) == 1 else param
    value = "" if first["type"] == "missing" else f", got {_short(first.get('input'))}"
    return APIError(400, f"{where}: {'; or '.join(same)}{value}", param=param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Piece:
    """What one engine step added to a response: text, token ids, and the end when it ended."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """One request in the engine, as an async iterator of ``Piece`` s (aborted when left early)."""

    def __init__(self, loop: EngineLoop, handle: Handle, queue: asyncio.Queue, text: TextOutput | None,
                 stop_ids: frozenset[int]):
        self.loop, self.handle, self.queue, self.text, self.stop_ids = loop, handle, queue, text, stop_ids
        self.prompt_ids = handle.request.prompt_ids
        self.completion_tokens = 0
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[Piece]:
        try:
            while not self.finished:
                yield self._piece(await self.queue.get())
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it ended (a client gone, a stop string, a server error)."""
        if not self.finished:
            self.finished = True
            self.loop.abort(self.handle)

    def _piece(self, item) -> Piece:
        if isinstance(item, BaseException):
            self.finished = True
            raise APIError(500, f"generation failed: {item}")
        out: RequestOutput = item
        kept, text = out.new_token_ids, ""
        if self.text is not None:
            text, used = self.text.add(kept)
            kept = kept[:used]
        self.completion_tokens += len(kept)
        if self.text is not None and self.text.stopped is not None:
            self.close()  # the engine would go on generating
            return Piece(text, kept, "stop", self.text.stopped)
        if not out.finished:
            return Piece(text, kept)
        self.finished = True
        if self.text is not None:
            text += self.text.flush()
        # vLLM's stop_reason: the stop token id that ended it (None for EOS)
        stop_reason = kept[-1] if out.finish_reason == "stop" and kept and kept[-1] in self.stop_ids else None
        return Piece(text, kept, out.finish_reason, stop_reason)

    @property
    def usage(self) -> UsageInfo:
        p, c = len(self.prompt_ids), self.completion_tokens
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


class _Server:
    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, chat_template: str | None,
                 trust_request_chat_template: bool, model_root: str | None):
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.model_root = model_root
        self.counters = ServerCounters()
        self.registry = registry(loop, self.counters, model_name)

    @property
    def max_model_len(self) -> int:
        return self.loop.engine.max_model_len

    # ---- endpoints ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: HTTPRequest):
        self._check(body, body.unsupported_fields())
        prompt_ids = self._completion_prompt(body.prompt)
        gen = await self._start(body, prompt_ids, self._max_tokens(prompt_ids, body.max_tokens, "prompt"))
        rid = random_id("cmpl")
        tokens = body.return_token_ids

        def response(pieces: list[Piece], usage: UsageInfo | None, first: bool) -> CompletionResponse:
            choices = [CompletionChoice(
                text="".join(p.text for p in pieces), finish_reason=pieces[-1].finish_reason,
                stop_reason=pieces[-1].stop_reason, prompt_token_ids=prompt_ids if tokens and first else None,
                token_ids=[t for p in pieces for t in p.token_ids] if tokens else None)] if pieces else []
            return CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)

        if body.stream:
            return self._sse(gen, body, lambda piece, usage, first: response([piece], usage, first),
                             lambda usage: response([], usage, False))
        pieces = await self._collect(raw, gen)
        return response(pieces, gen.usage, True)

    async def chat(self, body: ChatCompletionRequest, raw: HTTPRequest):
        self._check(body, body.unsupported_fields(CHAT_DEFAULTS))
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        prompt_ids = self._chat_prompt(body)
        wanted = body.max_completion_tokens or body.max_tokens
        gen = await self._start(body, prompt_ids, self._max_tokens(prompt_ids, wanted, "messages"))
        rid = random_id("chatcmpl")
        tokens = body.return_token_ids
        prompt_out = prompt_ids if tokens else None

        if body.stream:
            def chunk(piece: Piece, usage: UsageInfo | None, first: bool) -> ChatCompletionChunk:
                choice = ChatStreamChoice(
                    delta=DeltaMessage(role="assistant" if first else None, content=piece.text),
                    finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
                    token_ids=piece.token_ids if tokens else None)
                return ChatCompletionChunk(id=rid, model=self.model_name, choices=[choice], usage=usage,
                                           prompt_token_ids=prompt_out if first else None)

            return self._sse(gen, body, chunk,
                             lambda usage: ChatCompletionChunk(id=rid, model=self.model_name, choices=[], usage=usage))
        pieces = await self._collect(raw, gen)
        choice = ChatChoice(message=AssistantMessage(content="".join(p.text for p in pieces)),
                            finish_reason=pieces[-1].finish_reason, stop_reason=pieces[-1].stop_reason,
                            token_ids=[t for p in pieces for t in p.token_ids] if tokens else None)
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=[choice], usage=gen.usage,
                                      prompt_token_ids=prompt_out)

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)])

    async def health(self) -> Response:
        if not self.loop.alive:
            reason = f"the engine stopped: {self.loop.error}" if self.loop.error else "the engine is not running"
            raise APIError(503, reason, code="unavailable")
        return Response(status_code=200)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- requests to engine requests ------------------------------------------------------------

    def _check(self, body: SamplingFields, unsupported: list[str]) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")
        if unsupported:
            raise APIError(400, f"{unsupported[0]} is not supported by this server", unsupported[0])
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        if self.tokenizer is None and self._stop_strings(body):
            raise APIError(400, "stop strings need a tokenizer and this server has none: use stop token ids", "stop")

    @staticmethod
    def _stop_strings(body: SamplingFields) -> list[str]:
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        return [s for s in stop if isinstance(s, str)]

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request: got a list of {len(prompt)} prompts", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send the prompt as token ids", "prompt")
            prompt = self.tokenizer(prompt)["input_ids"]
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        return list(prompt)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
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
                     else "".join(part.text for part in m.content), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt)
        except TemplateError as exc:
            raise APIError(400, f"the chat template failed on these messages: {exc}", "messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote any BOS
        if not ids:
            raise APIError(400, "the messages make an empty prompt", "messages")
        return ids

    def _max_tokens(self, prompt_ids: list[int], wanted: int | None, prompt_field: str) -> int:
        limit, n = self.max_model_len, len(prompt_ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                f"{n} tokens, which leaves no room for a completion. Please shorten the prompt.",
                           prompt_field)
        if wanted is None:
            return limit - n
        if n + wanted > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n + wanted} tokens ({n} in the {prompt_field}, {wanted} for the completion). "
                                "Please reduce the length of the prompt or max_tokens.", "max_tokens")
        return wanted

    async def _start(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int) -> Generation:
        """Queue the request; returns once the engine has accepted it (or raises its refusal)."""
        stop = [body.stop] if isinstance(body.stop, (str, int)) else body.stop or []
        stop_ids = frozenset([s for s in stop if isinstance(s, int)] + (body.stop_token_ids or []))
        seed = body.seed if body.seed is not None else secrets.randbits(64)  # unseeded requests differ
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0  # vLLM's -1 / 0: off
        try:
            sampling = SamplingParams(1.0 if body.temperature is None else body.temperature, top_k,
                                      1.0 if body.top_p is None else body.top_p, seed)
            request = Request(prompt_ids, max_tokens, sampling, stop_ids=tuple(sorted(stop_ids)),
                              ignore_eos=body.ignore_eos)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        queue: asyncio.Queue = asyncio.Queue()
        handle = self._submit(request, queue)
        first = await queue.get()
        if first is not ACCEPTED:
            if isinstance(first, (ValueError, TypeError)):
                raise APIError(400, str(first), "prompt")
            raise APIError(500, f"generation failed: {first}")
        self.counters.prompt_tokens += len(prompt_ids)
        text = TextOutput(self.tokenizer, prompt_ids, self._stop_strings(body)) if self.tokenizer else None
        return Generation(self.loop, handle, queue, text, stop_ids)

    def _submit(self, request: Request, queue: asyncio.Queue) -> Handle:
        event_loop = asyncio.get_running_loop()

        def sink(item) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is listening
                event_loop.call_soon_threadsafe(queue.put_nowait, item)

        try:
            return self.loop.submit(request, sink)
        except QueueFull as exc:
            self.counters.rejected += 1
            raise APIError(429, str(exc), code="queue_full") from None
        except (ServerClosing, EngineDead) as exc:
            raise APIError(503, str(exc), code="unavailable") from None

    # ---- responses ------------------------------------------------------------------------------

    async def _collect(self, raw: HTTPRequest, gen: Generation) -> list[Piece]:
        """All pieces; a client that disconnects first has its request aborted."""

        async def pieces() -> list[Piece]:
            return [piece async for piece in gen]

        work = asyncio.ensure_future(pieces())
        gone = asyncio.ensure_future(_disconnected(raw))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            gen.close()
            self.counters.finished["abort"] += 1
            raise APIError(499, "the client disconnected")  # nobody reads it (499: nginx's "client closed request")
        result = work.result()
        self.counters.finished[result[-1].finish_reason] += 1
        return result

    def _sse(self, gen: Generation, body: SamplingFields, chunk, usage_chunk) -> StreamingResponse:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        counters = self.counters

        async def events():
            first, reason = True, "abort"
            try:
                async for piece in gen:
                    if not piece.token_ids and piece.finish_reason is None:
                        continue
                    yield f"data: {chunk(piece, gen.usage if continuous else None, first).model_dump_json()}\n\n"
                    first = False
                    reason = piece.finish_reason or reason
                if include_usage:
                    yield f"data: {usage_chunk(gen.usage).model_dump_json()}\n\n"
                yield "data: [DONE]\n\n"
            except APIError as exc:  # the stream has begun: report in-band, as vLLM does
                info = ErrorInfo(message=exc.message, type=ERROR_TYPES[exc.status])
                yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\ndata: [DONE]\n\n"
            finally:
                counters.finished[reason] += 1
                gen.close()

        return StreamingResponse(events(), media_type="text/event-stream")


async def _disconnected(raw: HTTPRequest) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
