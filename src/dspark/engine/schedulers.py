"""Batch-level verification schedulers (runtime.md Part III).

``prefix_schedule`` is the paper's Algorithm 1: the hardware-aware prefix scheduler that picks how
many drafted tokens each request verifies from the confidence head's prefix survivals and a
profiled steps-per-second curve SPS(B). ``SPSCostTable`` is that curve in TensorRT-LLM's JSON
cost-table form. Per-row scheduling uses the kernels of ``dspark.kernels``; these serve the
batch-level ``"cost"`` scheduler.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..kernels._validate import Checker

__all__ = ["SPSCostTable", "batch_schedule", "drafting_pays", "full_verify_wins", "prefix_schedule", "prefix_survival"]


@dataclass(frozen=True)
class SPSCostTable:
    """Target step time as a function of the total verify tokens B (bonus tokens included).

    ``token_counts`` strictly increasing, ``step_time_ms`` of the same length (> 0),
    ``fixed_overhead_ms`` added to every step. Between points the time is interpolated linearly;
    outside the table it is extrapolated from the nearest segment (a one-point table is flat).
    ``draft_rows`` / ``draft_time_ms`` (a dspark addition; may be empty): the round's draft pass --
    context, block, Markov chain, confidence -- per batch rows, interpolated the same way: a cost
    every round pays whatever it verifies, so it moves where admitting one more draft stops paying.
    ``decode_rows`` / ``decode_time_ms`` (a dspark addition; may be empty): a plain decoding forward
    of R rows of one token each, over the same cached context as the verify curve, whose points are
    rows of ``tokens_per_row`` tokens. A forward's attention reads every row's K/V, so at many rows
    the verify curve under-prices a round of few tokens a row; ``forward_time`` adds what it misses.
    """

    token_counts: tuple[int, ...]
    step_time_ms: tuple[float, ...]
    fixed_overhead_ms: float = 0.0
    draft_rows: tuple[int, ...] = ()
    draft_time_ms: tuple[float, ...] = ()
    decode_rows: tuple[int, ...] = ()
    decode_time_ms: tuple[float, ...] = ()
    tokens_per_row: int = 8

    def __post_init__(self):
        c = Checker("SPSCostTable")
        counts = [c.integer("token_counts[]", n, low=1) for n in self.token_counts]
        times = [c.real("step_time_ms[]", t, low=0.0) for t in self.step_time_ms]
        if not counts or len(counts) != len(times):
            c.fail(f"token_counts and step_time_ms must be non-empty and of equal length, got {len(counts)} and {len(times)}")
        if any(b <= a for a, b in zip(counts, counts[1:])):
            c.fail(f"token_counts must be strictly increasing, got {counts}")
        c.real("fixed_overhead_ms", self.fixed_overhead_ms, low=0.0)
        rows = [c.integer("draft_rows[]", n, low=1) for n in self.draft_rows]
        draft = [c.real("draft_time_ms[]", t, low=0.0) for t in self.draft_time_ms]
        if len(rows) != len(draft) or any(b <= a for a, b in zip(rows, rows[1:])):
            c.fail(f"draft_rows must be strictly increasing and as long as draft_time_ms, got {rows} and {draft}")
        decode_rows = [c.integer("decode_rows[]", n, low=1) for n in self.decode_rows]
        decode = [c.real("decode_time_ms[]", t, low=0.0) for t in self.decode_time_ms]
        if len(decode_rows) != len(decode) or any(b <= a for a, b in zip(decode_rows, decode_rows[1:])):
            c.fail(f"decode_rows must be strictly increasing and as long as decode_time_ms, got {decode_rows} "
                   f"and {decode}")
        c.integer("tokens_per_row", self.tokens_per_row, low=1)
        object.__setattr__(self, "token_counts", tuple(counts))
        object.__setattr__(self, "step_time_ms", tuple(times))
        object.__setattr__(self, "draft_rows", tuple(rows))
        object.__setattr__(self, "draft_time_ms", tuple(draft))
        object.__setattr__(self, "decode_rows", tuple(decode_rows))
        object.__setattr__(self, "decode_time_ms", tuple(decode))
        # the step-time curve once as per-segment lines (intercept, slope; the first and last
        # segments extended): the scheduler interpolates it every round
        n, t = np.asarray(counts, dtype=np.float64), np.asarray(times, dtype=np.float64)
        slope = np.diff(t) / np.diff(n) if len(n) > 1 else np.zeros(1)
        intercept = (t[:-1] if len(n) > 1 else t) - slope * n[:len(slope)] + self.fixed_overhead_ms
        object.__setattr__(self, "_grid", (n[1:-1], intercept, slope))
        object.__setattr__(self, "_draft_grid", (np.asarray(rows, dtype=np.float64), np.asarray(draft, dtype=np.float64)))

    @classmethod
    def from_json(cls, path: str) -> "SPSCostTable":
        """Read TensorRT-LLM's legacy cost-table JSON (``token_counts``, ``step_time_ms``,
        optional ``fixed_overhead_ms``)."""
        with open(path) as f:
            d = json.load(f)
        missing = [k for k in ("token_counts", "step_time_ms") if k not in d]
        if missing:
            Checker("SPSCostTable.from_json").fail(f"{path} is missing the key(s) {missing}")
        return cls(tuple(d["token_counts"]), tuple(d["step_time_ms"]), d.get("fixed_overhead_ms", 0.0),
                   tuple(d.get("draft_rows", ())), tuple(d.get("draft_time_ms", ())),
                   tuple(d.get("decode_rows", ())), tuple(d.get("decode_time_ms", ())), d.get("tokens_per_row", 8))

    def write_json(self, path, **info) -> None:
        """Write the table as ``from_json`` reads it (TensorRT-LLM's keys), plus ``info`` (where and
        how it was measured)."""
        data = {"token_counts": list(self.token_counts), "step_time_ms": list(self.step_time_ms), **info}
        if self.fixed_overhead_ms:
            data["fixed_overhead_ms"] = self.fixed_overhead_ms
        if self.draft_rows:
            data.update(draft_rows=list(self.draft_rows), draft_time_ms=list(self.draft_time_ms))
        if self.decode_rows:
            data.update(decode_rows=list(self.decode_rows), decode_time_ms=list(self.decode_time_ms),
                        tokens_per_row=self.tokens_per_row)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    def step_time(self, tokens: int) -> float:
        """Milliseconds of one target step verifying ``tokens`` tokens (``step_times`` of one count,
        in plain floats: the scheduler asks for a few every round, where numpy's overhead would show)."""
        return _interpolate(self.token_counts, self.step_time_ms, tokens) + self.fixed_overhead_ms

    def step_times(self, tokens: np.ndarray) -> np.ndarray:
        """``step_time`` of every entry of an array of token counts (float64 milliseconds)."""
        inner, intercept, slope = self._grid
        i = np.searchsorted(inner, tokens, side="left")  # the segment: as _interpolate's bisect_left
        return intercept[i] + slope[i] * tokens

    def draft_time(self, rows: int) -> float:
        """Milliseconds of the draft pass of a round of ``rows`` requests (0 without a draft curve)."""
        return _interpolate(self.draft_rows, self.draft_time_ms, rows) if self.draft_rows else 0.0

    def forward_time(self, tokens: int, rows: int, prefill_tokens: int = 0) -> float:
        """Milliseconds of a forward of ``tokens`` decode tokens over ``rows`` running requests and
        ``prefill_tokens`` prompt tokens: the verify curve at all its tokens plus, for the rows
        beyond the curve's own (``tokens / tokens_per_row``), ``row_time(rows)`` each -- so a
        plain round (one token a row) costs the decode curve's time and a full verify the verify
        curve's. Without a decode curve, ``step_time(tokens + prefill_tokens)``."""
        extra = max(rows - tokens / self.tokens_per_row, 0.0)
        return self.step_time(tokens + prefill_tokens) + (self.row_time(rows) * extra if extra else 0.0)

    def forward_times(self, tokens: np.ndarray, rows: int, prefill_tokens: int = 0) -> np.ndarray:
        """``forward_time`` of every entry of an array of decode token counts (float64 ms)."""
        extra = np.maximum(rows - tokens / self.tokens_per_row, 0.0)
        return self.step_times(tokens + prefill_tokens) + self.row_time(rows) * extra

    def row_time(self, rows: int) -> float:
        """Milliseconds one more row of cached context adds to a forward of ``rows`` rows (K/V reads
        the verify curve, at ``tokens_per_row`` tokens a row, does not make): the decode curve's
        excess over the verify curve at ``rows`` tokens, per row it has beyond the verify curve's,
        never negative (0 without a decode curve)."""
        if not self.decode_rows or self.tokens_per_row == 1:
            return 0.0
        decode = _interpolate(self.decode_rows, self.decode_time_ms, rows) + self.fixed_overhead_ms
        return max(decode - self.step_time(rows), 0.0) / (rows * (1.0 - 1.0 / self.tokens_per_row))

    def sps(self, tokens: int) -> float:
        """Steps per second at ``tokens`` verify tokens: 1000 / step_time_ms."""
        return 1000.0 / max(self.step_time(tokens), 1e-9)


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    """The piecewise-linear curve through (``xs``, ``ys``) at ``x`` (extrapolated from the nearest
    segment; a one-point curve is flat), as ``SPSCostTable.step_times`` computes it."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]) * (x - xs[i - 1])


def prefix_survival(confidences: torch.Tensor) -> torch.Tensor:
    """``a[r, j] = prod_{i<=j} c[r, i]`` for confidences ``[R, P]`` (float) -> float64 ``[R, P]``."""
    return torch.cumprod(confidences.to(torch.float64), dim=-1)


def prefix_schedule(confidences: torch.Tensor, sps: Callable[[int], float] | SPSCostTable) -> list[int]:
    """Paper Algorithm 1: drafts each request verifies, from confidences ``[R, P]`` (conditional
    c_{r,j}; a row's tail may be 0 for positions it did not draft).

    Candidates (r, j) are admitted in descending prefix survival a_{r,j}, each adding one verify
    token (B += 1) and a_{r,j} expected tokens (tau += a); admission stops at the FIRST candidate
    that does not raise the goodput tau * SPS(B). The early stop is what keeps the scheduler
    lossless: admitting x_j then never depends on c_{j+1}, which depends on x_j (Appendix A).
    ``sps`` maps total verify tokens B (each request's anchor counts 1) to steps per second.
    Returns ``[R]`` lengths (0 = verify the anchor only).
    """
    c = Checker("prefix_schedule")
    c.tensor("confidences", confidences, ndim=2)
    survival = np.cumprod(confidences.detach().cpu().numpy().astype(np.float64), axis=-1)
    return _admit(survival, sps).tolist()


def batch_schedule(confidences: np.ndarray, table: SPSCostTable, min_predicted_gain: float,
                   host_ms: float = 0.0, prefill_tokens: int = 0) -> list[int]:
    """The batched engine's ``cost`` scheduler, once per round on the host: Algorithm 1
    (``prefix_schedule``) on f32/f64 confidences ``[R, P]``, at least one draft per row (the accept
    kernels verify >= 1), kept only when its predicted goodput beats verifying every draft by
    ``min_predicted_gain`` (TensorRT-LLM's rule; else every row verifies all P). A round's time is
    the table's forward time of its rows (``SPSCostTable.forward_time``) plus its draft pass
    (``SPSCostTable.draft_time``) plus ``host_ms``, the engine's own time per drafting round;
    ``prefill_tokens`` prompt tokens share the step's forward (the verify is priced from there on
    the curve)."""
    rows, p = np.shape(confidences)
    if full_verify_wins(table, rows, p, min_predicted_gain, host_ms, prefill_tokens):
        return [p] * rows
    survival = np.cumprod(np.asarray(confidences, dtype=np.float64), axis=-1)
    lengths = np.maximum(_admit(survival, table, host_ms, prefill_tokens), 1)
    fixed = table.draft_time(rows) + host_ms
    trimmed = table.forward_time(int(lengths.sum()) + rows, rows, prefill_tokens) + fixed
    full = table.forward_time((p + 1) * rows, rows, prefill_tokens) + fixed
    goodput = _expected_tokens(survival, lengths) / trimmed, _expected_tokens(survival, None) / full
    return lengths.tolist() if goodput[0] > (1 + min_predicted_gain) * goodput[1] else [p] * rows


def full_verify_wins(table: SPSCostTable, rows: int, p: int, min_predicted_gain: float, host_ms: float,
                      prefill_tokens: int) -> bool:
    """Whether verifying every draft is ``batch_schedule``'s answer whatever the confidences (then
    it need not run Algorithm 1): a shorter schedule expects no more tokens, and its round -- at
    least one draft per row -- takes no less than the fastest on the curve between ``2 * rows`` and
    ``(p + 1) * rows`` verify tokens, plus the same draft pass and host time; when the full round
    is within ``min_predicted_gain`` of that, none beats it by the gain. (The flat start of a GPU's
    curve: a few rows.) ``forward_time`` is piecewise linear in the tokens: the fastest is at an end
    or a kink."""
    low, high = 2 * rows, (p + 1) * rows
    fixed = table.draft_time(rows) + host_ms
    full = table.forward_time(high, rows, prefill_tokens) + fixed
    if full > (table.forward_time(low, rows, prefill_tokens) + fixed) * (1 + min_predicted_gain):  # past a few rows
        return False
    kinks = [n - prefill_tokens for n in table.token_counts] + [table.tokens_per_row * rows]  # the row term's end
    inner = [table.forward_time(n, rows, prefill_tokens) for n in kinks if low < n < high]
    return not inner or full <= (min(inner) + fixed) * (1 + min_predicted_gain)


def drafting_pays(confidences: np.ndarray, table: SPSCostTable, min_predicted_gain: float,
                  host_ms: tuple[float, float] = (0.0, 0.0), lengths: list[int] | None = None,
                  prefill_tokens: int = 0) -> bool:
    """Whether the next round should draft: the round ``batch_schedule`` would run on the rows'
    latest confidences ``[R, P]`` (``lengths``, when already scheduled) -- its expected tokens in
    its verify, draft pass and host time ``host_ms[0]`` -- makes ``1 + min_predicted_gain`` times
    what plain decoding makes in that time: a plain round's R tokens (the verify of R tokens and
    ``host_ms[1]``) and, for the time the drafting round takes beyond it, plain rounds' tokens at
    their rate. Both forwards also run ``prefill_tokens`` prompt tokens, which a step runs either
    way: so that rate is a plain round's without them (with them, a plain round's time per token
    rose, and drafting looked to pay where the extra time it takes would make more tokens in plain
    rounds -- most steps at high load carry prompt chunks). Else the engine decodes without drafting."""
    survival = np.cumprod(np.asarray(confidences, dtype=np.float64), axis=-1)
    rows, p = survival.shape
    if lengths is None:
        lengths = batch_schedule(confidences, table, min_predicted_gain, host_ms[0], prefill_tokens)
    every = all(n == p for n in lengths)
    round_ms = table.forward_time(sum(lengths) + rows, rows, prefill_tokens) + table.draft_time(rows) + host_ms[0]
    plain_ms = table.forward_time(rows, rows, prefill_tokens) + host_ms[1]
    plain_rate = rows / (table.forward_time(rows, rows) + host_ms[1])  # tokens per ms, no prompt tokens
    expected = _expected_tokens(survival, None if every else np.asarray(lengths))
    return expected > (1 + min_predicted_gain) * (rows + plain_rate * (round_ms - plain_ms))


def _expected_tokens(survival: np.ndarray, lengths: np.ndarray | None) -> float:
    """Expected tokens of a round verifying ``lengths[r]`` drafts of each row (None: all of them):
    its bonus plus the survivals of its verified prefix (prefix survivals float64 ``[R, P]``)."""
    if lengths is None:
        return float(survival.shape[0] + survival.sum())
    verified = np.arange(survival.shape[1]) < lengths[:, None]
    return float(survival.shape[0] + survival[verified].sum())


def _admit(survival: np.ndarray, sps: Callable[[int], float] | SPSCostTable, host_ms: float = 0.0,
           prefill_tokens: int = 0) -> np.ndarray:
    """Algorithm 1 on prefix survivals float64 ``[R, P]``: int64 ``[R]`` lengths (one sort, one
    interpolation of the cost curve; a table's round adds its draft pass and ``host_ms``, and its
    verify shares the forward with ``prefill_tokens`` prompt tokens)."""
    num_requests = survival.shape[0]
    # candidates position-major (ties then stay by position, then request, so that each request's
    # prefix keeps its order), sorted by descending survival
    flat = survival.T.ravel()
    index = np.flatnonzero(flat > 0)
    index = index[np.argsort(-flat[index], kind="stable")]
    j, r = np.divmod(index, num_requests)
    a = flat[index]
    tokens = np.arange(num_requests, num_requests + a.size + 1)
    if isinstance(sps, SPSCostTable):  # a round's time: its verify plus its draft pass and host time
        round_ms = sps.forward_times(tokens, num_requests, prefill_tokens) + sps.draft_time(num_requests) + host_ms
        rates = 1000.0 / np.maximum(round_ms, 1e-9)
    else:
        rates = np.array([sps(int(b)) for b in tokens], dtype=np.float64)
    goodput = np.concatenate([[float(num_requests)], num_requests + np.cumsum(a)]) * rates
    worse = np.nonzero(goodput[1:] <= goodput[:-1])[0]  # admission stops at the first candidate that does not pay
    admitted = int(worse[0]) if worse.size else a.size
    # a request's admitted candidates are a prefix of its drafts (survivals never grow along a
    # prefix, and ties keep position order): its length is their count
    return np.bincount(r[:admitted], minlength=num_requests)
