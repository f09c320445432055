"""Argument checks shared by every public kernel function.

Each failure raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong rank, shape, device
or value) with a message naming the function, the argument, what was expected and what was given.

Value checks that need to read tensor contents (token ids in range, ...) run only for CPU tensors:
on the GPU they would force a host synchronisation (and break CUDA-graph capture), so there the
kernels instead guard every data-dependent index so that bad ids can never touch memory out of range.
"""

from __future__ import annotations

import math
import operator
from typing import Iterable, Sequence

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _fmt_dtypes(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype)
    return " or ".join(str(d) for d in dtype)


def _fmt_shape(shape: Sequence) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


class Checker:
    """Validation helpers bound to one public function name, used as ``c = Checker("fn")``."""

    def __init__(self, fn: str):
        self.fn = fn

    def fail(self, message: str, kind: type[Exception] = ValueError):
        raise kind(f"{self.fn}: {message}")

    def tensor(
        self,
        name: str,
        t,
        *,
        dtype=None,
        ndim=None,
        shape: Sequence | None = None,
        device: torch.device | None = None,
        contiguous: bool = False,
    ) -> torch.Tensor:
        """Check a tensor argument. ``shape`` may use ``None`` as a wildcard; ``ndim`` an int or tuple."""
        if not isinstance(t, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if dtype is not None:
            allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
            if t.dtype not in allowed:
                self.fail(f"{name} must have dtype {_fmt_dtypes(allowed)}, got {t.dtype}", TypeError)
        if ndim is not None:
            allowed_ndim = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            if t.dim() not in allowed_ndim:
                want = " or ".join(str(n) for n in allowed_ndim)
                self.fail(f"{name} must be {want}-D, got shape {list(t.shape)} ({t.dim()}-D)")
        if shape is not None:
            ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
            if not ok:
                self.fail(f"{name} must have shape {_fmt_shape(shape)}, got {list(t.shape)}")
        if device is not None and t.device != device:
            self.fail(f"{name} must be on {device} like the other inputs, got {t.device}")
        if contiguous and not t.is_contiguous():
            self.fail(f"{name} is written in place and must be contiguous, got strides {list(t.stride())}")
        return t

    def same_device(self, **tensors: torch.Tensor | None) -> torch.device:
        """All given (non-None) tensors share one device; returns it."""
        items = [(n, t) for n, t in tensors.items() if t is not None]
        first_name, first = items[0]
        for name, t in items[1:]:
            if t.device != first.device:
                self.fail(f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share one device")
        return first.device

    def integer(self, name: str, value, *, low: int | None = None, high: int | None = None) -> int:
        """An int argument in ``[low, high]`` (inclusive bounds, either optional)."""
        if isinstance(value, (bool, float)) or isinstance(value, torch.Tensor) and value.dim() != 0:
            self.fail(f"{name} must be an int, got {type(value).__name__} {value!r}", TypeError)
        try:
            value = operator.index(value)
        except TypeError:
            self.fail(f"{name} must be an int, got {type(value).__name__} {value!r}", TypeError)
        if low is not None and value < low or high is not None and value > high:
            lo = "-inf" if low is None else low
            hi = "inf" if high is None else high
            self.fail(f"{name} must be in [{lo}, {hi}], got {value}")
        return int(value)

    def real(self, name: str, value, *, low: float | None = None, high: float | None = None) -> float:
        """A finite float argument in ``[low, high]`` (inclusive bounds, either optional)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{name} must be a float, got {type(value).__name__} {value!r}", TypeError)
        value = float(value)
        if not math.isfinite(value):
            self.fail(f"{name} must be finite, got {value}")
        if low is not None and value < low or high is not None and value > high:
            lo = "-inf" if low is None else low
            hi = "inf" if high is None else high
            self.fail(f"{name} must be in [{lo}, {hi}], got {value}")
        return value

    def ids_in_range(self, name: str, t: torch.Tensor, high: int) -> None:
        """Token ids in ``[0, high)``; checked only for CPU tensors (see module docstring)."""
        if t.device.type != "cpu" or t.numel() == 0:
            return
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= high:
            bad = lo if lo < 0 else hi
            self.fail(f"{name} holds token id {bad}, outside [0, {high})")

    def rows(self, name: str, t: torch.Tensor, batch: int, stride: int, offset: int, needed: int) -> torch.Tensor:
        """Row-addressed ``[B, L, X]`` or ``[B*L, X]`` input -> contiguous ``[B*L, X]``.

        Row ``b*stride + step + offset`` is read for ``step < needed``; the tensor must hold them.
        """
        if t.dim() == 3:
            if t.shape[0] != batch or t.shape[1] != stride:
                self.fail(f"{name} must have shape [{batch}, {stride}, *] (batch, row stride), got {list(t.shape)}")
            t = t.reshape(batch * stride, t.shape[2])
        elif t.dim() == 2:
            if t.shape[0] != batch * stride:
                self.fail(f"{name} must have {batch}*{stride} = {batch * stride} rows (batch * row stride), got {list(t.shape)}")
        else:
            self.fail(f"{name} must be 2-D [B*L, X] or 3-D [B, L, X], got shape {list(t.shape)}")
        if offset < 0 or offset + needed > stride:
            self.fail(f"offset {offset} + {needed} rows per batch entry exceed the row stride {stride} of {name}")
        return t.contiguous()


def all_none_or_all_given(checker: Checker, names: Iterable[str], values: Iterable) -> bool:
    """Arguments that only make sense together; returns True when all are given."""
    names, values = list(names), list(values)
    given = [v is not None for v in values]
    if any(given) and not all(given):
        missing = [n for n, g in zip(names, given) if not g]
        checker.fail(f"{', '.join(names)} must be given together; missing {', '.join(missing)}")
    return all(given)
