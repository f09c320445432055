"""Tensor-parallel engines: one process per GPU, driven by rank 0 (nano-vllm's and vLLM's layout).

Every rank runs a whole ``LLMEngine`` over its shard of the target (``model.parallel``) and a
replica of the draft; the target's collectives make every rank's logits the same, so every rank's
acceptance, draft pass, scheduler and prefix cache make the same choices. Rank 0 is the engine its
caller holds (``LLM``, ``dspark serve``'s engine process, a benchmark); it starts the other ranks
(``RankGroup``) and sends each of them, over one connection per rank, every call that changes an
engine's state, in the order it makes them (``Op``): ``add_request``, ``abort``, ``launch`` (with the
host times the cost scheduler prices, the only choice an engine takes from its clock),
``finish``, ``capture_graphs``, the tokenizer structured outputs compile with, and work every rank
must do in step (``LLMEngine.on_every_rank``: a method call, e.g. profiling). A rank replays them on
its own engine (``worker_main``); its outputs are rank 0's, so it sends none back.

The other ranks are plain subprocesses (``worker_main``), not multiprocessing children: a daemonic
process (``dspark serve``'s engine process) may start them, and a caller's script is not imported
again in them. They ignore Ctrl-C (rank 0 decides) and end with rank 0's process: their connection
closes (or, inside a collective, the collective fails). Their process group is
``torch.distributed``'s default one, NCCL between GPUs (rank ``r`` on ``cuda:r``), gloo on the CPU:
one tensor-parallel engine per process at a time.

**A request's failure is every rank's, or the job's.** Where one process fails only the requests an
error concerns and goes on (``LLMEngine._fail``; a step with prompt chunks retried without them),
every rank does the same -- a failure that comes from the request (its tokens, its settings) is
raised on every rank alike, their host logic being replicated -- but first the ranks agree on it
(``agree``): each other rank sends rank 0 what failed (``("failed", (what, request ids))``) and
waits; rank 0, having failed the same, answers ``agreed`` and they all go on, their states still the
same. A failure only some ranks saw (one GPU out of memory, a rank's own bug) would leave their
states different: rank 0 ends the job instead (a rank that failed alone gets another op than
``agreed`` and fails; rank 0, failing alone, waits ``AGREE_TIMEOUT_S`` for the others' word).

**Other failures end the job.** A rank whose call raises sends its error to rank 0 and exits; a rank
that dies is seen by rank 0's watcher thread, which aborts the process group so that no collective
waits for it (gloo's fail by themselves). Rank 0 then raises ``EngineDeadError`` from the call that
failed, naming the rank and its error, and stops every rank. The start fails the same way, rank 0
never waiting in the process group's join for a rank that failed before it.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

import torch

from ..kernels._validate import Checker
from ..model.parallel import TensorParallel

__all__ = ["AGREE_TIMEOUT_S", "COLLECTIVE_TIMEOUT_S", "EngineDeadError", "Op", "RankGroup", "RankLink", "join_group",
           "rank_device", "worker_main"]

log = logging.getLogger("dspark.engine")

COLLECTIVE_TIMEOUT_S = 600.0  # a collective whose peers do not all arrive within this fails (NCCL aborts)
START_TIMEOUT_S = 600.0  # a rank that has not connected and built its engine within this fails the start
ERROR_GRACE_S = 5.0  # after a failed call, how long rank 0 waits for a rank's own error message
AGREE_TIMEOUT_S = 30.0  # how long a rank that failed requests waits for the others' word on the same failure
_ENV_ADDRESS, _ENV_KEY = "DSPARK_RANK_ADDRESS", "DSPARK_RANK_KEY"
_WORKER = "import sys; from dspark.engine.ranks import worker_main; sys.exit(worker_main(int(sys.argv[1])))"


class EngineDeadError(RuntimeError):
    """The device failed in a way no request can recover from (a sticky CUDA error, a failed
    tensor-parallel rank): the engine cannot go on, and its owner should stop."""


@dataclass(frozen=True)
class Op:
    """One engine call rank 0 made, for the other ranks to make too: ``name`` one of ``add``
    (``args``: the ``Request``), ``abort`` (id, reason), ``launch`` (rank 0's ``_host_ms``),
    ``finish``, ``capture``, ``tokenizer`` (the tokenizer), ``call`` (method name, args:
    ``LLMEngine.on_every_rank``), ``stop``; or, inside a call, ``agreed``
    (the failure every rank saw, ``agree``)."""

    name: str
    args: tuple = ()


def rank_device(device, rank: int, size: int) -> torch.device:
    """Where rank ``rank`` of ``size`` runs, from the device asked for (None: CUDA when available):
    ``cuda:rank`` on GPUs, else the CPU. ValueError for a GPU index (the ranks take GPUs 0 .. size-1),
    too few GPUs, or another device type."""
    c = Checker("tensor_parallel_size")
    wanted = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted.type == "cpu":
        return wanted
    if wanted.type != "cuda":
        c.fail(f"tensor parallelism runs on CUDA GPUs (NCCL) or the CPU (gloo), got device {str(wanted)!r}")
    if wanted.index is not None:
        c.fail(f"under tensor parallelism rank r runs on cuda:r: give device 'cuda', not {str(wanted)!r} "
               "(CUDA_VISIBLE_DEVICES picks the GPUs)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < size:
        c.fail(f"tensor_parallel_size {size} needs {size} GPUs, this machine has {count}")
    return torch.device("cuda", rank)


def join_group(rank: int, size: int, address: str, device: torch.device) -> TensorParallel:
    """Join the ranks' process group (the default one) as ``rank``: NCCL on a GPU, gloo on the CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        Checker("tensor_parallel_size").fail(
            "this process has a torch.distributed process group already; a tensor-parallel engine starts its own")
    nccl = device.type == "cuda"
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=address, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=device if nccl else None)
    return TensorParallel(rank, size)


