"""Reference sampling family: uniforms, probabilities, inverse-CDF samplers, stores, the sampled Markov
step (contracts: ``dspark.kernels.sampling``).

``backbone_logits`` arrives as a contiguous f32 ``[rows, V]`` tensor with ``logits_stride`` resolved,
other tensors contiguous, scalars as Python numbers. Data-dependent token ids are clamped before
they index anything (the GPU path does not check them).

Inverse-CDF walks (kernels.md 2.2-2.4). NVIDIA walks a row on one thread, adding the positive entries
in fp32 one after another and returning the first index whose running sum ``c_i`` exceeds the
threshold ``t`` (strict ``t < c_i``). That sequential fp32 sum is not what ``torch.cumsum`` computes:
on the CPU it accumulates in float64 and rounds each output to fp32 (checked: it differs from the
sequential fp32 sum at most positions of a 10^5-entry row), on the GPU it is a parallel scan. So the
walk here is exact in two stages: a float64 prefix sum with a rigorous bound on how far the sequential
fp32 sums can stray from it settles every row whose threshold is not within that bound of a running
sum (almost all rows); the remaining rows get the exact sequential fp32 sums from a vectorised
binade-by-binade computation (``_sequential_prefix``). The result is bit-for-bit the C++ choice for
the same uniforms.
"""

from __future__ import annotations

import math

import torch

from .._shared import GREEDY_TEMPERATURE, TINY, UNIFORM_MAX, filter_settings, inv_temperature
from .markov import build_markov_logits

__all__ = [
    "fill_uniforms",
    "logits_to_probabilities",
    "markov_sample_step",
    "sample_probability_rows",
    "store_draft_step_probabilities",
    "normalize_top_k_rows",
    "request_probabilities",
    "sample_top_k_rows_and_store",
]

_TINY_FP32 = float(torch.tensor(TINY, dtype=torch.float32))  # what fp32 comparisons with TINY compare to
_FP32_UNIT_ROUNDOFF = 2.0**-24

# SplitMix64 constants (kernels.md 2.1), as unsigned 64-bit values.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_COUNTER_STEP = 0xD1B54A32D192ED03


# ------------------------------------------------------------------------------ SplitMix64 uniforms


