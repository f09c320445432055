"""Triton filter: ``logits_to_probabilities`` -- temperature, top-k and the mass-clipped top-p of
kernels.md 3.9 -- split over the vocabulary (contract: ``dspark.kernels.logits_to_probabilities``).

NVIDIA does top-p on one thread in O(V * n). Here no pass over a row is serial:

* Unfiltered rows: per-chunk ``(max, sum exp)`` partials, then a write pass that combines them and
  stores ``exp(x - M) / S`` (and, sampling, draws the token in the chunk that holds the threshold).
* Filtered rows: the stats pass also stores the maximum of every group of ``GROUP`` entries. The
  global top k lie in the k best groups, so one program per row narrows groups and then entries to a
  few hundred candidates with histogram thresholds, sorts them and
  derives the mass-clipped cut from the ranked masses. When that decides the row, the write pass
  only writes (zeros and the listed entries). A nucleus wider than ``MAX_CANDIDATES`` entries, or
  ``top_k > MAX_CANDIDATES``, is cut by the value-space search of ``search.py``.
* Entries are ranked by int64 filter keys (order-preserving fp32 bits, then the complemented index),
  so every selection is exact, with ties to the lower index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import filter_settings, next_pow2
from . import draw as tdraw
from . import search as tsearch
from ._shared import MAX_KEY, NO_HIT, SENTINEL, TINY, claim, clamp_uniform, first_hit, is_degenerate, key_index
from ._shared import CANDIDATE_LIMIT, MAX_CANDIDATES, key_value, merge, ord_image, order_key, positive, row_chunk
from ._shared import row_filter, row_inv_temp, tile_stats
from .search import NPROBE, store_cut_state

__all__ = ["logits_to_probabilities"]

GROUP = 32  # entries per group of the candidate pass
NBINS = tl.constexpr(256)  # histogram bins of the candidate thresholds (1/8 wide)


# ------------------------------------------------------------------------------ device helpers


@triton.jit
def combine_stats(m, s):
    """Row max ``M`` and normaliser ``S`` from chunk partials (padding ``(-inf, 0)``).

    ``S`` is NaN when a chunk saw a NaN or +inf, 0 when no logit is finite: callers treat every ``S``
    that is not finite and positive as a degenerate row (uniform ``1/V``), as the reference does.
    """
    big = tl.max(m, axis=0)
    base = tl.where(big > float("-inf"), big, 0.0)
    return big, tl.sum(s * tl.exp(m - base), axis=0)


@triton.jit
def _row_stats(m_ptr, s_ptr, row, n_stats, NS_PAD: tl.constexpr):
    """A row's ``n_stats`` softmax partials ``(m, s)`` (padded to ``NS_PAD``) and their ``(M, S)``."""
    j = tl.arange(0, NS_PAD)
    m = tl.load(m_ptr + row * n_stats + j, mask=j < n_stats, other=float("-inf"))
    s = tl.load(s_ptr + row * n_stats + j, mask=j < n_stats, other=0.0)
    big, total = combine_stats(m, s)
    return m, s, big, total