class RankGroup:
    """Rank 0's handle on ranks 1 .. size-1: started by ``start`` (before rank 0 builds its own
    engine: they build theirs at the same time), each sent every ``Op`` with ``send``, watched, and
    stopped by ``close``. ``engine_class(target, draft, config)`` is what each rank builds."""

    def __init__(self, size: int, device: torch.device):
        self.size, self.device = size, device
        self.tp = TensorParallel(0, size)
        self.processes: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.errors: dict[int, str] = {}  # rank -> what it reported, or how it ended
        self.lock = threading.Lock()  # the watcher thread and the caller's both read the ranks' errors
        self.closing = False
        self._watcher: threading.Thread | None = None

    @classmethod
    def start(cls, size: int, device: torch.device, engine_class: type, target, draft, config) -> "RankGroup":
        """Start ranks 1 .. ``size``-1, each building ``engine_class(target, draft, config)`` on its
        device, and join their process group as rank 0; ``EngineDeadError`` when a rank fails first.
        ``target`` / ``draft`` travel pickled: give directories or builders (a loaded model is copied
        to every rank)."""
        group = cls(size, device)
        atexit.register(group.close)  # a caller that never closes its engine leaves no rank behind
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        try:
            group._spawn(listener.address, key)
            address = f"tcp://127.0.0.1:{_free_port()}"
            payload = pickle.dumps((address, engine_class, target, draft, config))
            for rank, conn in enumerate(group._accept(listener), start=1):
                conn.send_bytes(payload)
            group._watch()
            group._await("joining")  # a rank that fails before it joins would leave rank 0 waiting in the join
            join_group(0, size, address, device)
        except BaseException:
            group.close()
            raise
        finally:
            listener.close()
        return group

    def _spawn(self, address, key: bytes) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # this checkout's dspark, on every rank
        env = dict(os.environ, **{_ENV_ADDRESS: f"{address[0]}:{address[1]}", _ENV_KEY: key.hex()})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        for rank in range(1, self.size):
            self.processes.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(rank)], env=env))

    def _accept(self, listener: Listener) -> list[Connection]:
        """Each rank's connection, in rank order (a rank says which it is first); ``EngineDeadError``
        when a rank exits before connecting."""
        accepted: dict[int, Connection] = {}
        done = threading.Event()

        def accept() -> None:
            try:
                while len(accepted) < self.size - 1:
                    conn = listener.accept()
                    accepted[conn.recv()] = conn
            except OSError:  # the listener closed: a rank died before connecting
                pass
            done.set()

        threading.Thread(target=accept, daemon=True, name="dspark-rank-accept").start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not done.wait(0.1):
            dead = next(((r, p) for r, p in enumerate(self.processes, start=1) if p.poll() is not None), None)
            if dead is not None or time.monotonic() > deadline:
                listener.close()
                what = (f"exited with code {dead[1].returncode}" if dead
                        else f"did not connect in {START_TIMEOUT_S:.0f} s")
                rank = dead[0] if dead else len(accepted) + 1
                raise EngineDeadError(f"tensor-parallel rank {rank} {what} while starting")
        self.conns = [accepted[r] for r in range(1, self.size)]
        return self.conns

    def _watch(self) -> None:
        """A thread that sees a rank die (and what it sent before) and aborts the process group, so
        that rank 0 fails in its next or current collective instead of waiting for the dead rank."""

        def watch() -> None:
            pending = {p.pid: r for r, p in enumerate(self.processes, start=1)}
            while pending and not self.closing:
                for rank, process in enumerate(self.processes, start=1):
                    if process.pid in pending and process.poll() is not None:
                        pending.pop(process.pid)
                        if not self.closing:
                            self._collect(rank, process)
                            log.error("tensor-parallel rank %d ended: %s", rank, self.errors[rank])
                            _abort_group()
                time.sleep(0.2)

        self._watcher = threading.Thread(target=watch, daemon=True, name="dspark-rank-watch")
        self._watcher.start()

    def _collect(self, rank: int, process: subprocess.Popen | None = None) -> None:
        """Rank ``rank``'s error message if it sent one, else how its process ended (if it did)."""
        with self.lock:
            conn = self.conns[rank - 1]
            try:
                while rank not in self.errors and conn.poll():  # a failure it reported first, then its error
                    kind, message = conn.recv()
                    if kind == "error":
                        self.errors[rank] = message
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
            if rank not in self.errors and process is not None and process.poll() is not None:
                self.errors[rank] = f"its process exited with code {process.returncode}"

    def wait_ready(self) -> None:
        """Wait until every rank built its engine; ``EngineDeadError`` naming the first that failed."""
        self._await("ready")

    def _await(self, stage: str) -> None:
        """Wait for every rank's message ``stage``; ``EngineDeadError`` naming the first rank that sent
        an error instead or exited."""
        waiting = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            for conn in wait(list(waiting.values()), timeout=1.0):
                rank = next(r for r, c in waiting.items() if c is conn)
                with self.lock:
                    try:
                        kind, message = conn.recv()
                    except (EOFError, OSError):  # it exited: the watcher or failure() says how
                        kind, message = "exited", None
                    if kind == "error":
                        self.errors[rank] = message
                if kind != stage:
                    raise self.failure(RuntimeError(f"rank {rank} left before {stage!r}"))
                waiting.pop(rank)
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel ranks {sorted(waiting)} did not reach {stage!r} in "
                            f"{START_TIMEOUT_S:.0f} s")

    def send(self, op: Op) -> None:
        """``op`` to every other rank (in order; they apply it as rank 0 does)."""
        data = pickle.dumps(op)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self._collect(rank, self.processes[rank - 1])
                raise self.failure(exc) from exc

    def agree(self, failure: tuple) -> None:
        """Rank 0 failed ``failure`` (``(what, request ids)``): return when every other rank reports
        the same (then tell them ``agreed``), else end the job (``EngineDeadError``): a rank that
        failed otherwise, or said nothing within ``AGREE_TIMEOUT_S`` (it went on, or waits in a
        collective rank 0 left)."""
        deadline = time.monotonic() + AGREE_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            with self.lock:
                try:
                    said = conn.recv() if conn.poll(max(0.0, deadline - time.monotonic())) else None
                except (EOFError, OSError):  # it exited: the failure says how
                    said = ("exited", None)
                if said is not None and said[0] == "error":
                    self.errors[rank] = said[1]
                elif said is not None and said[0] == "failed" and said[1] != failure:
                    self.errors[rank] = (f"{_failure_text(said[1])} on rank {rank}, but {_failure_text(failure)} "
                                         "on rank 0: the ranks differ")
            if said != ("failed", failure):
                raise self.failure(RuntimeError(f"{_failure_text(failure)} on rank 0, not on rank {rank} (nothing "
                                                f"from it in {AGREE_TIMEOUT_S:.0f} s)"))
        self.send(Op("agreed", (failure,)))

    def failure(self, exc: BaseException | None) -> RuntimeError:
        """The error that ends the job after ``exc`` (rank 0's own, or None): the first rank that
        reported one (waiting ``ERROR_GRACE_S`` for a rank in the middle of failing), else rank 0's."""
        deadline = time.monotonic() + (ERROR_GRACE_S if exc is not None else 0.0)
        while True:
            for rank, process in enumerate(self.processes, start=1):
                self._collect(rank, process)
            if self.errors or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if self.errors:
            rank = min(self.errors)
            message = f"tensor-parallel rank {rank} failed: {self.errors[rank]}"
        else:
            message = f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
        self.close(failed=True)
        return EngineDeadError(f"{message}; the engine's {self.size} ranks stopped")

    def close(self, failed: bool = False) -> None:
        """Stop every rank (a ``stop`` op, then kill what has not exited after a few seconds) and
        leave the process group (aborting it after a failure: a collective may be half done).
        Idempotent."""
        if self.closing:
            return
        self.closing = True
        data = pickle.dumps(Op("stop"))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + (0.0 if failed else 10.0)  # after a failure a rank may wait in a collective
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for conn in self.conns:
            conn.close()
        import torch.distributed as dist

        if dist.is_initialized():
            if failed or self.errors:
                _abort_group()
            else:
                dist.destroy_process_group()


