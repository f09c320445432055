"""The engine loop: one background thread owns the (not thread-safe) ``LLMEngine``.

Between two engine steps the thread takes the requests submitted and aborted since the last step
(a lock-protected inbox, so the HTTP side never touches the engine), then runs one step for every
running request and hands each request's outputs to its sink -- once the next step's round is
launched (``LLMEngine.launch`` / ``finish``), so that they are streamed while the GPU works. A sink is called on the engine
thread; the server's sinks forward to an asyncio queue with ``loop.call_soon_threadsafe``.

What a sink receives, in order: ``ACCEPTED`` (the engine queued the request) or the exception
``add_request`` raised; then ``RequestOutput`` s, the last one with ``finished`` set
(``finish_reason`` ``"abort"`` after ``abort``, ``"error"`` with ``error`` set when the engine
failed this request alone); or an ``EngineDead`` error if an exception escapes the engine
(``add_request``'s ValueError / TypeError aside: those refuse one request). An escaped exception
means the engine cannot go on: the loop logs it (logger ``dspark.serve``), fails every request in
flight, keeps refusing new ones and calls ``on_failure`` so that the server can shut down.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..engine.llm_engine import LLMEngine
from ..engine.request import Request, RequestOutput

__all__ = ["ACCEPTED", "EngineDead", "EngineLoop", "Handle", "QueueFull", "ServerClosing", "check_admission"]

ACCEPTED = "accepted"

logger = logging.getLogger("dspark.serve")


class QueueFull(RuntimeError):
    """The waiting queue is full (the server answers 429)."""


class ServerClosing(RuntimeError):
    """The loop is shutting down and takes no new requests (503)."""


class EngineDead(RuntimeError):
    """An engine step raised; the loop stopped (500 for requests in flight, 503 afterwards)."""


def check_admission(error: BaseException | None, closing: bool, in_flight: int, capacity: int | None,
                    max_batch: int) -> None:
    """Raise what refuses a new request: ``EngineDead`` after a failure, ``ServerClosing`` while
    shutting down, ``QueueFull`` with ``in_flight`` requests at ``capacity`` (``max_batch`` of them running)."""
    if error is not None:
        raise EngineDead(f"the engine stopped after an error: {error}")
    if closing:
        raise ServerClosing("the server is shutting down")
    if capacity is not None and in_flight >= capacity:
        raise QueueFull(f"the server is at capacity: {in_flight} requests in flight ({max_batch} running, "
                        f"{capacity - max_batch} waiting at most); retry later")


@dataclass(eq=False)
class Handle:
    """A submitted request: the HTTP side's reference for ``abort`` (the engine id is known only on
    the engine thread)."""

    request: Request
    sink: Callable[[object], None]
    request_id: int | None = None
    done: bool = field(default=False)


class EngineLoop:
    """Drive ``engine`` from one daemon thread.

    ``max_waiting``: how many requests may wait for a batch row beyond the ``max_batch`` running
    ones; ``submit`` raises ``QueueFull`` past that (None: unbounded). ``on_failure(exc)``: called on
    the engine thread once the engine failed for good (after every client heard of it).
    ``after_pass()``: called on the engine thread once per pass of the loop, after that pass's items
    went to their sinks and while its step runs on the device (the engine process sends them to its
    parent in one message).
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 after_pass: Callable[[], None] | None = None):
        self.engine = engine
        self.on_failure, self.after_pass = on_failure, after_pass
        self.capacity = None if max_waiting is None else engine.config.max_batch + max_waiting
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Handle]] = []
        self._live: dict[int, Handle] = {}  # engine request id -> handle (engine thread only)
        self._in_flight = 0  # submitted and not finished (guarded by _cond)
        self._closing = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)

    # ---- the HTTP side (any thread) -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def metrics(self):
        """The engine's counters (``LLMEngine.metrics``)."""
        return self.engine.metrics

    @property
    def pending(self) -> int:
        """Requests submitted but not yet handed to the engine."""
        with self._cond:
            return sum(kind == "add" for kind, _ in self._inbox)

    def submit(self, request: Request, sink: Callable[[object], None]) -> Handle:
        with self._cond:
            check_admission(self.error, self._closing, self._in_flight, self.capacity, self.engine.config.max_batch)
            handle = Handle(request, sink)
            self._in_flight += 1
            self._inbox.append(("add", handle))
            self._cond.notify()
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request (no-op once it finished); its sink gets a final ``"abort"`` output."""
        with self._cond:
            if not handle.done:
                self._inbox.append(("abort", handle))
                self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests, abort those still in flight, and join the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        pending: list[RequestOutput] = []  # the last step's outputs: handed out while the next round runs
        try:
            while True:
                with self._cond:
                    while not self._inbox and not engine.has_unfinished() and not pending and not self._closing:
                        self._cond.wait()
                    commands, self._inbox, closing = self._inbox, [], self._closing
                if closing or any(kind == "abort" for kind, _ in commands):
                    pending = self._deliver_all(pending)  # a request's outputs come before its abort
                for kind, handle in commands:
                    self._add(handle) if kind == "add" and not closing else self._abort(handle)
                if closing:  # what is left has no client (the server drained first): abort it all
                    for handle in list(self._live.values()):
                        self._abort(handle)
                    return
                if engine.has_unfinished():
                    # Launch first, then hand out the last outputs: the HTTP side (which shares the
                    # GIL) streams them while the GPU runs, not while this thread prepares the round.
                    engine.launch()
                    self._deliver_all(pending)
                    self._passed()
                    pending = engine.finish()
                else:
                    pending = self._deliver_all(pending)
                    self._passed()
        except BaseException as exc:  # noqa: BLE001 -- every client must hear about it, then the loop ends
            self._fail(exc)

    def _passed(self) -> None:
        if self.after_pass is not None:
            self.after_pass()

    def _deliver_all(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            self._deliver(self._live[out.request_id], out)
        return []

    def _add(self, handle: Handle) -> None:
        if handle.done:
            return
        try:
            handle.request_id = self.engine.add_request(handle.request)
        except (ValueError, TypeError) as exc:
            self._finish(handle)
            handle.sink(exc)
            return
        self._live[handle.request_id] = handle
        handle.sink(ACCEPTED)

    def _abort(self, handle: Handle) -> None:
        if handle.done:
            return
        if handle.request_id is not None:
            self.engine.abort(handle.request_id)
        self._deliver(handle, RequestOutput(handle.request_id, [], True, "abort"))

    def _deliver(self, handle: Handle, out: RequestOutput) -> None:
        if out.finished:
            self._finish(handle)
        handle.sink(out)

    def _finish(self, handle: Handle) -> None:
        self._live.pop(handle.request_id, None)
        # LLMEngine keeps a finished request's Sequence until generate() collects it; a server has
        # no generate() call, so drop it here or a long-running server would keep every output.
        self.engine.sequences.pop(handle.request_id, None)
        with self._cond:
            handle.done = True
            self._in_flight -= 1

    def _fail(self, exc: BaseException) -> None:
        logger.error("the engine failed and cannot go on; failing the requests in flight", exc_info=exc)
        with self._cond:
            self.error = exc
            handles = list(self._live.values()) + [h for kind, h in self._inbox if kind == "add"]
            self._inbox = []
        error = EngineDead(f"the engine stopped after an error: {type(exc).__name__}: {exc}")
        for handle in dict.fromkeys(handles):
            if not handle.done:
                handle.done = True
                handle.sink(error)
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:  # noqa: BLE001 -- the callback's own bug must not hide the engine's
                logger.exception("on_failure raised")