@triton.jit
def _filtered_prob(x, key, x0, denom, kappa, a_kappa):
    """Filtered probability: full ``exp(x - x0)`` above the cut key, ``a_kappa`` at it, 0 below; ``/ denom``."""
    e = tl.exp(x - x0)
    return tl.where(key > kappa, e, tl.where(key == kappa, a_kappa, 0.0)) / denom


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _stats_kernel(x_ptr, x_stride, V, inv_temp, settings_ptr, m_ptr, s_ptr, group_ptr, n_chunks, n_groups,
                  CHUNK: tl.constexpr, GROUP_SIZE: tl.constexpr, CANDIDATES: tl.constexpr, PER_ROW: tl.constexpr):
    """Per (row, chunk): softmax partials of ``x = logits * inv_temp`` and, with ``CANDIDATES``, the
    largest key of every group of ``GROUP_SIZE`` entries (the candidates' first stage)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temp = row_inv_temp(row, inv_temp, settings_ptr, PER_ROW)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=mask, other=float("-inf")) * inv_temp
    m, s = tile_stats(x, 0)
    tl.store(m_ptr + row * n_chunks + chunk, m)
    tl.store(s_ptr + row * n_chunks + chunk, s)
    if CANDIDATES:
        keys = tl.where(mask, order_key(x, index), SENTINEL)
        best = tl.max(tl.reshape(keys, [CHUNK // GROUP_SIZE, GROUP_SIZE]), axis=1)
        group = chunk * (CHUNK // GROUP_SIZE) + tl.arange(0, CHUNK // GROUP_SIZE)
        tl.store(group_ptr + row.to(tl.int64) * n_groups + group, best, mask=group < n_groups)


@triton.jit
def _search_keys(keys, weight, target, NPROBE_: tl.constexpr):
    """The largest key ``kappa`` of the int64 vector ``keys`` (``SENTINEL`` = absent) whose weight at
    or above it reaches ``target``; the smallest present key when none does.

    Each round sums the weight above ``NPROBE_ - 1`` thresholds spread over the remaining key interval
    and shrinks the interval to the keys actually present, so a round cuts it ~``NPROBE_``-fold.
    """
    present = keys != SENTINEL
    lo = tl.min(tl.where(present, keys, MAX_KEY), axis=0)
    hi = tl.max(keys, axis=0)
    while lo < hi:
        width = (hi - lo).to(tl.uint64, bitcast=True)
        step = width // NPROBE_ + 1
        low_probe = lo
        high_probe = hi
        narrowed = lo > hi  # False, as a tensor
        for d in tl.static_range(1, NPROBE_):
            offset = step * d
            probe = tl.where(offset > width, hi, (lo.to(tl.uint64, bitcast=True) + offset).to(tl.int64, bitcast=True))
            reach = tl.sum(tl.where(present & (keys >= probe), weight, 0.0), axis=0) >= target
            low_probe = tl.where(reach, probe, low_probe)
            high_probe = tl.where(reach | narrowed, high_probe, probe)
            narrowed = narrowed | ~reach
        lo = tl.min(tl.where(present & (keys >= low_probe), keys, MAX_KEY), axis=0)
        hi = tl.where(narrowed, tl.max(tl.where(present & (keys < high_probe), keys, SENTINEL), axis=0), hi)
    return lo


@triton.jit
def _compact(values, keep, scratch, OUT: tl.constexpr):
    """The kept int64 ``values`` (at most ``OUT``, in their order) as an ``[OUT]`` vector padded with
    ``SENTINEL``, through the ``scratch`` row (no register scatter in Triton)."""
    position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # earlier readers of scratch are done
    tl.store(scratch + position, values, mask=keep & (position < OUT))
    tl.debug_barrier()  # every thread's store is visible
    j = tl.arange(0, OUT)
    return tl.load(scratch + j, mask=j < tl.sum(keep.to(tl.int32), axis=0), other=SENTINEL)


@triton.jit
def _candidates(keys, x0, take, scratch, OUT: tl.constexpr, NPROBE_: tl.constexpr):
    """A superset of the ``take`` largest int64 ``keys`` (``SENTINEL`` = absent; values <= ``x0``): at
    most ``OUT`` keys, unsorted, ``SENTINEL``-padded.

    A histogram of ``x0 - value`` in bins of 1/8 (everything beyond 32 in the last bin) gives the bin
    where the ``take``-th largest falls; the keys down to that bin are kept. When more than ``OUT``
    share those bins (flat rows, ties), the exact ``take``-th key is searched instead.
    """
    present = keys != SENTINEL
    depth = (x0 - key_value(keys)) * 8.0
    bins = tl.maximum(tl.where(depth < NBINS - 1, depth, NBINS - 1), 0.0).to(tl.int32)
    reached = tl.cumsum(tl.histogram(bins, NBINS, mask=present), axis=0) >= take
    last_bin = tl.min(tl.where(reached, tl.arange(0, NBINS), NBINS - 1), axis=0)
    chosen = present & (bins <= last_bin)
    if tl.sum(chosen.to(tl.int32), axis=0) > OUT:
        chosen = present & (keys >= _search_keys(keys, tl.full(keys.shape, 1.0, tl.float32), take * 1.0, NPROBE_))
    return _compact(keys, chosen, scratch, OUT)


@triton.jit
def top_candidates(x_row, bias_row, V, inv_temp, group_keys, n_groups, take, scratch, KT: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, NPROBE_: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A row's ``take <= KT // 2`` largest filter keys (``x = x_row[i] * inv_temp``; ``HAS_BIAS``:
    ``(x_row[i] + bias_row[i]) * inv_temp``) from its maxima of
    every ``GROUP_SIZE`` entries (``group_keys``: ``n_groups`` of them, ``SENTINEL``-padded): they lie
    in the best ``take`` groups, and ``_candidates`` narrows groups, then their entries, to at most
    ``KT`` keys, sorted. Returns ``top [KT]`` in descending order, ``SENTINEL``-padded: its first
    ``take`` keys are the ``take`` largest (the row's keys are distinct: value, then index)."""
    big = key_value(tl.max(group_keys, axis=0))
    groups = _candidates(group_keys, big, tl.minimum(take, n_groups), scratch, KT, NPROBE_)
    index = ((key_index(groups) // GROUP_SIZE) * GROUP_SIZE)[:, None] + tl.arange(0, GROUP_SIZE)[None, :]
    in_row = (groups != SENTINEL)[:, None] & (index < V)
    x = tl.load(x_row + index, mask=in_row, other=float("-inf"))
    if HAS_BIAS:
        x += tl.load(bias_row + index, mask=in_row, other=0.0)
    keys = tl.reshape(tl.where(in_row, order_key(x * inv_temp, index), SENTINEL), [KT * GROUP_SIZE])
    # a sort, not a pairwise rank: a [KT, KT] tile spills registers (a program per row)
    return tl.sort(_candidates(keys, big, take, scratch, KT, NPROBE_), descending=True)


@triton.jit
def _select_kernel(x_ptr, x_stride, V, inv_temp, top_k, top_p, settings_ptr, m_ptr, s_ptr, group_ptr, n_stats,
                   n_groups, par_ptr, kappa_ptr, state_ptr, kept_ptr, kept_p_ptr, bounds_ptr, cut_ptr, fill_ptr,
                   scratch_ptr, u_ptr, u_stride, tok_ptr, tok_stride,
                   NC_PAD: tl.constexpr, NG_PAD: tl.constexpr, KT: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   NPROBE_: tl.constexpr, PER_ROW: tl.constexpr, SAMPLE: tl.constexpr):
    """Per row: the exact best ``take <= KT // 2`` entries (``top_k``, or ``KT // 2`` for top-p), the
    cut (``kappa``, its share ``a``, ``denom``), the kept entries' ids and probabilities and, with
    ``SAMPLE``, the draw among them. The row's filter comes from ``row_filter`` (``PER_ROW``).

    The candidates are ``top_candidates``' (group maxima, then entries, sorted).
    ``par[row] = (x0, denom, a)``; ``state[row]`` is 0
    (cut found; ``kept`` lists the kept entries), 1 (degenerate row: uniform ``1/V``), 2 (cut beyond
    the candidates: the value-space search starts from ``bounds``/``cut``) or 3 (a per-row setting
    without filter: every entry kept, ``exp(x - max) / S``, drawn after the write).
    """
    row = tl.program_id(0)
    inv_temp, top_k, top_p = row_filter(row, inv_temp, top_k, top_p, settings_ptr, PER_ROW)
    use_k = (top_k > 0) & (top_k <= CANDIDATE_LIMIT)
    big_k = top_k > CANDIDATE_LIMIT  # the search finds the k-th entry
    use_p = top_p < 1.0
    unfiltered = (top_k <= 0) & (top_p >= 1.0)
    take = tl.minimum(tl.where(use_k, top_k, KT // 2), V)
    _, _, big, total = _row_stats(m_ptr, s_ptr, row, n_stats, NC_PAD)
    degenerate = is_degenerate(total)

    g = tl.arange(0, NG_PAD)
    group_keys = tl.load(group_ptr + row.to(tl.int64) * n_groups + g, mask=g < n_groups, other=SENTINEL)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    top = top_candidates(x_row, x_row, V, inv_temp, group_keys, n_groups, take,
                         scratch_ptr + row.to(tl.int64) * KT, KT, GROUP_SIZE, NPROBE_, False)
    rank = tl.arange(0, KT)
    keep = (top != SENTINEL) & (rank < take)
    value = key_value(top)
    x_top = tl.max(tl.where(keep, value, float("-inf")), axis=0)
    e = tl.where(keep, tl.exp(value - x_top), 0.0)
    excl = tl.cumsum(e, axis=0) - e  # mass ranked above
    # top-p alone clips the whole row's mass (its max is x_top too)
    kept = tl.where(use_k, tl.sum(e, axis=0), total)
    nucleus = tl.maximum(top_p * kept, TINY)
    missing = nucleus - excl
    denom = tl.where(use_p, nucleus, tl.maximum(kept, TINY))
    live = keep & tl.where(use_p, (missing > TINY) | (rank == 0), True)  # the top entry is always taken
    clipped = tl.sum((keep & (missing - e <= TINY)).to(tl.int32), axis=0) > 0
    resolved = tl.where(big_k, False, tl.where(use_p, use_k | clipped, True))
    a_share = tl.where(use_p, tl.minimum(e, missing), e)
    kappa = tl.min(tl.where(live, top, MAX_KEY), axis=0)  # the last live entry in rank order
    a_cut = tl.sum(tl.where(top == kappa, a_share, 0.0), axis=0)
    state = tl.where(degenerate, 1, tl.where(unfiltered, 3, tl.where(resolved, 0, 2)))
    p = tl.where(live, _filtered_prob(value, top, x_top, denom, kappa, a_cut), 0.0)
    ids = key_index(top)
    # an unfiltered row keeps every entry: exp(x - max) / S, written through the cut (every key above)
    tl.store(kappa_ptr + row, tl.where(unfiltered, SENTINEL, kappa))
    tl.store(par_ptr + row * 3, tl.where(unfiltered, big, x_top))
    tl.store(par_ptr + row * 3 + 1, tl.where(unfiltered, total, denom))
    tl.store(par_ptr + row * 3 + 2, a_cut)
    tl.store(state_ptr + row, state)
    slot = row * KT + tl.arange(0, KT)
    tl.store(kept_ptr + slot, tl.where(live, ids, -1))
    tl.store(kept_p_ptr + slot, p)
    # Where the value-space search starts: the k-th entry by count, or the nucleus cut by mass, which
    # lies at or above x0 + ln((1 - top_p) S / V) (the V entries below it hold less than (1 - top_p) S).
    target = tl.where(big_k, top_k * 1.0, denom)
    floor = tl.log(tl.maximum((1.0 - top_p) * total / V, 1e-30)) - 0.01  # 1 % slack for rounding
    # exp(-88) ~ 6e-39: the mass below is far under TINY
    olo = tl.where(big_k, ord_image(tl.full([], float("-inf"), tl.float32)), ord_image(x_top + tl.maximum(floor, -88.0)))
    tl.store(bounds_ptr + row * 2, olo)
    tl.store(bounds_ptr + row * 2 + 1, ord_image(x_top))
    store_cut_state(cut_ptr + row * 4, 0.0, 0.0, V * 1.0, target)
    tl.store(fill_ptr + row, 0)
    if SAMPLE:
        t = clamp_uniform(tl.load(u_ptr + row.to(tl.int64) * u_stride))
        # The kept probabilities walked in vocabulary order: cum_i = sum of kept p at ids <= id_i.
        cum = tl.sum(tl.where((ids[None, :] <= ids[:, None]) & (p[None, :] > 0.0), p[None, :], 0.0), axis=1)
        token = tl.min(tl.where((p > 0.0) & (cum > t), ids, NO_HIT), axis=0)
        token = tl.where(token == NO_HIT, tl.max(tl.where(p > 0.0, ids, -1), axis=0), token)
        uniform_token = tl.minimum((t * V).to(tl.int32), V - 1)  # degenerate row: p = 1/V everywhere
        token = tl.where(degenerate, uniform_token, tl.maximum(token, 0))
        if state < 2:  # searched and unfiltered rows are drawn after the write
            tl.store(tok_ptr + row.to(tl.int64) * tok_stride, token)


@triton.jit
def _write_kernel(x_ptr, x_stride, out_ptr, out_stride, V, inv_temp, settings_ptr, m_ptr, s_ptr, n_stats,
                  par_ptr, kappa_ptr, state_ptr, kept_ptr, kept_p_ptr, u_ptr, u_stride, tok_ptr, tok_stride,
                  CHUNK: tl.constexpr, SC: tl.constexpr, NS_PAD: tl.constexpr, KT: tl.constexpr,
                  FILTERED: tl.constexpr, SAMPLE: tl.constexpr, PER_ROW: tl.constexpr):
    """Per (row, chunk): store the probabilities of ``x = logits * inv_temp`` (in place allowed).

    Unfiltered rows combine the ``n_stats`` softmax partials (chunks of ``SC`` entries). With ``SAMPLE``
    (unfiltered only) the chunk masses follow from the same partials, so the program whose chunk holds
    the threshold draws the token from its freshly computed probabilities: no second pass over the row.
    Filtered rows whose kept entries the select kernel listed (state 0) are written without reading the
    row: zeros, then the listed probabilities; searched rows (state 3) use the cut.
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temp = row_inv_temp(row, inv_temp, settings_ptr, PER_ROW)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if FILTERED:
        state = tl.load(state_ptr + row)
        if state == 0:
            tl.store(out_row + index, tl.zeros([CHUNK], tl.float32), mask=mask)
            tl.debug_barrier()  # the zeros land before the kept entries overwrite theirs
            j = row * KT + tl.arange(0, KT)
            ids = tl.load(kept_ptr + j)
            mine = (ids >= chunk * CHUNK) & (ids < chunk * CHUNK + CHUNK)
            tl.store(out_row + ids, tl.load(kept_p_ptr + j), mask=mine)
        else:
            x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=mask, other=float("-inf")) * inv_temp
            p = _filtered_prob(x, order_key(x, index), tl.load(par_ptr + row * 3), tl.load(par_ptr + row * 3 + 1),
                               tl.load(kappa_ptr + row), tl.load(par_ptr + row * 3 + 2))
            tl.store(out_row + index, tl.where(state == 1, 1.0 / V, p), mask=mask)
    else:
        x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=mask, other=float("-inf")) * inv_temp
        m, s, big, total = _row_stats(m_ptr, s_ptr, row, n_stats, NS_PAD)
        degenerate = is_degenerate(total)
        p = tl.where(degenerate, 1.0 / V, tl.exp(x - big) / total)
        if SAMPLE:
            j = tl.arange(0, NS_PAD)
            live = j < n_stats
            share = tl.minimum(V - j * SC, SC).to(tl.float32) / V
            mass = tl.where(live, tl.where(degenerate, share, s * tl.exp(m - big) / total), 0.0)
            incl = tl.cumsum(mass, axis=0)
            per = CHUNK // SC
            lo = tl.sum(tl.where(j == chunk * per - 1, incl, 0.0), axis=0)
            hi = tl.sum(tl.where(j == tl.minimum(chunk * per + per, n_stats) - 1, incl, 0.0), axis=0)
            end = tl.sum(tl.where(j == n_stats - 1, incl, 0.0), axis=0)
            t = clamp_uniform(tl.load(u_ptr + row.to(tl.int64) * u_stride))
            last_chunk = tl.max(tl.where(mass > 0.0, j, -1), axis=0) // per
            owner = tl.where(t < end, (lo <= t) & (t < hi), chunk == last_chunk)
            if owner:
                w = tl.where(mask, positive(p), 0.0)
                token = first_hit(w, index, lo, t)
                last = tl.max(tl.where(w > 0.0, index, -1), axis=0)
                token = tl.where(token == NO_HIT, tl.maximum(last, 0), token)
                tl.store(tok_ptr + row.to(tl.int64) * tok_stride, token)
        tl.store(out_row + index, p, mask=mask)


# ------------------------------------------------------------------------------ host side


def _candidate_slots(k: int) -> int:
    """Candidates per row: twice the padded take (groups, then entries; the threshold bins hold some
    beyond the take-th)."""
    return 2 * (MAX_CANDIDATES if k > MAX_CANDIDATES or k == 0 else max(16, next_pow2(k)))


def _searched(k: int, p: float) -> bool:
    """Rows the candidates cannot decide: ``top_k > MAX_CANDIDATES``, or top-p without top-k."""
    return k > MAX_CANDIDATES or (p < 1.0 and k == 0)


def plan(rows: int, vocab: int, k: int, p: float, *, stats_given: bool = False, sample: bool = False) -> dict:
    """Scratch of ``probabilities`` for ``filter_settings`` ``(k, p)``: softmax partials and group maxima
    (unless ``stats_given``), the filtered rows' state, the search's and the searched rows' draws."""
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    chunk = row_chunk(vocab)
    if not (k > 0 or p < 1.0):
        n_stats = triton.cdiv(vocab, chunk)
        return {} if stats_given else {"m": (rows * n_stats, f32), "s": (rows * n_stats, f32)}
    n_chunks = triton.cdiv(vocab, max(chunk, GROUP))
    kt = _candidate_slots(k)
    out = {} if stats_given else {"m": (rows * n_chunks, f32), "s": (rows * n_chunks, f32),
                                  "groups": (rows * triton.cdiv(vocab, GROUP), i64)}
    out.update(par=(rows * 3, f32), kappa=(rows, i64), state=(rows, i32), kept=(rows * kt, i32),
               kept_p=(rows * kt, f32), bounds=(rows * 2, i32), cut=(rows * 4, f32), fill=(rows, i32),
               compact=(rows * kt, i64))
    if _searched(k, p):
        out = merge(out, tsearch.plan(rows, vocab, n_chunks), tdraw.plan(rows, vocab) if sample else {})
    return out


# The plan of per-row settings: every filter kind may occur (the most candidates, the search, its draws).
ROW_PLAN = (0, 0.5)


def probabilities(x, x_stride, out, out_stride, rows, vocab, inv_temp, k, p, workspace, *, stats=None, groups=None,
                  sample=None, settings=None, per_row=1):
    """Store ``logits_to_probabilities`` of ``rows`` rows of ``x`` into ``out`` (in place allowed), for
    ``filter_settings`` ``(inv_temp, k, p)``, or each row's own: ``settings`` f32 ``[rows, 3]``
    (``row_filter_settings``; ``per_row`` 2 takes its k and p only, the scalar ``inv_temp`` applying).

    ``stats = (m, s, n_stats, chunk)`` are softmax partials already computed and, filtered, ``groups``
    the maxima of every ``GROUP`` entries (both or neither, then the stats pass computes them).
    ``sample = (u, u_stride, tokens, token_stride)`` also draws one token per row.
    """
    mode = 0 if settings is None else per_row
    if mode:
        k, p = ROW_PLAN  # per row, every row takes the filtered path (an unfiltered row is its state 3)
    else:
        settings = out  # not read
    buf = claim(workspace, plan(rows, vocab, k, p, stats_given=stats is not None, sample=sample is not None),
               out.device)
    chunk = row_chunk(vocab)
    u, u_stride, tok, tok_stride = sample if sample is not None else (out, 0, out, 0)
    if not (k > 0 or p < 1.0):
        if stats is None:
            n_stats = triton.cdiv(vocab, chunk)
            m, s = buf["m"], buf["s"]
            _stats_kernel[(rows, n_stats)](x, x_stride, vocab, inv_temp, settings, m, s, m, n_stats, 0, CHUNK=chunk,
                                           GROUP_SIZE=GROUP, CANDIDATES=False, PER_ROW=0, num_warps=4)
            stats = (m, s, n_stats, chunk)
        m, s, n_stats, stats_chunk = stats
        chunk = max(chunk, stats_chunk)  # a write chunk covers whole stats chunks (both powers of two)
        _write_kernel[(rows, triton.cdiv(vocab, chunk))](
            x, x_stride, out, out_stride, vocab, inv_temp, settings, m, s, n_stats, m, m, m, m, m, u, u_stride, tok,
            tok_stride, CHUNK=chunk, SC=stats_chunk, NS_PAD=next_pow2(n_stats), KT=1, FILTERED=False,
            SAMPLE=sample is not None, PER_ROW=0, num_warps=4)
        return
    chunk = max(chunk, GROUP)
    n_chunks = triton.cdiv(vocab, chunk)
    n_groups = triton.cdiv(vocab, GROUP)
    kt = _candidate_slots(k)
    if stats is None:
        m, s, groups = buf["m"], buf["s"], buf["groups"]
        _stats_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, settings, m, s, groups, n_chunks, n_groups,
                                        CHUNK=chunk, GROUP_SIZE=GROUP, CANDIDATES=True, PER_ROW=mode, num_warps=4)
        stats = (m, s, n_chunks, chunk)
    m, s, n_stats, _ = stats
    state = buf["state"]
    _select_kernel[(rows,)](x, x_stride, vocab, inv_temp, k, p, settings, m, s, groups, n_stats, n_groups, buf["par"],
                            buf["kappa"], state, buf["kept"], buf["kept_p"], buf["bounds"], buf["cut"], buf["fill"],
                            buf["compact"], u, u_stride, tok, tok_stride,
                            NC_PAD=next_pow2(n_stats), NG_PAD=next_pow2(n_groups), KT=kt, GROUP_SIZE=GROUP,
                            NPROBE_=NPROBE, PER_ROW=mode, SAMPLE=sample is not None, num_warps=8)
    searched = _searched(k, p)
    if searched:
        tsearch.search(x, x_stride, rows, vocab, inv_temp, k, p, settings, mode, chunk, n_chunks, state, buf)
    _write_kernel[(rows, n_chunks)](x, x_stride, out, out_stride, vocab, inv_temp, settings, m, m, 0, buf["par"],
                                    buf["kappa"], state, buf["kept"], buf["kept_p"], u, u_stride, tok, tok_stride,
                                    CHUNK=chunk, SC=chunk, NS_PAD=1, KT=kt, FILTERED=True, SAMPLE=False, PER_ROW=mode,
                                    num_warps=4)
    if searched and sample is not None:  # rows the select kernel could not draw from its candidates
        tdraw.draw_rows(out, rows, vocab, tok, tok_stride, workspace, p_stride=out_stride, u=u, u_stride=u_stride,
                        searched=state)


def logits_to_probabilities(logits, temperature, top_k, top_p, workspace, row_settings=None):
    """``dspark.kernels.logits_to_probabilities`` (``row_settings``: its per-row form, f32 ``[rows, 3]``)."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows:
        inv_temp, k, p = filter_settings(temperature, top_k, top_p, vocab) if row_settings is None else (1.0, 0, 1.0)
        probabilities(logits, vocab, out, vocab, rows, vocab, inv_temp, k, p, workspace, settings=row_settings)
    return out
