"""Backend selection for ``dspark.kernels``.

Every public kernel function validates its arguments, normalises them, then calls the function of
the same name in the selected backend:

* ``reference`` -- pure PyTorch (``dspark.kernels.reference``), CPU and GPU; the executable spec.
* ``triton``    -- Triton kernels (``dspark.kernels.triton``), GPU, or CPU under ``TRITON_INTERPRET=1``.

Default: CUDA tensors go to Triton, CPU tensors to the reference. ``use_backend(name)`` (a context
manager) or the environment variable ``DSPARK_BACKEND`` force one backend. When Triton is merely the
default and has no implementation of a function (or Triton is not installed), the reference runs
instead; when Triton is *forced*, a missing implementation is an error.

Each backend is a package (``dspark.kernels.reference``, ``dspark.kernels.triton``); every module of
it whose name does not start with ``_`` is imported, and the names in its ``__all__`` are the
backend's implementations (a name exported twice is an error). Backend functions receive the public
function's parameters after validation, normalised so that each backend does not repeat the work:

* row-addressed inputs (``backbone_logits``, ``draft_hidden_states``, ``greedy_accept``'s
  ``base_logits``) arrive as contiguous 2-D ``[rows, V]`` / ``[rows, H]`` tensors and
  ``logits_stride`` / ``hidden_stride`` arrive resolved (the real row stride, never 0);
* other input tensors arrive contiguous; output buffers written in place are checked contiguous;
* ``top1_indices`` arrives as a 1-D ``[B]`` tensor; scalars arrive as Python ``int``/``float``;
  ``device`` arguments arrive as ``torch.device``; ``workspace`` arrives as a ``Workspace`` (the
  caller's or the default one; the reference ignores it).

The full contract of each function is on the public function; backends document how they do it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import threading
from typing import Callable, Iterator

import torch

BACKENDS = ("reference", "triton")

_forced = threading.local()
_tables: dict[str, dict[str, Callable]] = {}


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: expected one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every ``dspark.kernels`` call in this block (and thread) onto one backend.

    ``name`` is ``"reference"`` or ``"triton"``. Nested blocks restore the outer choice on exit.
    """
    _check_name(name, "use_backend(name)")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def forced_backend() -> str | None:
    """The backend forced by ``use_backend`` or ``DSPARK_BACKEND``, or ``None`` for the default."""
    name = getattr(_forced, "name", None)
    if name is not None:
        return name
    env = os.environ.get("DSPARK_BACKEND", "").strip().lower()
    return _check_name(env, "DSPARK_BACKEND") if env else None


def _table(backend: str) -> dict[str, Callable]:
    """Name -> implementation of every public module of the backend package (see the module docstring)."""
    table = _tables.get(backend)
    if table is None:
        package = importlib.import_module(f"dspark.kernels.{backend}")
        table = {}
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for fn_name in getattr(module, "__all__", ()):
                if fn_name in table:
                    raise RuntimeError(f"dspark.kernels.{backend}: {fn_name} is exported by two modules "
                                       f"({table[fn_name].__module__} and {module.__name__})")
                table[fn_name] = getattr(module, fn_name)
        _tables[backend] = table
    return table


def _triton_table() -> dict[str, Callable] | None:
    try:
        return _table("triton")
    except ImportError as exc:  # triton itself not installed
        if "triton" not in str(exc):
            raise
        return None


def implementation(name: str, device: torch.device, *inputs) -> Callable:
    """The backend function ``name`` to run for tensors on ``device``: the reference whenever a
    gradient must flow through it (grad mode on and one of ``inputs`` requires grad; autograd
    differentiates the PyTorch ops, not the Triton kernels), whatever the backend chosen."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _table("reference")[name]
    forced = forced_backend()
    if forced == "triton":
        table = _triton_table()
        if table is None:
            raise RuntimeError(f"{name}: the triton backend was requested but triton is not installed")
        if name not in table:
            raise NotImplementedError(f"{name}: the triton backend has no implementation of this function")
        return table[name]
    if forced is None and device.type == "cuda":
        table = _triton_table()
        if table is not None and name in table:
            return table[name]
    return _table("reference")[name]


def backend_name(name: str, device: torch.device) -> str:
    """Which backend ``implementation(name, device)`` resolves to (for benchmarks and tests)."""
    fn = implementation(name, device)
    return "triton" if fn.__module__.startswith("dspark.kernels.triton") else "reference"
