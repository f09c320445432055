"""The engine in its own process: ``dspark serve``'s HTTP side and the engine share no GIL.

vLLM's split (API server / engine core). With one process the engine thread gave the GIL away at
every CUDA-graph replay and device synchronisation and, to take it back, waited for the event
loop, which at 64 streams is busy most of a step with detokenising and JSON; that wait sat on the
engine's critical path (its host time per step grew with the number of clients). Here the parent
keeps FastAPI, tokenising, detokenising and the metrics endpoint; a spawned child builds the engine
and runs an ``EngineLoop`` over it.

One duplex pipe. Parent -> child: ``("add", id, Request)``, ``("abort", id)``, ``("stop",)``.
Child -> parent: ``("ready", info)`` once the engine is built (or ``("failed", message)``), then
one ``("items", [(id, item), ...], metrics)`` per pass of the child's loop -- what its sinks got
(``ACCEPTED``, a refusal, ``RequestOutput`` s, ``EngineDead``) and a copy of ``LLMEngine.metrics`` --
and ``("dead", message)`` when the engine failed for good, ``("stopped",)`` after ``stop``.
``EngineClient`` has the interface of ``EngineLoop`` that the app uses, so the app runs over
either.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..engine.request import Request, RequestOutput
from .engine_loop import ACCEPTED, EngineDead, EngineLoop, ServerClosing, check_admission

__all__ = ["EngineClient", "EngineStartError"]

logger = logging.getLogger("dspark.serve")


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


@dataclass(eq=False)
class _Handle:
    request: Request
    sink: Callable[[object], None]
    id: int
    accepted: bool = False
    done: bool = field(default=False)


class EngineClient:
    """An ``EngineLoop`` in a child process, driven from this one.

    ``build``: a picklable callable (a module-level function or a ``functools.partial`` of one)
    that returns the ``LLMEngine``; it runs in the child, which is started with ``spawn`` so that
    the parent never initialises CUDA. The constructor returns once the engine is built and raises
    ``EngineStartError`` when building failed. ``max_waiting`` / ``on_failure`` as ``EngineLoop``
    (``on_failure`` runs on this process's reader thread).
    """

    def __init__(self, build: Callable[[], object], max_waiting: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child, build), name="dspark-engine", daemon=True)
        self._process.start()
        child.close()
        # The child ignores SIGTERM (the parent decides when it ends), so multiprocessing's exit
        # handler, which terminates daemon children and joins them, would wait for ever on one that
        # is still building its engine: kill it first (atexit runs the later registration first).
        atexit.register(self._kill)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise EngineStartError(f"the engine process exited while starting (exit code {self._process.exitcode})")
        if kind == "failed":
            self._process.join(5)
            raise EngineStartError(payload)
        self.info: dict = payload
        self.metrics = payload["metrics"]
        self.max_model_len: int = payload["max_model_len"]
        self.capacity = None if max_waiting is None else payload["max_batch"] + max_waiting
        self.on_failure = on_failure
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._live: dict[int, _Handle] = {}
        self._next_id = 0
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)

    # ---- the EngineLoop interface ------------------------------------------------------------

    def start(self) -> None:
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.error is None

    @property
    def pending(self) -> int:
        """Requests submitted but not yet queued by the engine."""
        with self._cond:
            return sum(not h.accepted for h in self._live.values())

    def submit(self, request: Request, sink: Callable[[object], None]) -> _Handle:
        with self._cond:
            check_admission(self.error, self._closing, len(self._live), self.capacity, self.info["max_batch"])
            handle = _Handle(request, sink, self._next_id)
            self._next_id += 1
            self._live[handle.id] = handle
        self._send(("add", handle.id, request))
        return handle

    def abort(self, handle: _Handle) -> None:
        """Stop a request (no-op once it finished); its sink gets a final ``"abort"`` output."""
        if not handle.done:
            self._send(("abort", handle.id))

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests, abort those still in flight, and end the engine process."""
        with self._cond:
            self._closing = True
        self._send(("stop",))
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._process.join(timeout)
        self._kill()
        atexit.unregister(self._kill)

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    # ---- this process's reader thread ----------------------------------------------------------

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the child is gone: the reader reports it
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._died(f"the engine process exited (exit code {self._process.exitcode})")
                return
            if message[0] == "items":
                self.metrics = message[2]
                for handle_id, item in message[1]:
                    self._dispatch(handle_id, item)
            elif message[0] == "dead":
                self._died(message[1])
            elif message[0] == "stopped":
                return

    def _dispatch(self, handle_id: int, item) -> None:
        if item == ACCEPTED:
            item = ACCEPTED  # the sinks' protocol compares by identity; unpickling made a copy
        with self._cond:
            handle = self._live.get(handle_id)
            if handle is None:
                return
            handle.accepted = True
            if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
                handle.done = True
                del self._live[handle_id]
        handle.sink(item)

    def _died(self, message: str) -> None:
        logger.error("the engine failed and cannot go on: %s", message)
        with self._cond:
            self.error = EngineDead(message)
            handles, self._live = list(self._live.values()), {}
        error = EngineDead(f"the engine stopped after an error: {message}")
        for handle in handles:
            handle.done = True
            handle.sink(error)
        if self.on_failure is not None:
            try:
                self.on_failure(self.error)
            except Exception:  # noqa: BLE001 -- the callback's own bug must not hide the engine's
                logger.exception("on_failure raised")


# ---- the child ---------------------------------------------------------------------------------


def _child_main(conn, build) -> None:
    """Build the engine, report it, then run its loop until ``("stop",)`` or the parent goes."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent decides when this process ends
        signal.signal(sig, signal.SIG_IGN)
    _log_to_stderr()
    try:
        engine = build()
    except (ValueError, TypeError, OSError, ImportError) as exc:
        conn.send(("failed", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 -- the parent prints it; the traceback goes to stderr here
        logger.exception("building the engine failed")
        conn.send(("failed", f"building the engine failed: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", dict(max_model_len=engine.max_model_len, max_batch=engine.config.max_batch,
                             drafter=engine.runner.drafter is not None, metrics=engine.metrics)))
    _Child(conn, engine).run()


class _Child:
    """The child's side: the pipe's commands into an ``EngineLoop``, its sinks' items back in one
    message per pass of the loop (sent on the engine thread while the GPU runs the next step)."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.lock = threading.Lock()  # the outbox and the pipe: the engine thread and this one write
        self.outbox: list[tuple[int, object]] = []
        self.handles: dict[int, object] = {}
        self.loop = EngineLoop(engine, None, on_failure=self._failed, after_pass=self._flush)

    def run(self) -> None:
        self.loop.start()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone: nobody is listening
                self.loop.stop(60.0)
                return
            if message[0] == "add":
                self._add(message[1], message[2])
            elif message[0] == "abort" and message[1] in self.handles:
                self.loop.abort(self.handles[message[1]])
            elif message[0] == "stop":
                self.loop.stop(60.0)
                self._flush()
                with self.lock:
                    self.conn.send(("stopped",))
                return

    def _add(self, handle_id: int, request: Request) -> None:
        def sink(item, handle_id=handle_id) -> None:
            with self.lock:
                self.outbox.append((handle_id, item))
            if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
                self.handles.pop(handle_id, None)

        try:
            self.handles[handle_id] = self.loop.submit(request, sink)
        except (EngineDead, ServerClosing) as exc:
            sink(exc)
            self._flush()

    def _flush(self) -> None:
        with self.lock:
            if not self.outbox:
                return
            items, self.outbox = self.outbox, []
            self.conn.send(("items", items, self.engine.metrics))

    def _failed(self, exc: BaseException) -> None:
        self._flush()
        with self.lock:
            self.conn.send(("dead", f"{type(exc).__name__}: {exc}"))


def _log_to_stderr() -> None:
    """The ``dspark`` loggers on stderr (the child's engine errors, with tracebacks)."""
    root = logging.getLogger("dspark")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
