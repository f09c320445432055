"""Argument checks shared by every public kernel function.

Each failure raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong rank, shape, device
or value) with a message naming the function, the argument, what was expected and what was given.

Value checks read tensor contents (token ids in range, no NaN in the logits a greedy decision is
taken on, probabilities that are distributions, finite weights). They run for CPU tensors; on the GPU
each would cost a host synchronisation (and cannot run inside CUDA-graph capture), so there they are
skipped unless asked for, and the kernels instead guard every data-dependent index so that bad ids
never touch memory out of range. ``DSPARK_CHECK_VALUES`` chooses:

* unset -- check CPU tensors only (the default);
* ``1`` -- check on every device (one host synchronisation per check; skipped during graph capture);
* ``0`` -- never check (the kernels' raw behaviour, e.g. NVIDIA's ordering of NaN keys, on the CPU too).
"""

from __future__ import annotations

import math
import operator
import os
from typing import Sequence

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
CHECK_VALUES_ENV = "DSPARK_CHECK_VALUES"
PROBABILITY_SUM_TOLERANCE = 1e-3  # |row sum - 1| a probability row may show (fp32 rounding, filters)


def check_values(t: torch.Tensor) -> bool:
    """Whether the value checks run for tensor ``t`` (see the module docstring)."""
    mode = os.environ.get(CHECK_VALUES_ENV, "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"{CHECK_VALUES_ENV} must be 0 or 1 (or unset), got {mode!r}")
    if mode == "0" or t.numel() == 0:
        return False
    if t.device.type == "cpu":
        return True
    return mode == "1" and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


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

    def integer(self, name: str, value, *, low: int | None = None, high: int | None = None) -> int:
        """An int argument in ``[low, high]`` (inclusive bounds, either optional)."""
        if isinstance(value, (bool, float)) or isinstance(value, torch.Tensor) and value.dim() != 0:
            self.fail(f"{name} must be an int, got {type(value).__name__} {value!r}", TypeError)
        try:
            value = operator.index(value)
        except TypeError:
            self.fail(f"{name} must be an int, got {type(value).__name__} {value!r}", TypeError)
        self._within(name, value, low, high)
        return int(value)

    def _within(self, name: str, value, low, high) -> None:
        if low is not None and value < low or high is not None and value > high:
            self.fail(f"{name} must be in [{'-inf' if low is None else low}, {'inf' if high is None else high}], got {value}")

    def boolean(self, name: str, value) -> bool:
        if not isinstance(value, bool):
            self.fail(f"{name} must be a bool, got {type(value).__name__} {value!r}", TypeError)
        return value

    def real(self, name: str, value, *, low: float | None = None, high: float | None = None) -> float:
        """A finite float argument in ``[low, high]`` (inclusive bounds, either optional)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{name} must be a float, got {type(value).__name__} {value!r}", TypeError)
        value = float(value)
        if not math.isfinite(value):
            self.fail(f"{name} must be finite, got {value}")
        self._within(name, value, low, high)
        return value

    def ids_in_range(self, name: str, t: torch.Tensor, high: int) -> None:
        """Token ids in ``[0, high)`` (a value check, see the module docstring)."""
        if not check_values(t):
            return
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= high:
            bad = lo if lo < 0 else hi
            self.fail(f"{name} holds token id {bad}, outside [0, {high})")

    def no_nan(self, name: str, t: torch.Tensor) -> None:
        """No NaN in ``t`` (a value check): a greedy decision on NaN logits would be silent garbage."""
        if not check_values(t):
            return
        nan = torch.isnan(t)
        if bool(nan.any()):
            where = [int(i) for i in nan.nonzero()[0]]
            self.fail(f"{name} holds NaN (first at index {where}); the logits of a greedy decision must not be NaN")

    def finite(self, name: str, t: torch.Tensor) -> None:
        """Only finite entries in ``t`` (a value check)."""
        if check_values(t) and not bool(torch.isfinite(t).all()):
            self.fail(f"{name} must be finite, got inf or NaN entries")

    def probabilities(self, name: str, t: torch.Tensor) -> None:
        """Rows (last dimension) of ``t`` are distributions (a value check): finite, ``>= 0``, summing to 1
        within ``PROBABILITY_SUM_TOLERANCE``."""
        if not check_values(t):
            return
        bad = ~torch.isfinite(t) | (t < 0)
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            self.fail(f"{name} must hold probabilities (finite, >= 0), got {float(t[tuple(where)])} at index {where}")
        sums = t.double().sum(-1)
        worst = int((sums - 1).abs().argmax())  # flat index of the row furthest from 1
        total = float(sums.reshape(-1)[worst])
        if abs(total - 1) > PROBABILITY_SUM_TOLERANCE:
            row = [int(i) for i in torch.unravel_index(torch.tensor(worst), sums.shape)]
            self.fail(f"{name} rows must sum to 1 (within {PROBABILITY_SUM_TOLERANCE:g}): row {row} sums to "
                      f"{total:.6g} (pass probabilities, not logits or unnormalised weights)")

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
