"""Commands run as ``python -m dspark ...`` would run them, without paying their imports each time.

``Forker`` starts one Python process that imports what the commands import (torch, transformers,
dspark) once; each command then runs in a child forked from it, from the given directory: what the
command does, prints, writes and exits with is its own, as in a fresh interpreter; only the imports
(some 3 s a command on a busy 2-core CPU) are shared.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

# The forking process: it imports, then for each job (a JSON line: python's arguments ``-m MODULE
# ARGS...`` or ``-c CODE``, and the files for the output) forks a child that runs it as ``python``
# would -- its stdout and stderr to the files, stdin from /dev/null, SystemExit or an uncaught
# exception ending the child as they end an interpreter -- and answers the child's pid, then its
# exit status. Nothing runs on torch before the fork (no thread pools to inherit).
_FORKER = r"""
import json, os, runpy, sys
import torch, torch._dynamo, transformers  # noqa: F401 (the imports the commands share)
from transformers import AutoTokenizer  # noqa: F401
import dspark.cli, dspark.engine  # noqa: F401
for optional in ("xgrammar", "dspark.serve"):
    try:
        __import__(optional)
    except ImportError:
        pass
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, job["stderr"], os.O_WRONLY | os.O_CREAT)):
            os.dup2(os.open(name, flags, 0o644), fd)
        option, target, *rest = job["args"]
        sys.argv = [target if option == "-m" else "-c", *rest]
        if option == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)  # out of the loop: the child ends as an interpreter ends
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Forker:
    """``run(args)`` runs ``python ARGS`` (``-m MODULE ...`` or ``-c CODE``) from ``cwd``, with this
    environment and ``env`` over it, in a child of the forking process (its output kept in ``logs``);
    returns ``subprocess.CompletedProcess`` (returncode, stdout, stderr)."""

    def __init__(self, cwd: Path, logs: Path, env: dict[str, str] | None = None):
        self.logs = logs
        self.proc = subprocess.Popen([sys.executable, "-c", _FORKER], cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.jobs = 0

    def _answer(self, timeout: float) -> int:
        try:
            return int(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no answer from the forking process in {timeout:.0f} s "
                               f"(exit code {self.proc.poll()})") from None

    def run(self, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        self.jobs += 1
        out, err = (self.logs / f"{self.jobs}.{name}" for name in ("stdout", "stderr"))
        self.proc.stdin.write(json.dumps({"args": args, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        pid = self._answer(120)  # the forking process's imports come first
        try:
            code = self._answer(timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(60)  # its exit status: the next job's answers come next
            raise
        return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)
