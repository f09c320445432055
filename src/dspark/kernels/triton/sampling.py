"""Triton backend of the sampled DSpark path (kernels.md 2.1-2.4, 3.9, 3.10, 3.12, 3.18-3.20, 3.22).

NVIDIA draws every token with one thread walking the whole vocabulary row and does top-p on one
thread in O(V * n). Here every pass over a row is spread over the vocabulary:

* Probabilities are split-row: per-chunk ``(max, sum exp)`` partials, then a write pass that combines
  them and stores ``exp(x - M) / S``. With top-k/top-p (or T -> 0) the stats pass also stores the
  maximum of every group of ``GROUP`` entries; the global top k lie in the k best groups, so one
  program per row narrows groups and then entries to a few hundred candidates with histogram
  thresholds, ranks them exactly by pairwise comparison, and derives the mass-clipped cut from the
  ranked masses. When that decides the row, the write pass
  only writes (zeros and the listed entries). A nucleus wider than 128 entries, or ``top_k > 128``,
  is cut by a value-space search: multi-program passes count the weight above 16 probes of an
  interval that starts at the bound ``x0 + ln((1 - top_p) S / V)``, until at most ``BUCKET`` entries
  remain, which are gathered and searched exactly (sorted). No path is O(V * n) or one program
  walking a whole row.
* Draws are inverse-CDF walks as parallel prefix sums: chunk masses, the chunk the threshold falls
  into, then a block ``cumsum`` inside it. The sums are pairwise, not NVIDIA's sequential fp32 sum,
  so a uniform within ~1e-6 of a CDF boundary may get the neighbouring token; otherwise the tokens are
  the reference's.
* Entries are ranked by an int64 key (order-preserving fp32 bits, then the complemented index), so
  every selection is exact, with ties to the lower index.

Backend functions receive the public functions' normalised arguments (see ``dspark.kernels._backend``)
and never read out of range on bad token ids (ids are clamped before they address memory).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "fill_uniforms",
    "logits_to_probabilities",
    "markov_sample_step",
    "vanilla_markov_sample",
    "sample_probability_rows",
    "store_draft_step_probabilities",
    "normalize_top_k_rows",
    "sample_top_k_rows_and_store",
]

_TINY = tl.constexpr(1e-20)  # the C++ "no mass" threshold
GREEDY_TEMPERATURE = 1e-3
NUCLEUS_OFF = 1 - 1e-6  # top_p at or above it disables top-p
GROUP = 32  # entries per group of the candidate pass
NBINS = tl.constexpr(256)  # histogram bins of the candidate thresholds (1/8 wide)
MAX_CANDIDATES = 128  # top-k up to this is selected exactly from candidates (NVIDIA's parallel limit)
NPROBE = 16  # thresholds tested per pass of the wide-nucleus search
SEARCH_PASSES = 3  # multi-program probe passes before one program per row takes over (flat rows need 2)
_SENTINEL = tl.constexpr(-(2**63))  # key below every real entry's key
_NO_HIT = tl.constexpr(2**31 - 1)  # "no index" for min-reductions
_MAX_KEY = tl.constexpr(2**63 - 1)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BY_EXTRACTION = tl.constexpr(_INTERPRETED)  # see _sorted_descending
# The interpreter's bf16 tl.dot is wrong; there the Markov GEMM runs in fp32 (exact products anyway).
_UPCAST_DOT = _INTERPRETED
# Entries per program when many small rows share one (the interpreter pays per program, not per entry).
# Loops with a runtime trip count are written as while loops: the interpreter (numpy 2) rejects them.
ROW_BLOCK_ENTRIES = 32768 if _INTERPRETED else 4096


# ------------------------------------------------------------------------------ device helpers


@triton.jit
def _clamp_uniform(u):
    """NVIDIA's ``clampUniform``: ``min(max(u, 0), 1 - 2^-24)``, NaN -> 0 as fmaxf does."""
    return tl.minimum(tl.where(u > 0.0, u, 0.0), 0.99999994)