class RankLink:
    """Ranks 1 ..: the connection to rank 0, for ``agree``."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def agree(self, failure: tuple) -> None:
        """This rank failed ``failure`` (``(what, request ids)``): tell rank 0 and return once it
        answers that every rank did; ``EngineDeadError`` (which ends this rank, and the job) when it
        answers anything else (it went on: the failure was this rank's alone) or nothing within
        ``AGREE_TIMEOUT_S`` (it waits in a collective this rank left)."""
        self.conn.send(("failed", failure))
        answer = pickle.loads(self.conn.recv_bytes()) if self.conn.poll(AGREE_TIMEOUT_S) else None
        if answer != Op("agreed", (failure,)):
            raise EngineDeadError(f"{_failure_text(failure)} on this rank alone (rank 0 "
                               f"{'went on' if answer is not None else f'said nothing in {AGREE_TIMEOUT_S:.0f} s'})")


def _failure_text(failure: tuple) -> str:
    what, request_ids = failure
    return f"{what} failed for request(s) {list(request_ids)}"


def _abort_group() -> None:
    """Abort the default process group: every pending and later collective fails at once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if dist.is_initialized():
        try:
            distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 -- gloo's collectives fail by themselves on a dead peer
            log.debug("could not abort the process group", exc_info=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ ranks 1 ..


def worker_main(rank: int) -> int:
    """A rank's process: connect to rank 0, build the engine on this rank's device, then apply
    every ``Op`` in order until ``stop``; any error is sent to rank 0 and ends the process (exit 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which decides (and stops the ranks)
    host, port = os.environ[_ENV_ADDRESS].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop(_ENV_KEY)))
    conn.send(rank)
    try:
        address, engine_class, target, draft, config = pickle.loads(conn.recv_bytes())
        size = config.tensor_parallel_size
        device = rank_device(config.device, rank, size)
        conn.send(("joining", None))
        tp = join_group(rank, size, address, device)
        engine = engine_class(target, draft, config, rank=tp)
        engine.peers = RankLink(conn)
        conn.send(("ready", None))
        while True:
            op: Op = pickle.loads(conn.recv_bytes())
            if op.name == "stop":
                break
            _apply(engine, op)
    except (EOFError, ConnectionError):  # rank 0 is gone: nothing to report to, no peer to wait for
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 -- reported to rank 0, which ends the job
        log.error("tensor-parallel rank %d failed", rank, exc_info=True)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            conn.send(("error", detail))
        except OSError:
            pass
        os._exit(1)  # without waiting for peers in the process group's teardown
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _apply(engine, op: Op) -> None:
    """Make rank 0's call ``op`` on this rank's engine (its outputs are rank 0's to report)."""
    if op.name == "add":
        engine.add_request(*op.args)
    elif op.name == "abort":
        engine.abort(*op.args)
    elif op.name == "launch":
        engine._host_ms = list(op.args[0])  # rank 0's measured host times: the cost scheduler's choice is its
        engine.launch()
    elif op.name == "finish":
        engine.finish()
        # rank 0's caller forgets its finished requests (generate, the server): so does this rank
        from .request import SequenceStatus

        for request_id in [i for i, seq in engine.sequences.items() if seq.status is SequenceStatus.FINISHED]:
            engine.sequences.pop(request_id)
    elif op.name == "capture":
        engine.capture_graphs()
    elif op.name == "tokenizer":
        engine.tokenizer = op.args[0]
    elif op.name == "call":
        getattr(engine, op.args[0])(*op.args[1])
    else:
        raise ValueError(f"unknown engine call {op.name!r} from rank 0")