def _as_int64(value: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit ``value``."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64-stored unsigned 64-bit values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser of int64-stored unsigned 64-bit values; int64 ops wrap modulo 2^64."""
    x = x + _as_int64(_GOLDEN_GAMMA)
    x = (x ^ _shift_right(x, 30)) * _as_int64(_MIX_1)
    x = (x ^ _shift_right(x, 27)) * _as_int64(_MIX_2)
    return x ^ _shift_right(x, 31)


def fill_uniforms(total_elements, philox_seed, philox_offset, device):
    """``dspark.kernels.fill_uniforms``: the 64-bit arithmetic on int64 (wrapping), logical shifts masked."""
    counter = torch.arange(1, total_elements + 1, dtype=torch.int64, device=device)
    mixed = splitmix64(_as_int64(philox_seed) ^ (_as_int64(philox_offset) + counter * _as_int64(_COUNTER_STEP)))
    return _shift_right(mixed, 40).float() * 2.0**-24


# ------------------------------------------------------------------------------ inverse-CDF walks


def clamp_uniform(u: torch.Tensor) -> torch.Tensor:
    """``min(max(u, 0), 1 - 2^-24)`` with fmaxf's NaN rule (NaN -> 0)."""
    return torch.nan_to_num(u, nan=0.0).clamp(0.0, UNIFORM_MAX)


def _positive(w: torch.Tensor) -> torch.Tensor:
    """The walk's weights: entries that are not > 0 (incl. NaN) are skipped, i.e. add nothing."""
    return torch.where(w > 0, w, torch.zeros((), dtype=w.dtype, device=w.device))


def _fp32_grid(running: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(ulp, limit)`` per row: the fp32 spacing in the binade of the (finite, >= 0) fp32
    ``running`` sum, and the binade's upper end in units of that spacing (0 and subnormals share the
    subnormal grid 2^-149 up to 2^-126)."""
    running = running.double()
    exponent = torch.frexp(running).exponent  # running in [2^(e-1), 2^e)
    exponent = torch.where(running > 0, exponent, torch.full_like(exponent, -149))
    ulp_exponent = (exponent - 24).clamp(min=-149)
    one = torch.ones_like(running)
    return torch.ldexp(one, ulp_exponent), torch.ldexp(one, exponent.clamp(min=-126) - ulp_exponent)


def _sequential_prefix(w: torch.Tensor) -> torch.Tensor:
    """f32 ``[rows, N]`` running sums ``c_i = fl32(c_{i-1} + w_i)`` of f32 ``w >= 0``, exactly as the C++ loop.

    While the running sum stays in one binade every addition rounds to the same grid, so in units of
    its spacing the sums are integers: ``n_j = n_{j-1} + floor(w_j / ulp) + [frac > 1/2]``, plus at
    an exact tie (``frac == 1/2``) a round-half-to-even bump. A tie always leaves ``n`` even, so the
    k-th bump is ``P_k xor P_{k-1}`` with ``P_k`` the parity of the bump-free count at tie k (P_0 = 0):
    a prefix sum, no sequential dependency. Each pass covers a window of columns up to the first
    addition that leaves the binade, which is done as a real fp32 addition; windows grow with the
    position because the running sum of a row doubles ever more slowly. Rows that reach +inf stay there.
    """
    rows, n = w.shape
    out = torch.zeros_like(w)
    start = torch.zeros(rows, dtype=torch.long, device=w.device)  # first column not computed yet
    before = torch.zeros(rows, dtype=torch.float32, device=w.device)  # running sum before it
    while True:
        infinite = (start < n) & torch.isinf(before)
        if bool(infinite.any()):
            rest = infinite[:, None] & (torch.arange(n, device=w.device) >= start[:, None])
            out = torch.where(rest, before[:, None], out)
            start = torch.where(infinite, n, start)
        live = start < n
        if not bool(live.any()):
            return out
        lo = int(start[live].min())
        hi = min(n, lo + max(1024, lo))
        offsets = torch.arange(hi - lo, device=w.device)
        active = offsets >= (start - lo)[:, None]  # rows already past hi have no active column
        ulp, limit = _fp32_grid(before)
        scaled = w[:, lo:hi].double() / ulp[:, None]
        whole = torch.floor(scaled)
        frac = scaled - whole
        tie = active & (frac == 0.5)
        steps = torch.where(active, (whole + (frac > 0.5)).clamp(max=2.0**31), 0.0)  # clamp: keeps float64 exact
        count = (before.double() / ulp)[:, None] + steps.cumsum(-1)
        parity = torch.where(tie, torch.remainder(count, 2.0), 0.0)
        latest = torch.where(tie, offsets, -1).cummax(-1).values
        previous = torch.nn.functional.pad(latest[:, :-1], (1, 0), value=-1)  # latest tie strictly before
        previous_parity = torch.where(previous >= 0, parity.gather(1, previous.clamp(min=0)), 0.0)
        count = count + (tie & (parity != previous_parity)).double().cumsum(-1)
        leaves = active & (count >= limit[:, None])
        first = torch.where(leaves.any(-1), leaves.int().argmax(-1), hi - lo)
        inside = active & (offsets < first[:, None])
        out[:, lo:hi] = torch.where(inside, (count * ulp[:, None]).float(), out[:, lo:hi])
        # The addition that leaves the binade, done in fp32.
        left = live & (first < hi - lo)
        col = (first + lo).clamp(max=n - 1)[:, None]
        prior = torch.where(col > start[:, None], out.gather(1, (col - 1).clamp(min=0)), before[:, None])
        value = prior + w.gather(1, col)
        out.scatter_(1, col, torch.where(left[:, None], value, out.gather(1, col)))
        moved = live & (start < hi)
        before = torch.where(left, value.squeeze(1), torch.where(moved, out[:, hi - 1], before))
        start = torch.where(left, col.squeeze(1) + 1, torch.where(moved, hi, start))


def _prefix_bounds(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(lower, upper)`` ``[rows, N]``, non-decreasing, enclosing the sequential fp32 sums.

    Each fp32 addition errs by at most ``u * c_k`` (``u = 2^-24``; additions into the subnormal range
    are exact) and ``c_k <= (1 + 2 N u) S_k`` for the exact prefix sum ``S_k``, so
    ``|c_i - S_i| <= u (1 + 2 N u) sum_{k <= i, w_k > 0} S_k``; one extra ``u`` covers the float64
    rounding of these bounds. ``lower`` is a running max because the true ``c`` never decreases.
    """
    exact = w.double().cumsum(-1)
    slack = (exact * (w > 0)).cumsum(-1) * (_FP32_UNIT_ROUNDOFF * (2 + 2 * w.shape[-1] * _FP32_UNIT_ROUNDOFF))
    return (exact - slack).cummax(-1).values, exact + slack


def _last_positive(w: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: the last index with ``w > 0``, -1 when there is none (the walk's fallback)."""
    positive = w > 0
    last = w.shape[1] - 1 - positive.flip(-1).to(torch.int8).argmax(-1)  # argmax: first maximum
    return torch.where(positive.any(-1), last, torch.full_like(last, -1))


def _walk(w, lower, upper, t_low, t_high, exact_threshold) -> torch.Tensor:
    """NVIDIA's walk over the rows of ``w`` (f32 ``[rows, N]``, >= 0) with bounds from ``_prefix_bounds``.

    The row's fp32 threshold ``t`` is known to lie in float64 ``[t_low, t_high]``;
    ``exact_threshold(running, rows)`` gives it exactly from the exact running sums of the selected
    rows. Returns int64 ``[rows]``: the first index with ``t < c_i``, else the last positive index,
    else -1.
    """
    # c is non-decreasing, so the answer is the count of running sums <= t; bound it from both sides.
    index = (upper <= t_low[:, None]).sum(-1)
    unsure = index != (lower <= t_high[:, None]).sum(-1)
    if bool(unsure.any()):
        running = _sequential_prefix(w[unsure])
        index[unsure] = (running <= exact_threshold(running, unsure)[:, None]).sum(-1)
    return torch.where(index < w.shape[1], index, _last_positive(w))


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``_walk`` over the positive entries of f32 ``w [rows, N]`` with ``t = clamp_uniform(u)`` (f32 ``[rows]``)."""
    w, t = _positive(w), clamp_uniform(u)
    lower, upper = _prefix_bounds(w)
    return _walk(w, lower, upper, t.double(), t.double(), lambda running, rows: t[rows])


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sampleFromProbs`` (kernels.md 2.2) per row: int64 ``[rows]`` from f32 ``probs [rows, V]``, ``u [rows]``.

    First index whose sequential fp32 sum of the positive entries exceeds ``clamp_uniform(u)``; if none,
    the last positive index; 0 for a row without positive entries.
    """
    return _inverse_cdf(probs, u).clamp_min(0)


def sample_from_residual(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sampleFromResidual`` (kernels.md 2.3) per row: int64 ``[rows]`` from f32 ``p, q [rows, V]``, ``u [rows]``.

    ``r = max(p - q, 0)`` in fp32 and ``S`` its sequential fp32 sum; the walk over ``r`` uses
    ``t = clamp_uniform(u) * S`` (fp32). Rows with ``S <= 1e-20`` sample ``p`` (``sample_from_probs``).
    """
    residual = _positive(p - q)
    lower, upper = _prefix_bounds(residual)
    total_low, total_high = lower[:, -1], upper[:, -1]
    has_mass = total_low > _TINY_FP32
    unsure = ~has_mass & (total_high > _TINY_FP32)
    if bool(unsure.any()):
        has_mass[unsure] = _sequential_prefix(residual[unsure])[:, -1] > TINY
    t = clamp_uniform(u)
    slack = 2 * _FP32_UNIT_ROUNDOFF  # fl32(t * S) for any S in [total_low, total_high] lies in these bounds
    index = _walk(residual, lower, upper, t * total_low * (1 - slack), t * total_high * (1 + slack),
                  lambda running, rows: t[rows] * running[:, -1])
    no_mass = ~has_mass
    index[no_mass] = sample_from_probs(p[no_mass], u[no_mass])
    return index


def sample_from_sparse_probs(probs: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sampleFromSparseProbs`` (kernels.md 2.4) per row: ``ids[k]`` for the walk's ``k`` over f32 ``probs [rows, K]``.

    ``ids`` ``[rows, K]`` (any integer dtype, returned in it); the fallback without positive entries is
    ``ids[:, 0]``.
    """
    k = _inverse_cdf(probs, u).clamp_min(0)
    return ids.gather(1, k[:, None]).squeeze(1)


# ------------------------------------------------------------------------------ probabilities


def _scaled(values: torch.Tensor, temperature: float) -> torch.Tensor:
    """f32 ``values * invTemp(T)`` (kernels.md 3.9; ``invTemp`` is 1 for T < ``GREEDY_TEMPERATURE``)."""
    return _times(values, inv_temperature(temperature))


def _times(values: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """f32 ``values * inv_temp`` (an fp32 value; 1 leaves every value as it is)."""
    return values * torch.tensor(inv_temp, dtype=torch.float32, device=values.device)


def _softmax_weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``exp(x - max x)`` per row of f32 ``x``, and the bool rows whose sum is not finite and > 0.

    Those degenerate rows are the ones with no finite logit, a NaN, or +inf.
    """
    weights = torch.exp((x - x.amax(-1, keepdim=True)).double())
    total = weights.sum(-1)
    return weights, ~(torch.isfinite(total) & (total > 0))


def _top_k_top_p(x: torch.Tensor, weights: torch.Tensor, top_k: int, top_p: float | None):
    """Filtered float64 weights and divisor ``[rows, 1]`` (kernels.md 3.9 Cases B/C, one formulation).

    Entries ranked by ``x`` descending, ties to the lower index; ranks ``>= top_k`` dropped; the kept
    sum ``S``. Without top-p the divisor is ``max(S, 1e-20)``. With top-p the nucleus is mass-clipped:
    ``D = max(top_p * S, 1e-20)`` is handed out in rank order, each entry taking ``min(w, mass still
    missing)``, stopping once at most 1e-20 is missing; the divisor is ``D``.
    """
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    ranked = weights.gather(-1, order)
    ranked[:, top_k:] = 0
    kept = ranked.sum(-1, keepdim=True)
    if top_p is None:
        return torch.zeros_like(weights).scatter_(-1, order, ranked), kept.clamp_min(TINY)
    divisor = (top_p * kept).clamp_min(TINY)
    missing = divisor - (ranked.cumsum(-1) - ranked)
    live = missing > TINY
    live[:, 0] = True  # the top entry is always taken: the C++ checks the remaining mass after a take
    clipped = torch.where(live, torch.minimum(ranked, missing), torch.zeros_like(ranked))
    return torch.zeros_like(weights).scatter_(-1, order, clipped), divisor


def logits_to_probabilities(logits, temperature, top_k, top_p, workspace, row_settings=None):
    """``dspark.kernels.logits_to_probabilities``: a stable sort ranks the entries, float64 weights and
    normalisers (accurate, not NVIDIA's sequential fp32 sum of Case C). Per-row settings (f32
    ``[rows, 3]``) run each distinct setting's rows together (read on the host: no CUDA graph)."""
    vocab = logits.shape[1]
    if row_settings is None:
        return _probabilities(logits, *filter_settings(temperature, top_k, top_p, vocab))
    out = torch.empty_like(logits)
    settings = [tuple(row) for row in row_settings.tolist()]
    for inv_temp, k, p in dict.fromkeys(settings):
        rows = torch.tensor([i for i, row in enumerate(settings) if row == (inv_temp, k, p)], device=logits.device)
        out[rows] = _probabilities(logits[rows], inv_temp, int(k), p)
    return out


def _probabilities(logits: torch.Tensor, inv_temp: float, k: int, p: float) -> torch.Tensor:
    """Probabilities of f32 ``logits`` ``[rows, V]`` for one ``filter_settings`` ``(inv_temp, k, p)``."""
    vocab = logits.shape[1]
    k = k or vocab
    nucleus = None if p >= 1.0 else p
    x = _times(logits, inv_temp)
    weights, degenerate = _softmax_weights(x)
    if k < vocab or nucleus is not None:
        weights, divisor = _top_k_top_p(x, weights, k, nucleus)
    else:
        divisor = weights.sum(-1, keepdim=True)
    probs = (weights / divisor).float()
    return torch.where(degenerate[:, None], torch.full_like(probs, 1.0 / vocab), probs)


def normalize_top_k_rows(top_k_values, temperature):
    """``dspark.kernels.normalize_top_k_rows``: float64 normaliser."""
    weights, degenerate = _softmax_weights(_scaled(top_k_values, temperature))
    probs = (weights / weights.sum(-1, keepdim=True).clamp_min(TINY)).float()
    return torch.where(degenerate[:, None], torch.full_like(probs, 1.0 / probs.shape[1]), probs)


def request_probabilities(logits, temperature, top_k, top_p, min_p, logit_bias, workspace):
    """``dspark.kernels.request_probabilities``: vLLM's sampler in torch (one sort of each row).

    ``logits`` f32 ``[R, V]``, settings ``[S]`` and ``logit_bias`` ``[S, V]`` (or None) with
    ``R = S * L`` (setting s on rows ``s*L .. s*L+L-1``). The top-p ranks come from a stable
    descending sort read backwards, so tied entries leave the nucleus from the higher index (the
    kernel's rule; an unstable sort would pick any of them).
    """
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty_like(logits)
    per = rows // temperature.shape[0]
    if logit_bias is not None:
        logits = (logits.view(-1, per, vocab) + logit_bias[:, None]).view(rows, vocab)
    temperature, top_k, top_p, min_p = (t.repeat_interleave(per) if per > 1 else t
                                        for t in (temperature, top_k, top_p, min_p))
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    # in place where a tensor is this function's own: a verify's rows x V are hundreds of MB each
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # a greedy row's is the one-hot below
    probs = scaled.softmax(-1)
    scaled.masked_fill_(probs < min_p[:, None] * probs.amax(-1, keepdim=True), -math.inf)
    descending, order = scaled.sort(dim=-1, descending=True, stable=True)
    ascending, order = descending.flip(-1), order.flip(-1)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth_largest = ascending.gather(1, (vocab - k)[:, None])
    ascending.masked_fill_(ascending < kth_largest, -math.inf)
    # vLLM / transformers: drop the smallest tokens whose cumulative mass stays within 1 - top_p
    # (1 - top_p in fp32, as vLLM's tensor); the largest is always kept
    dropped = ascending.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    dropped[:, -1] = False
    ascending.masked_fill_(dropped, -math.inf)
    probs = scaled.scatter_(1, order, ascending).softmax(-1)
    top = logits.argmax(-1, keepdim=True)
    probs.masked_fill_(greedy[:, None], 0.0)
    return probs.scatter_(1, top, torch.where(greedy[:, None], 1.0, probs.gather(1, top)))


# ------------------------------------------------------------------------------ per-step stores


def sample_probability_rows(probability_scratch, proposal_uniforms, draft_token_ids, step, workspace):
    """``dspark.kernels.sample_probability_rows``."""
    draft_token_ids[:, step] = sample_from_probs(probability_scratch, proposal_uniforms[:, step]).to(torch.int32)


def store_draft_step_probabilities(probability_scratch, draft_probabilities, step):
    """``dspark.kernels.store_draft_step_probabilities``."""
    draft_probabilities[:, step] = probability_scratch


def sample_top_k_rows_and_store(top_k_values, top_k_indices, proposal_uniforms, draft_token_ids,
                                draft_top_k_probabilities, draft_top_k_indices, step, temperature):
    """``dspark.kernels.sample_top_k_rows_and_store``."""
    probs = normalize_top_k_rows(top_k_values, temperature)
    draft_top_k_probabilities[:, step] = probs
    draft_top_k_indices[:, step] = top_k_indices
    draft_token_ids[:, step] = sample_from_sparse_probs(probs, top_k_indices, proposal_uniforms[:, step])


def markov_sample_step(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, proposal_uniforms,
                       draft_token_ids, draft_probabilities, step, temperature, top_k, top_p, logits_stride,
                       logits_offset, workspace, row_settings=None):
    """``dspark.kernels.markov_sample_step``: correction, probabilities, draw, as separate steps."""
    rows = build_markov_logits(backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, draft_token_ids,
                               step, logits_stride, logits_offset)
    probs = logits_to_probabilities(rows, temperature, top_k, top_p, workspace, row_settings)
    store_draft_step_probabilities(probs, draft_probabilities, step)
    sample_probability_rows(probs, proposal_uniforms, draft_token_ids, step, workspace)