@triton.jit
def _ord(x):
    """int32 that orders like the fp32 ``x`` (-0.0 and +0.0 map to the same value; x not NaN)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _ord_value(o):
    """fp32 value of an ``_ord`` image."""
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def _order_key(x, index):
    """int64 key ranking entries by value, then by the LOWER index (the reference's stable order)."""
    return (_ord(x).to(tl.int64) << 32) | (index.to(tl.int64) ^ 0xFFFFFFFF)


@triton.jit
def _key_value(key):
    return _ord_value((key >> 32).to(tl.int32))


@triton.jit
def _key_index(key):
    return ((key & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _sorted_descending(keys, N: tl.constexpr):
    """The ``N`` distinct int64 ``keys`` (``_SENTINEL`` padding last) in descending order.

    Triton's bitonic ``tl.sort`` on the GPU. The CPU interpreter runs that network's reductions element
    by element in Python (seconds per row), so there the same order comes from ``N`` max-extractions.
    """
    if _BY_EXTRACTION:
        j = tl.arange(0, N)
        out = tl.full([N], _SENTINEL, tl.int64)
        for i in tl.static_range(N):
            best = tl.max(keys, axis=0)
            out = tl.where(j == i, best, out)
            keys = tl.where(keys == best, _SENTINEL, keys)
        return out
    else:
        return tl.sort(keys, descending=True)


@triton.jit
def _tile_stats(x, AXIS: tl.constexpr):
    """``(max, sum exp(x - max))`` along ``AXIS``; a NaN gives a NaN sum, an all -inf tile ``(-inf, 0)``."""
    m = tl.max(tl.where(x == x, x, float("-inf")), axis=AXIS)
    base = tl.where(m > float("-inf"), m, 0.0)
    return m, tl.sum(tl.exp(x - tl.expand_dims(base, AXIS)), axis=AXIS)


@triton.jit
def _combine_stats(m, s):
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
    big, total = _combine_stats(m, s)
    return m, s, big, total


@triton.jit
def _degenerate(total):
    return (total != total) | (total <= 0.0) | (total == float("inf"))


@triton.jit
def _positive(w):
    """The walk's weights: entries that are not > 0 (incl. NaN) add nothing."""
    return tl.where(w > 0.0, w, 0.0)


@triton.jit
def _first_hit(w, index, carry, t):
    """First ``index`` whose running sum ``carry + cumsum(w)`` exceeds ``t`` (w > 0), else 2^31-1."""
    hit = (w > 0.0) & (carry + tl.cumsum(w, axis=0) > t)
    return tl.min(tl.where(hit, index, _NO_HIT), axis=0)


@triton.jit
def _filtered_prob(x, key, x0, denom, kappa, a_kappa):
    """Filtered probability: full ``exp(x - x0)`` above the cut key, ``a_kappa`` at it, 0 below; ``/ denom``."""
    e = tl.exp(x - x0)
    return tl.where(key > kappa, e, tl.where(key == kappa, a_kappa, 0.0)) / denom


# ------------------------------------------------------------------------------ uniforms


@triton.jit
def _fill_uniforms_kernel(out_ptr, total, seed, offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    counter = (i + 1).to(tl.uint64)
    x = seed.to(tl.uint64) ^ (offset.to(tl.uint64) + counter * 0xD1B54A32D192ED03)
    x = x + 0x9E3779B97F4A7C15  # SplitMix64; uint64 makes every >> logical and every op wrap mod 2^64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    u = (x >> 40).to(tl.float32) * 5.9604644775390625e-08  # top 24 bits * 2^-24, exact
    tl.store(out_ptr + i, _clamp_uniform(u), mask=i < total)


def fill_uniforms(total_elements, philox_seed, philox_offset, device):
    """f32 ``[total_elements]`` SplitMix64 uniforms (kernels.md 2.1), bit-exact with the reference."""
    out = torch.empty(total_elements, dtype=torch.float32, device=device)
    if total_elements:
        block = 1024
        _fill_uniforms_kernel[(triton.cdiv(total_elements, block),)](out, total_elements, philox_seed, philox_offset,
                                                                      BLOCK=block)
    return out


# ------------------------------------------------------------------------------ probabilities: kernels


@triton.jit
def _stats_kernel(x_ptr, x_stride, V, inv_temp, m_ptr, s_ptr, group_ptr, n_chunks, n_groups,
                  CHUNK: tl.constexpr, GROUP_SIZE: tl.constexpr, CANDIDATES: tl.constexpr):
    """Per (row, chunk): softmax partials of ``x = logits * inv_temp`` and, with ``CANDIDATES``, the
    largest key of every group of ``GROUP_SIZE`` entries (the candidates' first stage)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=mask, other=float("-inf")) * inv_temp
    m, s = _tile_stats(x, 0)
    tl.store(m_ptr + row * n_chunks + chunk, m)
    tl.store(s_ptr + row * n_chunks + chunk, s)
    if CANDIDATES:
        keys = tl.where(mask, _order_key(x, index), _SENTINEL)
        best = tl.max(tl.reshape(keys, [CHUNK // GROUP_SIZE, GROUP_SIZE]), axis=1)
        group = chunk * (CHUNK // GROUP_SIZE) + tl.arange(0, CHUNK // GROUP_SIZE)
        tl.store(group_ptr + row.to(tl.int64) * n_groups + group, best, mask=group < n_groups)


@triton.jit
def _search_keys(keys, weight, target, NPROBE_: tl.constexpr):
    """The largest key ``kappa`` of the int64 vector ``keys`` (``_SENTINEL`` = absent) whose weight at
    or above it reaches ``target``; the smallest present key when none does.

    Each round sums the weight above ``NPROBE_ - 1`` thresholds spread over the remaining key interval
    and shrinks the interval to the keys actually present, so a round cuts it ~``NPROBE_``-fold.
    """
    present = keys != _SENTINEL
    lo = tl.min(tl.where(present, keys, _MAX_KEY), axis=0)
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
        lo = tl.min(tl.where(present & (keys >= low_probe), keys, _MAX_KEY), axis=0)
        hi = tl.where(narrowed, tl.max(tl.where(present & (keys < high_probe), keys, _SENTINEL), axis=0), hi)
    return lo


@triton.jit
def _compact(values, keep, scratch, OUT: tl.constexpr):
    """The kept int64 ``values`` (at most ``OUT``, in their order) as an ``[OUT]`` vector padded with
    ``_SENTINEL``, through the ``scratch`` row (no register scatter in Triton)."""
    position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # earlier readers of scratch are done
    tl.store(scratch + position, values, mask=keep & (position < OUT))
    tl.debug_barrier()  # every thread's store is visible
    j = tl.arange(0, OUT)
    return tl.load(scratch + j, mask=j < tl.sum(keep.to(tl.int32), axis=0), other=_SENTINEL)


@triton.jit
def _candidates(keys, x0, take, scratch, OUT: tl.constexpr, NPROBE_: tl.constexpr):
    """A superset of the ``take`` largest int64 ``keys`` (``_SENTINEL`` = absent; values <= ``x0``): at
    most ``OUT`` keys, unsorted, ``_SENTINEL``-padded.

    A histogram of ``x0 - value`` in bins of 1/8 (everything beyond 32 in the last bin) gives the bin
    where the ``take``-th largest falls; the keys down to that bin are kept. When more than ``OUT``
    share those bins (flat rows, ties), the exact ``take``-th key is searched instead.
    """
    present = keys != _SENTINEL
    depth = (x0 - _key_value(keys)) * 8.0
    bins = tl.maximum(tl.where(depth < NBINS - 1, depth, NBINS - 1), 0.0).to(tl.int32)
    reached = tl.cumsum(tl.histogram(bins, NBINS, mask=present), axis=0) >= take
    last_bin = tl.min(tl.where(reached, tl.arange(0, NBINS), NBINS - 1), axis=0)
    chosen = present & (bins <= last_bin)
    if tl.sum(chosen.to(tl.int32), axis=0) > OUT:
        chosen = present & (keys >= _search_keys(keys, tl.full(keys.shape, 1.0, tl.float32), take * 1.0, NPROBE_))
    return _compact(keys, chosen, scratch, OUT)


@triton.jit
def _select_kernel(x_ptr, x_stride, V, inv_temp, m_ptr, s_ptr, group_ptr, n_stats, n_groups, take, top_k, top_p,
                   par_ptr, kappa_ptr, state_ptr, kept_ptr, kept_p_ptr, bounds_ptr, cut_ptr, fill_ptr, scratch_ptr,
                   u_ptr, u_stride, tok_ptr, tok_stride,
                   NC_PAD: tl.constexpr, NG_PAD: tl.constexpr, KT: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   NPROBE_: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr, BIG_K: tl.constexpr,
                   SAMPLE: tl.constexpr):
    """Per row: the exact best ``take <= KT // 2`` entries, the cut (``kappa``, its share ``a``, ``denom``),
    the kept entries' ids and probabilities and, with ``SAMPLE``, the draw among them.

    The best ``take`` entries lie in the best ``take`` groups by group maximum; histogram thresholds
    (``_candidates``) narrow both the groups and their entries to ``KT`` candidates, ranked exactly by
    pairwise comparison. ``par[row] = (x0, denom, a)``; ``state[row]`` is 0
    (cut found; ``kept`` lists the kept entries), 1 (degenerate row: uniform ``1/V``) or 2 (cut beyond
    the candidates: the value-space search starts from ``bounds``/``cut``).
    """
    row = tl.program_id(0)
    _, _, big, total = _row_stats(m_ptr, s_ptr, row, n_stats, NC_PAD)
    degenerate = _degenerate(total)

    scratch = scratch_ptr + row.to(tl.int64) * KT
    g = tl.arange(0, NG_PAD)
    group_keys = tl.load(group_ptr + row.to(tl.int64) * n_groups + g, mask=g < n_groups, other=_SENTINEL)
    groups = _candidates(group_keys, big, tl.minimum(take, n_groups), scratch, KT, NPROBE_)
    index = ((_key_index(groups) // GROUP_SIZE) * GROUP_SIZE)[:, None] + tl.arange(0, GROUP_SIZE)[None, :]
    in_row = (groups != _SENTINEL)[:, None] & (index < V)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=in_row, other=float("-inf")) * inv_temp
    keys = tl.reshape(tl.where(in_row, _order_key(x, index), _SENTINEL), [KT * GROUP_SIZE])
    top = _candidates(keys, big, take, scratch, KT, NPROBE_)
    above = top[None, :] > top[:, None]  # [i, j]: entry j ranks above entry i
    rank = tl.sum(above.to(tl.int32), axis=1)
    keep = (top != _SENTINEL) & (rank < take)
    value = _key_value(top)
    x_top = tl.max(tl.where(keep, value, float("-inf")), axis=0)
    e = tl.where(keep, tl.exp(value - x_top), 0.0)
    excl = tl.sum(tl.where(above, e[None, :], 0.0), axis=1)  # mass ranked above
    if USE_K:
        kept = tl.sum(e, axis=0)
    else:
        kept = total  # top-p alone clips the whole row's mass (its max is x_top too)
    if USE_P:
        denom = tl.maximum(top_p * kept, _TINY)
        missing = denom - excl
        live = keep & ((missing > _TINY) | (rank == 0))  # the top entry is always taken
        resolved = USE_K | (tl.sum((keep & (missing - e <= _TINY)).to(tl.int32), axis=0) > 0)
        a_share = tl.minimum(e, missing)
    else:
        denom = tl.maximum(kept, _TINY)
        live = keep
        resolved = True
        a_share = e
    if BIG_K:
        resolved = False  # top_k > MAX_CANDIDATES: the search finds the k-th entry
    kappa = tl.min(tl.where(live, top, _MAX_KEY), axis=0)  # the last live entry in rank order
    a_cut = tl.sum(tl.where(top == kappa, a_share, 0.0), axis=0)
    state = tl.where(degenerate, 1, tl.where(resolved, 0, 2))
    p = tl.where(live, _filtered_prob(value, top, x_top, denom, kappa, a_cut), 0.0)
    ids = _key_index(top)
    tl.store(par_ptr + row * 3, x_top)
    tl.store(par_ptr + row * 3 + 1, denom)
    tl.store(par_ptr + row * 3 + 2, a_cut)
    tl.store(kappa_ptr + row, kappa)
    tl.store(state_ptr + row, state)
    slot = row * KT + tl.arange(0, KT)
    tl.store(kept_ptr + slot, tl.where(live, ids, -1))
    tl.store(kept_p_ptr + slot, p)
    # Where the value-space search starts: the k-th entry by count, or the nucleus cut by mass, which
    # lies at or above x0 + ln((1 - top_p) S / V) (the V entries below it hold less than (1 - top_p) S).
    if BIG_K:
        target = top_k * 1.0
        olo = _ord(tl.full([], float("-inf"), tl.float32))
    else:
        target = denom
        floor = tl.log(tl.maximum((1.0 - top_p) * total / V, 1e-30)) - 0.01  # 1 % slack for rounding
        olo = _ord(x_top + tl.maximum(floor, -88.0))  # exp(-88) ~ 6e-39: the mass below is far under TINY
    tl.store(bounds_ptr + row * 2, olo)
    tl.store(bounds_ptr + row * 2 + 1, _ord(x_top))
    _store_cut_state(cut_ptr + row * 4, 0.0, 0.0, V * 1.0, target)
    tl.store(fill_ptr + row, 0)
    if SAMPLE:
        t = _clamp_uniform(tl.load(u_ptr + row.to(tl.int64) * u_stride))
        # The kept probabilities walked in vocabulary order: cum_i = sum of kept p at ids <= id_i.
        cum = tl.sum(tl.where((ids[None, :] <= ids[:, None]) & (p[None, :] > 0.0), p[None, :], 0.0), axis=1)
        token = tl.min(tl.where((p > 0.0) & (cum > t), ids, _NO_HIT), axis=0)
        token = tl.where(token == _NO_HIT, tl.max(tl.where(p > 0.0, ids, -1), axis=0), token)
        uniform_token = tl.minimum((t * V).to(tl.int32), V - 1)  # degenerate row: p = 1/V everywhere
        token = tl.where(degenerate, uniform_token, tl.maximum(token, 0))
        if state != 2:
            tl.store(tok_ptr + row.to(tl.int64) * tok_stride, token)


@triton.jit
def _store_cut_state(cut, above_mass, above_count, count, target):
    """A row's search state: weight above the interval, entries above it, an upper bound of the
    entries inside it, and the weight the cut must reach."""
    tl.store(cut, above_mass)
    tl.store(cut + 1, above_count)
    tl.store(cut + 2, count)
    tl.store(cut + 3, target)


@triton.jit
def _probes(olo, ohi, NPROBE_: tl.constexpr):
    """``NPROBE_`` non-decreasing thresholds from ``olo`` to ``ohi`` (ord space; both included).

    Spread evenly in value where the interval is finite (fast on continuous rows), else in ord space;
    ``olo + d`` guarantees progress down to a single value.
    """
    d = tl.arange(0, NPROBE_)
    lo_v = _ord_value(olo)
    width = _ord_value(ohi) - lo_v
    by_value = _ord(lo_v + width * (d.to(tl.float32) / (NPROBE_ - 1)))
    by_ord = (olo.to(tl.int64) + ((ohi.to(tl.int64) - olo) * d) // (NPROBE_ - 1)).to(tl.int32)
    finite = (lo_v > float("-inf")) & (width < float("inf"))
    probes = tl.minimum(tl.maximum(tl.where(finite, by_value, by_ord), olo + d), ohi)
    return tl.where(d == 0, olo, probes)


@triton.jit
def _row_entry(x_row, start, V, inv_temp, floor, TILE: tl.constexpr):
    """One tile of a row: ``(index, in_row, x, ord, key)``; entries below the key ``floor`` are not in_row."""
    index = start + tl.arange(0, TILE)
    mask = index < V
    x = tl.load(x_row + index, mask=mask, other=float("-inf")) * inv_temp
    key = _order_key(x, index)
    return index, mask & (key >= floor), x, _ord(x), key


@triton.jit
def _probe_sums(x_row, start, stop, V, inv_temp, x0, floor, probes, TILE: tl.constexpr, NPROBE_: tl.constexpr):
    """Weight ``exp(x - x0)`` and count of the entries ``[start, stop)`` of a row at or above each probe."""
    mass_ge = tl.zeros([TILE, NPROBE_], dtype=tl.float32)
    count_ge = tl.zeros([TILE, NPROBE_], dtype=tl.float32)
    while start < stop:
        _, valid, x, o, _ = _row_entry(x_row, start, V, inv_temp, floor, TILE)
        ge = valid[:, None] & (o[:, None] >= probes[None, :])
        count_ge += ge.to(tl.float32)
        mass_ge += tl.where(ge, tl.exp(x - x0)[:, None], 0.0)
        start += TILE
    return tl.sum(mass_ge, axis=0), tl.sum(count_ge, axis=0)


@triton.jit
def _narrow(probes, mass_d, count_d, target, olo, ohi, above_mass, above_count,
            BY_COUNT: tl.constexpr, NPROBE_: tl.constexpr):
    """The probe interval holding the cut: new ``(olo, ohi, above_mass, above_count, count)``."""
    d = tl.arange(0, NPROBE_)
    weight = count_d if BY_COUNT else mass_d
    best = tl.max(tl.where((weight >= target) | (d == 0), d, 0), axis=0)
    has_next = best < NPROBE_ - 1
    nxt = d == best + 1
    ohi = tl.where(has_next, tl.sum(tl.where(nxt, probes, 0), axis=0) - 1, ohi)
    above_mass = tl.where(has_next, tl.sum(tl.where(nxt, mass_d, 0.0), axis=0), above_mass)
    above_count = tl.where(has_next, tl.sum(tl.where(nxt, count_d, 0.0), axis=0), above_count)
    olo = tl.sum(tl.where(d == best, probes, 0), axis=0)
    count = tl.sum(tl.where(d == best, count_d, 0.0), axis=0) - above_count
    return olo, ohi, above_mass, above_count, count


@triton.jit
def _gather(x_row, start, stop, V, inv_temp, floor, olo, ohi, bucket_row, n, TILE: tl.constexpr):
    """Append the keys of the entries ``[start, stop)`` whose ord lies in ``[olo, ohi]`` at ``bucket_row + n``."""
    while start < stop:
        _, valid, _, o, key = _row_entry(x_row, start, V, inv_temp, floor, TILE)
        inside = valid & (o >= olo) & (o <= ohi)
        tl.store(bucket_row + n + tl.cumsum(inside.to(tl.int32), axis=0) - 1, key, mask=inside)
        n += tl.sum(inside.to(tl.int32), axis=0)
        start += TILE
    return n


@triton.jit
def _cut_finish(keys, x0, target, above_mass, BY_COUNT: tl.constexpr, BUCKET: tl.constexpr):
    """The cut among the gathered ``keys`` (``[BUCKET]``, ``_SENTINEL`` = absent): the largest key whose
    at-or-above weight reaches ``target`` (the smallest key when none does). Sorted first, so the
    sums do not depend on the order the keys were gathered in. Returns ``(kappa, mass above, at)``."""
    keys = _sorted_descending(keys, BUCKET)
    valid = keys != _SENTINEL
    e = tl.where(valid, tl.exp(_key_value(keys) - x0), 0.0)
    mass = tl.cumsum(e, axis=0)
    if BY_COUNT:
        reach = tl.cumsum(valid.to(tl.float32), axis=0)
    else:
        reach = mass
    j = tl.arange(0, BUCKET)
    first = tl.min(tl.where(valid & (reach >= target), j, BUCKET), axis=0)
    pick = j == tl.minimum(first, tl.sum(valid.to(tl.int32), axis=0) - 1)
    kappa = tl.where(tl.sum(pick.to(tl.int32), axis=0) > 0, tl.sum(tl.where(pick, keys, 0), axis=0), _MAX_KEY)
    return kappa, above_mass + tl.sum(tl.where(pick, mass - e, 0.0), axis=0), tl.sum(tl.where(pick, e, 0.0), axis=0)


@triton.jit
def _cut(x_row, V, inv_temp, x0, target, floor, bucket_row, olo, ohi, above_mass, above_count, count, gathered,
         BY_COUNT: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr):
    """The largest key ``kappa`` of a row whose at-or-above weight reaches ``target`` (weights: 1 per
    entry with ``BY_COUNT``, else ``exp(x - x0)``; only keys >= ``floor`` count).

    Starts from the search state ``[olo, ohi]`` (ord interval holding the cut; ``above_*`` = weight
    above it; ``count`` = an upper bound of the entries inside). This program narrows it with
    ``NPROBE_`` probes per pass over the row until at most ``BUCKET`` entries remain, gathers them
    (unless ``gathered``: the multi-program passes already did) and searches them exactly; if more
    than ``BUCKET`` entries share one value, they rank by index.
    Returns ``(kappa, mass of the keys above kappa, exp(x_kappa - x0))``.
    """
    zero = tl.zeros([], tl.int32)  # a tensor: the helpers' loop counters start from it
    while (count > BUCKET) & (olo < ohi):
        probes = _probes(olo, ohi, NPROBE_)
        mass_d, count_d = _probe_sums(x_row, zero, V, V, inv_temp, x0, floor, probes, TILE, NPROBE_)
        olo, ohi, above_mass, above_count, count = _narrow(probes, mass_d, count_d, target, olo, ohi, above_mass,
                                                           above_count, BY_COUNT, NPROBE_)
        gathered = gathered * 0
    above = above_count if BY_COUNT else above_mass
    slack = 0.0 if BY_COUNT else _TINY
    if count <= BUCKET:
        if gathered == 0:
            tl.debug_barrier()
            _gather(x_row, zero, V, V, inv_temp, floor, olo, ohi, bucket_row, zero, TILE)
        tl.debug_barrier()
        jb = tl.arange(0, BUCKET)
        keys = tl.load(bucket_row + jb, mask=jb < count.to(tl.int32), other=_SENTINEL)
        kappa, mass_above, at = _cut_finish(keys, x0, target - slack - above, above_mass, BY_COUNT, BUCKET)
    else:
        # More than BUCKET entries share one value: they rank by index, each with the same weight.
        at = tl.exp(_ord_value(olo) - x0)
        unit = 1.0 if BY_COUNT else at
        rank = tl.minimum(tl.maximum(tl.ceil((target - slack - above) / unit) - 1.0, 0.0), count - 1.0).to(tl.int32)
        seen = 0
        found = 0
        start = 0
        while start < V:
            index, valid, _, o, _ = _row_entry(x_row, start, V, inv_temp, floor, TILE)
            tie = valid & (o == olo)
            hit = tie & (seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1 == rank)
            found = tl.maximum(found, tl.max(tl.where(hit, index, -1), axis=0))
            seen += tl.sum(tie.to(tl.int32), axis=0)
            start += TILE
        kappa = (olo.to(tl.int64) << 32) | (found.to(tl.int64) ^ 0xFFFFFFFF)
        mass_above = above_mass + rank.to(tl.float32) * at
    return kappa, mass_above, at


@triton.jit
def _searching(state_ptr, bounds_ptr, cut_ptr, row, BUCKET: tl.constexpr):
    """``(searching, olo, ohi)``: whether ``row`` still needs a multi-program probe pass."""
    olo = tl.load(bounds_ptr + row * 2)
    ohi = tl.load(bounds_ptr + row * 2 + 1)
    return (tl.load(state_ptr + row) == 2) & (tl.load(cut_ptr + row * 4 + 2) > BUCKET) & (olo < ohi), olo, ohi


@triton.jit
def _probe_kernel(x_ptr, x_stride, V, inv_temp, par_ptr, state_ptr, bounds_ptr, cut_ptr, part_ptr, n_chunks,
                  CHUNK: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr):
    """Per (row, chunk) of rows still searching: the chunk's weight and count at or above each probe."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    searching, olo, ohi = _searching(state_ptr, bounds_ptr, cut_ptr, row, BUCKET)
    if searching:
        start = chunk * CHUNK
        mass_d, count_d = _probe_sums(x_ptr + row.to(tl.int64) * x_stride, start, start + CHUNK, V, inv_temp,
                                      tl.load(par_ptr + row * 3), _SENTINEL, _probes(olo, ohi, NPROBE_),
                                      TILE, NPROBE_)
        slot = part_ptr + (row * n_chunks + chunk).to(tl.int64) * (2 * NPROBE_) + tl.arange(0, NPROBE_)
        tl.store(slot, mass_d)
        tl.store(slot + NPROBE_, count_d)


@triton.jit
def _narrow_kernel(state_ptr, bounds_ptr, cut_ptr, part_ptr, n_chunks, NC_PAD: tl.constexpr, BUCKET: tl.constexpr,
                   NPROBE_: tl.constexpr, BY_COUNT: tl.constexpr):
    """Per row still searching: sum the chunks' probe partials and keep the probe interval holding the cut."""
    row = tl.program_id(0)
    searching, olo, ohi = _searching(state_ptr, bounds_ptr, cut_ptr, row, BUCKET)
    if searching:
        c = tl.arange(0, NC_PAD)[:, None]
        slot = part_ptr + (row * n_chunks + c).to(tl.int64) * (2 * NPROBE_) + tl.arange(0, NPROBE_)[None, :]
        mass_d = tl.sum(tl.load(slot, mask=c < n_chunks, other=0.0), axis=0)
        count_d = tl.sum(tl.load(slot + NPROBE_, mask=c < n_chunks, other=0.0), axis=0)
        cut = cut_ptr + row * 4
        olo, ohi, above_mass, above_count, count = _narrow(_probes(olo, ohi, NPROBE_), mass_d, count_d,
                                                           tl.load(cut + 3), olo, ohi, tl.load(cut),
                                                           tl.load(cut + 1), BY_COUNT, NPROBE_)
        tl.store(bounds_ptr + row * 2, olo)
        tl.store(bounds_ptr + row * 2 + 1, ohi)
        _store_cut_state(cut, above_mass, above_count, count, tl.load(cut + 3))


@triton.jit
def _gather_kernel(x_ptr, x_stride, V, inv_temp, state_ptr, bounds_ptr, cut_ptr, fill_ptr, bucket_ptr,
                   CHUNK: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr):
    """Per (row, chunk) of rows whose interval holds at most ``BUCKET`` entries: append them to the
    row's bucket (space reserved with one atomic per chunk; ``_cut_finish`` sorts the bucket)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    olo = tl.load(bounds_ptr + row * 2)
    ohi = tl.load(bounds_ptr + row * 2 + 1)
    if (tl.load(state_ptr + row) == 2) & (tl.load(cut_ptr + row * 4 + 2) <= BUCKET):
        x_row = x_ptr + row.to(tl.int64) * x_stride
        start = chunk * CHUNK
        n = tl.zeros([], tl.int32)
        at = start
        while at < start + CHUNK:
            _, valid, _, o, _ = _row_entry(x_row, at, V, inv_temp, _SENTINEL, TILE)
            n += tl.sum((valid & (o >= olo) & (o <= ohi)).to(tl.int32), axis=0)
            at += TILE
        if n > 0:
            base = tl.atomic_add(fill_ptr + row, n)
            _gather(x_row, start, start + CHUNK, V, inv_temp, _SENTINEL, olo, ohi,
                    bucket_ptr + row.to(tl.int64) * BUCKET, base, TILE)


@triton.jit
def _search_kernel(x_ptr, x_stride, V, inv_temp, top_p, par_ptr, kappa_ptr, state_ptr, bounds_ptr, cut_ptr,
                   bucket_ptr, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr,
                   BIG_K: tl.constexpr, USE_P: tl.constexpr):
    """Rows left at state 2 by ``_select_kernel``: finish the k-th key (``BIG_K``) and/or the nucleus cut
    from the search state the multi-program passes left; state 3 marks them (drawn after the write)."""
    row = tl.program_id(0)
    if tl.load(state_ptr + row) == 2:
        x_row = x_ptr + row.to(tl.int64) * x_stride
        bucket_row = bucket_ptr + row.to(tl.int64) * BUCKET
        x0 = tl.load(par_ptr + row * 3)
        cut = cut_ptr + row * 4
        count = tl.load(cut + 2)
        gathered = (count <= BUCKET).to(tl.int32)
        kappa, above, at = _cut(x_row, V, inv_temp, x0, tl.load(cut + 3), tl.full([], _SENTINEL, tl.int64), bucket_row,
                                tl.load(bounds_ptr + row * 2), tl.load(bounds_ptr + row * 2 + 1), tl.load(cut),
                                tl.load(cut + 1), count, gathered, BIG_K, TILE, BUCKET, NPROBE_)
        if BIG_K:
            kept = above + at
            a_cut = at
            if USE_P:
                denom = tl.maximum(top_p * kept, _TINY)
                olo = tl.maximum(_ord(x0 - 88.0), (kappa >> 32).to(tl.int32))
                nothing = tl.zeros([], tl.float32)  # a fresh search state (tensors: loop-carried in _cut)
                kappa, above, at = _cut(x_row, V, inv_temp, x0, denom, kappa, bucket_row, olo, _ord(x0), nothing,
                                        nothing, nothing + V, gathered * 0, False, TILE, BUCKET, NPROBE_)
                a_cut = tl.minimum(at, tl.maximum(denom - above, 0.0))
            else:
                denom = tl.maximum(kept, _TINY)
        else:
            denom = tl.load(par_ptr + row * 3 + 1)
            a_cut = tl.minimum(at, tl.maximum(denom - above, 0.0))
        tl.store(par_ptr + row * 3 + 1, denom)
        tl.store(par_ptr + row * 3 + 2, a_cut)
        tl.store(kappa_ptr + row, kappa)
        tl.store(state_ptr + row, 3)


@triton.jit
def _write_kernel(x_ptr, x_stride, out_ptr, out_stride, V, inv_temp, m_ptr, s_ptr, n_stats,
                  par_ptr, kappa_ptr, state_ptr, kept_ptr, kept_p_ptr, u_ptr, u_stride, tok_ptr, tok_stride,
                  CHUNK: tl.constexpr, SC: tl.constexpr, NS_PAD: tl.constexpr, KT: tl.constexpr,
                  FILTERED: tl.constexpr, SAMPLE: tl.constexpr):
    """Per (row, chunk): store the probabilities of ``x = logits * inv_temp`` (in place allowed).

    Unfiltered rows combine the ``n_stats`` softmax partials (chunks of ``SC`` entries). With ``SAMPLE``
    (unfiltered only) the chunk masses follow from the same partials, so the program whose chunk holds
    the threshold draws the token from its freshly computed probabilities: no second pass over the row.
    Filtered rows whose kept entries the select kernel listed (state 0) are written without reading the
    row: zeros, then the listed probabilities; searched rows (state 3) use the cut.
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
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
            p = _filtered_prob(x, _order_key(x, index), tl.load(par_ptr + row * 3), tl.load(par_ptr + row * 3 + 1),
                               tl.load(kappa_ptr + row), tl.load(par_ptr + row * 3 + 2))
            tl.store(out_row + index, tl.where(state == 1, 1.0 / V, p), mask=mask)
    else:
        x = tl.load(x_ptr + row.to(tl.int64) * x_stride + index, mask=mask, other=float("-inf")) * inv_temp
        m, s, big, total = _row_stats(m_ptr, s_ptr, row, n_stats, NS_PAD)
        degenerate = _degenerate(total)
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
            t = _clamp_uniform(tl.load(u_ptr + row.to(tl.int64) * u_stride))
            last_chunk = tl.max(tl.where(mass > 0.0, j, -1), axis=0) // per
            owner = tl.where(t < end, (lo <= t) & (t < hi), chunk == last_chunk)
            if owner:
                w = tl.where(mask, _positive(p), 0.0)
                token = _first_hit(w, index, lo, t)
                last = tl.max(tl.where(w > 0.0, index, -1), axis=0)
                token = tl.where(token == _NO_HIT, tl.maximum(last, 0), token)
                tl.store(tok_ptr + row.to(tl.int64) * tok_stride, token)
        tl.store(out_row + index, p, mask=mask)


# ------------------------------------------------------------------------------ probabilities: host side


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _chunk(vocab: int, cap: int = 4096) -> int:
    """Entries of a row handled by one program: ``cap`` on real vocabularies, smaller for small ones
    so that every row still spans several chunks."""
    return min(cap, max(16, _pow2(triton.cdiv(vocab, 8))))


def _bucket(vocab: int) -> int:
    """Entries the nucleus search gathers and sorts at the end (smaller for small vocabularies)."""
    return min(1024, max(64, _pow2(vocab) // 8))


_WORKSPACE: dict = {}


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable scratch buffer: after a first call at a size, no allocation (CUDA-graph friendly)."""
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _inv_temperature(temperature: float) -> float:
    """NVIDIA's ``invTemp``: 1 below ``GREEDY_TEMPERATURE``, else the fp32 ``1/T`` (exact as a float)."""
    if temperature < GREEDY_TEMPERATURE:
        return 1.0
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32))


def _filters(temperature: float, top_k: int, top_p: float, vocab: int) -> tuple[float, int, float]:
    """``(inv_temp, k, p)`` of kernels.md 3.9: ``k = 0`` means no top-k, ``p = 1`` no top-p."""
    if temperature < GREEDY_TEMPERATURE:
        return 1.0, 1, 1.0
    k = top_k if 0 < top_k < vocab else 0
    return _inv_temperature(temperature), k, (top_p if top_p < NUCLEUS_OFF else 1.0)


def _search(x, x_stride, rows, vocab, inv_temp, k, p, chunk, n_chunks, par, kappa, state, bounds, cut, fill):
    """The value-space search of the rows the candidates cannot decide (state 2 -> 3): ``SEARCH_PASSES``
    multi-program probe passes, a multi-program gather of the remaining interval, then one program
    per row finishes the cut (continuing the passes itself only if the interval is still too wide)."""
    device = x.device
    bucket = _bucket(vocab)
    tile = min(256, chunk)
    part = _workspace("probe_partials", rows * n_chunks * 2 * NPROBE, torch.float32, device)
    scratch = _workspace("bucket", rows * bucket, torch.int64, device)
    by_count = k > MAX_CANDIDATES  # the k-th entry first; a nucleus cut inside top-k is left to the row program
    for _ in range(SEARCH_PASSES):
        _probe_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, par, state, bounds, cut, part, n_chunks,
                                        CHUNK=chunk, TILE=tile, BUCKET=bucket, NPROBE_=NPROBE, num_warps=4)
        _narrow_kernel[(rows,)](state, bounds, cut, part, n_chunks, NC_PAD=_pow2(n_chunks), BUCKET=bucket,
                                NPROBE_=NPROBE, BY_COUNT=by_count, num_warps=4)
    _gather_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, state, bounds, cut, fill, scratch, CHUNK=chunk,
                                     TILE=tile, BUCKET=bucket, num_warps=4)
    _search_kernel[(rows,)](x, x_stride, vocab, inv_temp, p, par, kappa, state, bounds, cut, scratch, TILE=tile,
                            BUCKET=bucket, NPROBE_=NPROBE, BIG_K=by_count, USE_P=p < 1.0, num_warps=8)


def _probabilities(x, x_stride, out, out_stride, rows, vocab, inv_temp, k, p, *, stats=None, groups=None,
                   sample=None):
    """Store ``logits_to_probabilities`` of ``rows`` rows of ``x`` into ``out`` (in place allowed).

    ``stats = (m, s, n_stats, chunk)`` are softmax partials already computed and, filtered, ``groups``
    the maxima of every ``GROUP`` entries (both or neither, then the stats pass computes them).
    ``sample = (u, u_stride, tokens, token_stride)`` also draws one token per row.
    """
    device = out.device
    filtered = k > 0 or p < 1.0
    chunk = _chunk(vocab)
    u, u_stride, tok, tok_stride = sample if sample is not None else (out, 0, out, 0)
    n_write = triton.cdiv(vocab, chunk)
    if not filtered:
        if stats is None:
            n_stats = n_write
            m = _workspace("m", rows * n_stats, torch.float32, device)
            s = _workspace("s", rows * n_stats, torch.float32, device)
            _stats_kernel[(rows, n_stats)](x, x_stride, vocab, inv_temp, m, s, m, n_stats, 0, CHUNK=chunk,
                                           GROUP_SIZE=GROUP, CANDIDATES=False, num_warps=4)
            stats = (m, s, n_stats, chunk)
        m, s, n_stats, stats_chunk = stats
        chunk = max(chunk, stats_chunk)  # a write chunk covers whole stats chunks (both powers of two)
        _write_kernel[(rows, triton.cdiv(vocab, chunk))](
            x, x_stride, out, out_stride, vocab, inv_temp, m, s, n_stats, m, m, m, m, m, u, u_stride, tok, tok_stride,
            CHUNK=chunk, SC=stats_chunk, NS_PAD=_pow2(n_stats), KT=1, FILTERED=False, SAMPLE=sample is not None,
            num_warps=4)
        return
    chunk = max(chunk, GROUP)
    n_chunks = triton.cdiv(vocab, chunk)
    big_k = k > MAX_CANDIDATES
    kpad = MAX_CANDIDATES if big_k or k == 0 else max(16, _pow2(k))
    n_groups = triton.cdiv(vocab, GROUP)
    kt = 2 * kpad  # candidates: groups, then entries (the threshold bins hold some beyond the take-th)
    if groups is None:
        m = _workspace("m", rows * n_chunks, torch.float32, device)
        s = _workspace("s", rows * n_chunks, torch.float32, device)
        groups = _workspace("groups", rows * n_groups, torch.int64, device)
        _stats_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, m, s, groups, n_chunks, n_groups, CHUNK=chunk,
                                        GROUP_SIZE=GROUP, CANDIDATES=True, num_warps=4)
        stats = (m, s, n_chunks, chunk)
    m, s, n_stats, _ = stats
    par = _workspace("par", rows * 3, torch.float32, device)
    kappa = _workspace("kappa", rows, torch.int64, device)
    state = _workspace("state", rows, torch.int32, device)
    kept = _workspace("kept", rows * kt, torch.int32, device)
    kept_p = _workspace("kept_p", rows * kt, torch.float32, device)
    bounds = _workspace("bounds", rows * 2, torch.int32, device)
    cut = _workspace("cut", rows * 4, torch.float32, device)
    fill = _workspace("fill", rows, torch.int32, device)
    compact = _workspace("compact", rows * kt, torch.int64, device)
    take = min(vocab, kpad if big_k or k == 0 else k)
    _select_kernel[(rows,)](x, x_stride, vocab, inv_temp, m, s, groups, n_stats, n_groups, take, k, p, par, kappa,
                            state, kept, kept_p, bounds, cut, fill, compact, u, u_stride, tok, tok_stride,
                            NC_PAD=_pow2(n_stats), NG_PAD=_pow2(n_groups), KT=kt, GROUP_SIZE=GROUP, NPROBE_=NPROBE,
                            USE_K=k > 0 and not big_k, USE_P=p < 1.0, BIG_K=big_k, SAMPLE=sample is not None,
                            num_warps=8)
    searched = big_k or (p < 1.0 and k == 0)
    if searched:
        _search(x, x_stride, rows, vocab, inv_temp, k, p, chunk, n_chunks, par, kappa, state, bounds, cut, fill)
    _write_kernel[(rows, n_chunks)](x, x_stride, out, out_stride, vocab, inv_temp, m, m, 0, par, kappa, state, kept,
                                    kept_p, u, u_stride, tok, tok_stride, CHUNK=chunk, SC=chunk, NS_PAD=1, KT=kt,
                                    FILTERED=True, SAMPLE=False, num_warps=4)
    if searched and sample is not None:  # rows the select kernel could not draw from its candidates
        draw_rows(out, rows, vocab, tok, tok_stride, p_stride=out_stride, u=u, u_stride=u_stride, searched=state)


def logits_to_probabilities(logits, temperature, top_k, top_p):
    """f32 ``[rows, V]`` probabilities of contiguous f32 ``logits [rows, V]`` (kernels.md 3.9)."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows:
        inv_temp, k, p = _filters(temperature, top_k, top_p, vocab)
        _probabilities(logits, vocab, out, vocab, rows, vocab, inv_temp, k, p)
    return out


# ------------------------------------------------------------------------------ inverse-CDF draws


@triton.jit
def _draw_weights(p_ptr, q_ptr, p_off, q_off, index, mask, use_q):
    """The walk's weights of ``[ROWS, N]`` entries, ``max(p - q, 0)`` where ``use_q`` (residual) else
    ``p``, and the plain ``p`` weights (a residual's fallback) from the same load."""
    p = tl.load(p_ptr + p_off[:, None] + index, mask=mask, other=0.0)
    q = tl.load(q_ptr + tl.maximum(q_off, 0)[:, None] + index, mask=mask & use_q[:, None], other=0.0)
    return tl.where(mask, _positive(tl.where(use_q[:, None], p - q, p)), 0.0), tl.where(mask, _positive(p), 0.0)


@triton.jit
def _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """``(live, p_off, q_off)`` of ``[ROWS]`` draws: offsets from the accept descriptors, or plain rows
    (with ``SEARCHED``, only the rows at state 3, which the filter's select kernel could not draw)."""
    live = rows < n_rows
    if SEARCHED:
        live = live & (tl.load(state_ptr + rows, mask=live, other=0) == 3)
    if DESC:
        p_off = tl.load(desc_ptr + rows * 2, mask=live, other=0)
        q_off = tl.load(desc_ptr + rows * 2 + 1, mask=live, other=-1)
    else:
        p_off = rows.to(tl.int64) * p_stride
        q_off = tl.full(rows.shape, -1, tl.int64)
    return live, p_off, q_off


@triton.jit
def _mass_kernel(p_ptr, q_ptr, n_rows, V, p_stride, desc_ptr, state_ptr, mass_ptr, last_ptr, n_chunks,
                 ROWS: tl.constexpr, CHUNK: tl.constexpr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """Per (``ROWS`` rows, chunk): mass and last positive index of the walk's weights; kind 0 = the
    row's weights (residual where it has a q row), kind 1 = plain p (the residual's fallback)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunk = tl.program_id(1)
    live, p_off, q_off = _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC, SEARCHED)
    index = (chunk * CHUNK + tl.arange(0, CHUNK))[None, :]
    mask = live[:, None] & (index < V)
    slot = rows * 2 * n_chunks + chunk
    w, plain = _draw_weights(p_ptr, q_ptr, p_off, q_off, index, mask, q_off >= 0)
    tl.store(mass_ptr + slot, tl.sum(w, axis=1), mask=live)
    tl.store(last_ptr + slot, tl.max(tl.where(w > 0.0, index, -1), axis=1), mask=live)
    if DESC:
        tl.store(mass_ptr + slot + n_chunks, tl.sum(plain, axis=1), mask=live)
        tl.store(last_ptr + slot + n_chunks, tl.max(tl.where(plain > 0.0, index, -1), axis=1), mask=live)


@triton.jit
def _walk_kernel(p_ptr, q_ptr, n_rows, V, p_stride, desc_ptr, state_ptr, draw_ptr, u_ptr, u_stride, mass_ptr,
                 last_ptr, n_chunks, out_ptr, out_stride, len_ptr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                 NC_PAD: tl.constexpr, DESC: tl.constexpr, SEARCHED: tl.constexpr):
    """Per ``ROWS`` rows: the chunk where each threshold falls, then a block cumsum inside it.

    With ``DESC`` (probabilistic accept) ``draw[row] = (uniform bits, n)``: the token goes to
    ``out[row, n]`` and ``n + 1`` to ``len[row]``; a residual without mass (``<= 1e-20``) draws from p
    instead, with the unscaled threshold (kernels.md 2.3).
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live, p_off, q_off = _draw_rows(rows, n_rows, desc_ptr, p_stride, state_ptr, DESC, SEARCHED)
    if DESC:
        u = tl.load(draw_ptr + rows * 2, mask=live, other=0).to(tl.float32, bitcast=True)
        n = tl.load(draw_ptr + rows * 2 + 1, mask=live, other=0)
    else:
        u = tl.load(u_ptr + rows.to(tl.int64) * u_stride, mask=live, other=0.0)
        n = tl.zeros([ROWS], tl.int32)
    c = tl.arange(0, NC_PAD)[None, :]
    in_chunks = live[:, None] & (c < n_chunks)
    slot = rows[:, None] * 2 * n_chunks + c
    mass = tl.load(mass_ptr + slot, mask=in_chunks, other=0.0)
    last = tl.load(last_ptr + slot, mask=in_chunks, other=-1)
    t = _clamp_uniform(u)
    use_q = q_off >= 0
    if DESC:
        residual_mass = tl.sum(mass, axis=1)
        plain = use_q & (residual_mass <= _TINY)
        use_q = use_q & ~plain
        t = tl.where(use_q, t * residual_mass, t)
        mass = tl.where(plain[:, None], tl.load(mass_ptr + slot + n_chunks, mask=in_chunks, other=0.0), mass)
        last = tl.where(plain[:, None], tl.load(last_ptr + slot + n_chunks, mask=in_chunks, other=-1), last)
    incl = tl.cumsum(mass, axis=1)
    owner = tl.min(tl.where((mass > 0.0) & (incl > t[:, None]), c, NC_PAD), axis=1)
    carry = tl.sum(tl.where(c == owner[:, None] - 1, incl, 0.0), axis=1)
    index = owner[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    w, _ = _draw_weights(p_ptr, q_ptr, p_off, q_off, index, live[:, None] & (owner < NC_PAD)[:, None] & (index < V),
                         use_q)
    hit = (w > 0.0) & (carry[:, None] + tl.cumsum(w, axis=1) > t[:, None])
    token = tl.min(tl.where(hit, index, _NO_HIT), axis=1)
    # No hit: rounding put t past the owner's sum (its last positive), or past the total (the row's).
    owner_last = tl.sum(tl.where(c == owner[:, None], last, 0), axis=1)
    fallback = tl.where(owner < NC_PAD, owner_last, tl.maximum(tl.max(last, axis=1), 0))
    token = tl.where(token == _NO_HIT, fallback, token)
    tl.store(out_ptr + rows.to(tl.int64) * out_stride + n, token, mask=live)
    if DESC:
        tl.store(len_ptr + rows, n + 1, mask=live)


# Launch parameters of the two draw kernels: the entries of a row one program covers (a power of two)
# and the warps of the chunk-mass and walk programs, for plain draws and for accept's residual/bonus
# draws. H200 sweep (``python -m dspark.bench.breakdown --sweep-draws``, docs/bench-sampling.md):
# 2048-entry chunks with 8-warp mass programs; 8-warp walks for plain draws (21.6 µs for 64 rows),
# 4-warp walks for accept (18.9 µs at B = 1; 8 warps: 30.1 µs).
DRAW_LAUNCH = {"chunk": 2048, "mass_warps": 8, "walk_warps": 8, "accept_walk_warps": 4}


def draw_rows(p, rows, vocab, out, out_stride, *, p_stride=0, u=None, u_stride=0, q=None, desc=None, draw=None,
              lengths=None, searched=None):
    """Inverse-CDF draws over ``rows`` rows (two launches, no serial O(V) loop).

    Plain rows: row ``r`` of ``p`` (row stride ``p_stride``) with uniform ``u[r * u_stride]``, token to
    ``out[r * out_stride]``. Accept mode (``desc``/``draw``/``lengths``, written by the accept kernel):
    ``desc[r] = (p offset, q offset or -1)``, ``draw[r] = (u bits, n)``. ``searched``: the filter's
    row states; only rows at state 3 are drawn. Small vocabularies put several rows in one program.
    """
    device = p.device
    chunk = _chunk(vocab, DRAW_LAUNCH["chunk"])
    n_chunks = triton.cdiv(vocab, chunk)
    per_program = max(1, ROW_BLOCK_ENTRIES // (chunk * _pow2(n_chunks)))
    with_desc = desc is not None
    mass = _workspace("draw_mass", rows * 2 * n_chunks, torch.float32, device)
    last = _workspace("draw_last", rows * 2 * n_chunks, torch.int32, device)
    q = p if q is None else q
    desc = mass if desc is None else desc
    draw = mass if draw is None else draw
    u = mass if u is None else u
    lengths = last if lengths is None else lengths
    state = last if searched is None else searched
    grid = triton.cdiv(rows, per_program)
    _mass_kernel[(grid, n_chunks)](p, q, rows, vocab, p_stride, desc, state, mass, last, n_chunks, ROWS=per_program,
                                   CHUNK=chunk, DESC=with_desc, SEARCHED=searched is not None,
                                   num_warps=DRAW_LAUNCH["mass_warps"])
    _walk_kernel[(grid,)](p, q, rows, vocab, p_stride, desc, state, draw, u, u_stride, mass, last, n_chunks, out,
                          out_stride, lengths, ROWS=per_program, CHUNK=chunk, NC_PAD=_pow2(n_chunks),
                          DESC=with_desc, SEARCHED=searched is not None,
                          num_warps=DRAW_LAUNCH["accept_walk_warps" if with_desc else "walk_warps"])


def sample_probability_rows(probability_scratch, proposal_uniforms, draft_token_ids, step):
    """``draft_token_ids[:, step]`` = inverse-CDF draw of each f32 ``[B, V]`` row (kernels.md 3.18)."""
    rows, vocab = probability_scratch.shape
    width = draft_token_ids.shape[1]
    if rows:
        draw_rows(probability_scratch, rows, vocab, draft_token_ids[:, step], width, p_stride=vocab,
                  u=proposal_uniforms[:, step], u_stride=width)


# ------------------------------------------------------------------------------ stores and sparse rows


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, V, dst_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = index < V
    values = tl.load(src_ptr + row.to(tl.int64) * V + index, mask=mask)
    tl.store(dst_ptr + row.to(tl.int64) * dst_stride + index, values, mask=mask)


def store_draft_step_probabilities(probability_scratch, draft_probabilities, step):
    """``draft_probabilities[:, step] = probability_scratch`` (f32 ``[B, V]`` into ``[B, P, V]``)."""
    rows, vocab = probability_scratch.shape
    if rows:
        block = 4096
        _copy_rows_kernel[(rows, triton.cdiv(vocab, block))](probability_scratch, draft_probabilities[:, step], vocab,
                                                             draft_probabilities.shape[1] * vocab, BLOCK=block)


@triton.jit
def _merge_stats(m, s, tile_m, tile_s):
    """Online-softmax merge of two ``(max, sum exp(x - max))`` partials."""
    big = tl.maximum(m, tile_m)
    base = tl.where(big > float("-inf"), big, 0.0)
    return big, s * tl.exp(m - base) + tile_s * tl.exp(tile_m - base)


@triton.jit
def _top_k_rows_kernel(values_ptr, K, inv_temp, probs_ptr, probs_stride, ids_ptr, ids_out_ptr, u_ptr, u_stride,
                       tok_ptr, tok_stride, BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
    """Per row: softmax of ``values * inv_temp`` over K (``1/K`` when degenerate) into ``probs``; with
    ``SAMPLE`` also copy the ids and draw one of them (kernels.md 2.4, 3.20, 3.22)."""
    row = tl.program_id(0).to(tl.int64)
    src = values_ptr + row * K
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    start = 0
    while start < K:
        index = start + tl.arange(0, BLOCK)
        tile_m, tile_s = _tile_stats(tl.load(src + index, mask=index < K, other=float("-inf")) * inv_temp, 0)
        m, s = _merge_stats(m, s, tile_m, tile_s)
        start += BLOCK
    degenerate = _degenerate(s)
    if SAMPLE:
        t = _clamp_uniform(tl.load(u_ptr + row * u_stride))
    carry = tl.zeros([], tl.float32)
    hit = tl.full([], _NO_HIT, tl.int32)
    last = tl.full([], -1, tl.int32)
    start = 0
    while start < K:
        index = start + tl.arange(0, BLOCK)
        mask = index < K
        x = tl.load(src + index, mask=mask, other=float("-inf")) * inv_temp
        p = tl.where(degenerate, 1.0 / K, tl.exp(x - m) / tl.maximum(s, _TINY))
        tl.store(probs_ptr + row * probs_stride + index, p, mask=mask)
        if SAMPLE:
            tl.store(ids_out_ptr + row * probs_stride + index, tl.load(ids_ptr + row * K + index, mask=mask), mask=mask)
            w = tl.where(mask, _positive(p), 0.0)
            hit = tl.minimum(hit, _first_hit(w, index, carry, t))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, index, -1), axis=0))
            carry += tl.sum(w, axis=0)
        start += BLOCK
    if SAMPLE:
        k = tl.where(hit == _NO_HIT, tl.maximum(last, 0), hit)  # fallback: last positive, else ids[0]
        tl.store(tok_ptr + row * tok_stride, tl.load(ids_ptr + row * K + k))


def _top_k_rows(values, temperature, probs, probs_stride, sample=None):
    rows, k = values.shape
    if not rows:
        return
    ids, ids_out, u, u_stride, tok, tok_stride = sample if sample is not None else (values, probs, values, 0, probs, 0)
    _top_k_rows_kernel[(rows,)](values, k, _inv_temperature(temperature), probs, probs_stride, ids, ids_out, u,
                                u_stride, tok, tok_stride, BLOCK=min(1024, _pow2(k)), SAMPLE=sample is not None,
                                num_warps=4)


def normalize_top_k_rows(top_k_values, temperature):
    """f32 ``[rows, K]`` softmax of ``top_k_values * invTemp(T)`` (kernels.md 3.20; T < 1e-3: invTemp 1)."""
    probs = torch.empty_like(top_k_values)
    _top_k_rows(top_k_values, temperature, probs, top_k_values.shape[1])
    return probs


def sample_top_k_rows_and_store(top_k_values, top_k_indices, proposal_uniforms, draft_token_ids,
                                draft_top_k_probabilities, draft_top_k_indices, step, temperature):
    """Normalise ``[B, K]`` top-k values, store probabilities and ids at ``step``, draw the token (3.22)."""
    width, k = draft_top_k_probabilities.shape[1:]
    _top_k_rows(top_k_values, temperature, draft_top_k_probabilities[:, step], width * k,
                sample=(top_k_indices, draft_top_k_indices[:, step], proposal_uniforms[:, step], width,
                        draft_token_ids[:, step], width))


# ------------------------------------------------------------------------------ fused Markov sampler


@triton.jit
def _markov_logits_kernel(logits_ptr, w1_ptr, w2_ptr, first_prev_ptr, ids_ptr, ids_stride, step, logits_stride,
                          logits_offset, out_ptr, out_stride, m_ptr, s_ptr, n_stats, group_ptr, n_groups, B, V,
                          inv_temp, R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_R: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          UPCAST: tl.constexpr):
    """``x[b, v] = (backbone[b*L + step + offset, v] + W1[prev_b] . W2[v]) * inv_temp`` for a
    ``[BLOCK_B, BLOCK_V]`` tile: one pass over W2 for the whole batch (a skinny GEMM on tensor cores),
    with the tile's softmax partials as the epilogue and, with ``GROUPS`` (a filtered step), the
    candidates' group maxima too, so the filter starts without another pass over the row."""
    pid_v = tl.program_id(0)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    live_b = b < B
    steps = tl.full([BLOCK_B], step, tl.int32)  # a tensor, so the masks below are tensors too
    first = tl.load(first_prev_ptr + b, mask=live_b & (steps == 0), other=0)
    drafted = tl.load(ids_ptr + b.to(tl.int64) * ids_stride + step - 1, mask=live_b & (steps > 0), other=0)
    prev = tl.minimum(tl.maximum(tl.where(step == 0, first, drafted), 0), V - 1).to(tl.int64)
    v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    live_v = v < V
    acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):  # R is constexpr
        r = r0 + tl.arange(0, BLOCK_R)
        live_r = r < R
        a = tl.load(w1_ptr + prev[:, None] * R + r[None, :], mask=live_b[:, None] & live_r[None, :], other=0.0)
        w = tl.load(w2_ptr + v.to(tl.int64)[:, None] * R + r[None, :], mask=live_v[:, None] & live_r[None, :],
                    other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    rows = b.to(tl.int64) * logits_stride + step + logits_offset
    live = live_b[:, None] & live_v[None, :]
    base = tl.load(logits_ptr + rows[:, None] * V + v[None, :], mask=live, other=float("-inf"))
    x = (base + acc) * inv_temp
    tl.store(out_ptr + b.to(tl.int64)[:, None] * out_stride + v[None, :], x, mask=live)
    m, s = _tile_stats(tl.where(live_v[None, :], x, float("-inf")), 1)
    tl.store(m_ptr + b * n_stats + pid_v, m, mask=live_b)
    tl.store(s_ptr + b * n_stats + pid_v, s, mask=live_b)
    if GROUPS:
        keys = tl.where(live, _order_key(x, v[None, :]), _SENTINEL)
        best = tl.max(tl.reshape(keys, [BLOCK_B, BLOCK_V // GROUP_SIZE, GROUP_SIZE]), axis=2)
        g = pid_v * (BLOCK_V // GROUP_SIZE) + tl.arange(0, BLOCK_V // GROUP_SIZE)
        tl.store(group_ptr + b.to(tl.int64)[:, None] * n_groups + g[None, :], best,
                 mask=live_b[:, None] & (g < n_groups)[None, :])


def markov_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, draft_token_ids,
                       draft_probabilities, step, temperature, top_k, top_p, logits_stride, logits_offset):
    """One sampled Markov step (3.12): Markov GEMM -> filter -> probabilities -> draw, fused.

    Writes ``draft_probabilities[:, step]`` (used as the logits' scratch first, so no other buffer is
    needed) and ``draft_token_ids[:, step]``. No host synchronisation and, once the workspace exists,
    no allocation: a whole round can be captured in a CUDA graph. Unfiltered: two launches.
    """
    batch, width = draft_token_ids.shape
    vocab, rank = markov_w1.shape
    if not batch:
        return
    inv_temp, k, p = _filters(temperature, top_k, top_p, vocab)
    filtered = k > 0 or p < 1.0
    out = draft_probabilities[:, step]
    out_stride = width * vocab
    block_b = min(64, max(16, _pow2(batch)))
    block_v = 256 if block_b <= 32 else 128
    n_stats = triton.cdiv(vocab, block_v)
    n_groups = triton.cdiv(vocab, GROUP)
    m = _workspace("markov_m", batch * n_stats, torch.float32, out.device)
    s = _workspace("markov_s", batch * n_stats, torch.float32, out.device)
    groups = _workspace("markov_groups", batch * n_groups if filtered else 1, torch.int64, out.device)
    _markov_logits_kernel[(n_stats, triton.cdiv(batch, block_b))](
        backbone_logits, markov_w1, markov_w2, first_prev_tokens, draft_token_ids, width, step, logits_stride,
        logits_offset, out, out_stride, m, s, n_stats, groups, n_groups, batch, vocab, inv_temp, R=rank,
        BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=min(64, max(16, _pow2(rank))), GROUPS=filtered, GROUP_SIZE=GROUP,
        UPCAST=_UPCAST_DOT, num_warps=8 if block_b == 64 else 4, num_stages=3)
    _probabilities(out, out_stride, out, out_stride, batch, vocab, 1.0, k, p, stats=(m, s, n_stats, block_v),
                   groups=groups if filtered else None,
                   sample=(proposal_uniforms[:, step], width, draft_token_ids[:, step], width))


def vanilla_markov_sample(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, temperature,
                          top_k, top_p, logits_stride, logits_offset):
    """``markov_sample_step`` for steps 0..P-1; returns ``(draft_token_ids int32 [B, P],
    draft_probabilities f32 [B, P, V])``."""
    batch, width = proposal_uniforms.shape
    device = proposal_uniforms.device
    draft_token_ids = torch.zeros(batch, width, dtype=torch.int32, device=device)
    draft_probabilities = torch.empty(batch, width, markov_w1.shape[0], dtype=torch.float32, device=device)
    for step in range(width):
        markov_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, draft_token_ids,
                           draft_probabilities, step, temperature, top_k, top_p, logits_stride, logits_offset)
    return draft_token_ids, draft_probabilities
