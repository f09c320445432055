"""The commands and Python examples of README.md and docs/ run as written (those a CPU can run).

Every fenced shell block is read: continuation lines joined, comments dropped, ``&&`` chains split
(installing is what the environment already did), and each ``dspark`` / ``python -m dspark``
command is either run here from a scratch directory that holds the repository's ``src`` (so a
command writing ``docs/results/...`` writes there, not into the clone) or skipped for a reason named
below: a placeholder the reader fills in, a GPU, a server that runs until stopped (the server tests
start it), or a script for the H200. A measurement over every prompt of a set (``--num-prompts 0``:
minutes on a CPU; its figures are in ``docs/results``) runs here on the set's first two prompts, the
rest of the command as written. README's Python blocks without placeholders run in order as one
script. A new documented command is picked up without touching this file.

Each command runs in a process of its own, forked from one that imported what every command imports
(torch, transformers, dspark) once: what the command does, prints, writes and exits with is its own,
as ``python -m dspark ...`` (``forking.Forker``); only the imports (some 3 s a command here) are shared.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from forking import Forker

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
# words a reader replaces (paths, names) -- a command holding one is an example, not a command
PLACEHOLDERS = re.compile(r"path/to|\.\.\.|^(T|D|OUT|OUT_DIR|DIR|FILE|LABEL|URL|X\.json|\[.*\])$|OUT/|\$OUT|Qwen/")
GPU_ONLY = ("bench", "profile")  # H200 benchmarks and profiling (dspark profile times the target's verify)
LONG_RUNNING = ("serve",)  # runs until stopped: tests/test_serve.py starts the default server


def _blocks(path: Path):
    """(language, lines) of each fenced block of ``path``."""
    lang, lines = None, []
    for line in path.read_text().splitlines():
        match = FENCE.match(line.strip())
        if match and lang is None:
            lang, lines = match.group(1), []
        elif line.strip() == "```" and lang is not None:
            yield lang, lines
            lang = None
        elif lang is not None:
            lines.append(line)


def _commands(lines: list[str]):
    """The shell commands of a block: continuations joined, comments cut, ``&&`` chains split."""
    joined, buffer = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        joined.append(buffer + line)
        buffer = ""
    for line in joined:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (a JSON line, a table): nothing to run
            continue
        command: list[str] = []
        for word in words + ["&&"]:
            if word == "&&":
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def _program(words: list[str]) -> list[str] | None:
    """The dspark argument list of a command (``dspark X`` / ``python -m dspark[.cli] X``), else None."""
    if words[0] == "dspark":
        return words[1:]
    if words[:3] in (["python", "-m", "dspark"], ["python", "-m", "dspark.cli"]):
        return words[3:]
    return None


def documented_commands():
    """(doc file, command words, skip reason or None) for every dspark command in the docs."""
    found = []
    for path in DOCS:
        for lang, lines in _blocks(path):
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            for words in _commands(lines):
                args = _program(words)
                if args is None:
                    continue
                reason = None
                if any(PLACEHOLDERS.search(w) for w in words):
                    reason = "placeholder"
                elif args and args[0] in GPU_ONLY:
                    reason = "gpu"
                elif args and args[0] in LONG_RUNNING:
                    reason = "server"
                found.append((path.name, words, reason))
    return found


COMMANDS = documented_commands()
RUNNABLE = [(doc, words) for doc, words, reason in COMMANDS if reason is None]


def test_the_docs_show_commands_that_run_here():
    assert ("README.md", ["dspark", "generate", "--compare"]) in RUNNABLE
    assert len(RUNNABLE) >= 4, RUNNABLE


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory with the repository's ``src`` and an empty ``docs/results`` to run commands in."""
    path = tmp_path_factory.mktemp("docs")
    (path / "src").symlink_to(ROOT / "src")
    (path / "docs" / "results").mkdir(parents=True)
    return path


@pytest.fixture(scope="module")
def python(scratch, tmp_path_factory):
    forker = Forker(scratch, tmp_path_factory.mktemp("docs-output"), {"PYTHONPATH": str(ROOT / "src")})
    yield forker.run
    forker.close()


@pytest.mark.slow
@pytest.mark.parametrize("doc, words", RUNNABLE, ids=[f"{d}:{' '.join(w)[:70]}" for d, w in RUNNABLE])
def test_documented_command_runs_as_written(doc, words, python):
    args = _program(words)
    for i, word in enumerate(args[:-1]):
        if word == "--num-prompts" and args[i + 1] == "0":  # a whole set: its first two prompts here
            args = args[:i + 1] + ["2"] + args[i + 2:]
    result = python(["-m", "dspark", *args])
    assert result.returncode == 0, f"{doc}: {' '.join(words)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


def _python_examples(path: Path) -> str:
    blocks = ["\n".join(lines) for lang, lines in _blocks(path) if lang == "python"]
    return "\n\n".join(b for b in blocks if not PLACEHOLDERS.search(b) and "path/to" not in b)


@pytest.mark.slow
def test_readme_python_examples_run(python):
    script = _python_examples(ROOT / "README.md")
    assert "LLMEngine" in script and "dspark.kernels" in script
    result = python(["-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
