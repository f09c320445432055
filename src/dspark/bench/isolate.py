"""Measurements that must not cost a benchmark its others: ``attempt`` (an exception becomes the
measurement's ``{"error": ...}``) and ``in_child`` (a child process, bounded in time, for one that may
hang or crash, such as a ``torch.compile`` that never finishes). Imports no torch: a child pays only
for what its function needs."""

from __future__ import annotations

import multiprocessing
import sys

EXIT_GRACE_S = 30  # a child that replied but has not exited by then (a stuck teardown) is killed


def attempt(fn) -> dict:
    """``fn()``'s result dict, or ``{"error": ...}``: one failed measurement (a compile that breaks,
    memory) must not cost the GPU session the others."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - benchmark only: reported in the JSON and the table
        print(f"failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return dict(error=f"{type(exc).__name__}: {exc}"[:500])


def reply(writer, fn, args: tuple) -> None:
    """A child's side of ``in_child``: ``attempt(fn(*args))`` sent back through ``writer``."""
    writer.send(attempt(lambda: fn(*args)))
    writer.close()


def in_child(fn, *args, timeout: float) -> dict:
    """``fn(*args)``'s result dict computed in a spawned child process (its exception as ``attempt``'s
    ``{"error": ...}``), ``{"error": "timed out after N s"}`` if none came within ``timeout`` seconds
    (the child killed: a ``torch.compile`` that never finishes), or the exit code of a child that died
    before replying (a crash, the kernel's OOM killer). The child has exited when this returns, so its
    CUDA context and memory are back. ``fn`` and ``args`` must pickle (``fn`` a module-level function).
    The child stays in the parent's process group, so a ``timeout`` that kills the bench kills it too;
    torch's compile workers watch their parent and exit with a killed child."""
    context = multiprocessing.get_context("spawn")  # fork would copy the parent's CUDA context
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=reply, args=(writer, fn, args), name=f"dspark-bench-{fn.__name__}")
    child.start()
    writer.close()  # the child holds the only writer, so its death reads as end of file
    try:
        if not reader.poll(timeout):
            child.kill()
            return dict(error=f"timed out after {timeout:g} s")
        try:
            return reader.recv()
        except EOFError:
            child.join()
            return dict(error=f"child process exited with code {child.exitcode} before replying")
    finally:
        reader.close()
        child.join(EXIT_GRACE_S)
        if child.is_alive():
            child.kill()
            child.join()
