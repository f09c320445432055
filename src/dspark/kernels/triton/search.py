"""Triton filter, part 2: the value-space search that cuts a row the candidates cannot decide.

Contract: ``dspark.kernels.logits_to_probabilities`` (kernels.md 3.9); the filter (``filter.py``) hands
over rows whose nucleus is wider than its candidates (top-p alone on a flat row) or whose ``top_k``
exceeds ``MAX_CANDIDATES``, at state 2 with a search state: an ord interval that holds the cut, the
weight above it and a bound of the entries inside. Multi-program passes count the weight at or
above ``NPROBE`` probes of the interval per (row, chunk) and narrow it, ``SEARCH_PASSES`` times; the
remaining interval's entries (at most ``BUCKET``) are gathered and one program per row finishes the
cut exactly (sorted, so sums do not depend on gather order), continuing the passes itself if the
interval is still too wide. Rows finished here are left at state 3 (drawn after the write).

``request.py`` (``request_probabilities``) runs the same passes (``narrow``) and row cut
(``cut_interval``) for its top-k (by count) and standard nucleus (by mass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import next_pow2
from ._shared import CANDIDATE_LIMIT, INTERPRET, MAX_KEY, SENTINEL, TINY, key_value, ord_image, ord_value, order_key
from ._shared import row_filter, row_inv_temp

NPROBE = 16  # thresholds tested per pass of the search
SEARCH_PASSES = 3  # multi-program probe passes before one program per row takes over (flat rows need 2)
_BY_EXTRACTION = tl.constexpr(INTERPRET)  # see _sorted_descending


@triton.jit
def _sorted_descending(keys, N: tl.constexpr):
    """The ``N`` distinct int64 ``keys`` (``SENTINEL`` padding last) in descending order.

    Triton's bitonic ``tl.sort`` on the GPU. The CPU interpreter runs that network's reductions element
    by element in Python (seconds per row), so there the same order comes from ``N`` max-extractions.
    """
    if _BY_EXTRACTION:
        j = tl.arange(0, N)
        out = tl.full([N], SENTINEL, tl.int64)
        for i in tl.static_range(N):
            best = tl.max(keys, axis=0)
            out = tl.where(j == i, best, out)
            keys = tl.where(keys == best, SENTINEL, keys)
        return out
    else:
        return tl.sort(keys, descending=True)


@triton.jit
def store_cut_state(cut, above_mass, above_count, count, target):
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
    lo_v = ord_value(olo)
    width = ord_value(ohi) - lo_v
    by_value = ord_image(lo_v + width * (d.to(tl.float32) / (NPROBE_ - 1)))
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
    key = order_key(x, index)
    return index, mask & (key >= floor), x, ord_image(x), key


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
def _narrow(probes, mass_d, count_d, target, olo, ohi, above_mass, above_count, by_count, NPROBE_: tl.constexpr):
    """The probe interval holding the cut (weights: counts where ``by_count``, else masses): new
    ``(olo, ohi, above_mass, above_count, count)``."""
    d = tl.arange(0, NPROBE_)
    weight = tl.where(by_count, count_d, mass_d)
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
def _cut_finish(keys, x0, target, above_mass, by_count, BUCKET: tl.constexpr):
    """The cut among the gathered ``keys`` (``[BUCKET]``, ``SENTINEL`` = absent): the largest key whose
    at-or-above weight reaches ``target`` (the smallest key when none does). Sorted first, so the
    sums do not depend on the order the keys were gathered in. Returns ``(kappa, mass above, at)``."""
    keys = _sorted_descending(keys, BUCKET)
    valid = keys != SENTINEL
    e = tl.where(valid, tl.exp(key_value(keys) - x0), 0.0)
    mass = tl.cumsum(e, axis=0)
    reach = tl.where(by_count, tl.cumsum(valid.to(tl.float32), axis=0), mass)
    j = tl.arange(0, BUCKET)
    first = tl.min(tl.where(valid & (reach >= target), j, BUCKET), axis=0)
    pick = j == tl.minimum(first, tl.sum(valid.to(tl.int32), axis=0) - 1)
    kappa = tl.where(tl.sum(pick.to(tl.int32), axis=0) > 0, tl.sum(tl.where(pick, keys, 0), axis=0), MAX_KEY)
    return kappa, above_mass + tl.sum(tl.where(pick, mass - e, 0.0), axis=0), tl.sum(tl.where(pick, e, 0.0), axis=0)


@triton.jit
def cut_interval(x_row, V, inv_temp, x0, target, floor, bucket_row, olo, ohi, above_mass, above_count, count,
                 gathered, by_count, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr):
    """The largest key ``kappa`` of a row whose at-or-above weight reaches ``target`` (weights: 1 per
    entry where ``by_count``, else ``exp(x - x0)``; only keys >= ``floor`` count).

    Starts from the search state ``[olo, ohi]`` (ord interval holding the cut; ``above_*`` = weight
    above it; ``count`` = an upper bound of the entries inside, or with ``gathered`` the number the
    gather put in the bucket: past them it holds an earlier call's keys). This program narrows it with
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
                                                           above_count, by_count, NPROBE_)
        gathered = gathered * 0
    above = tl.where(by_count, above_count, above_mass)
    slack = tl.where(by_count, 0.0, TINY)
    if count <= BUCKET:
        filled = count.to(tl.int32)
        if gathered == 0:
            tl.debug_barrier()
            filled = _gather(x_row, zero, V, V, inv_temp, floor, olo, ohi, bucket_row, zero, TILE)
        tl.debug_barrier()
        jb = tl.arange(0, BUCKET)
        keys = tl.load(bucket_row + jb, mask=jb < filled, other=SENTINEL)
        kappa, mass_above, at = _cut_finish(keys, x0, target - slack - above, above_mass, by_count, BUCKET)
    else:
        # More than BUCKET entries share one value: they rank by index, each with the same weight.
        at = tl.exp(ord_value(olo) - x0)
        unit = tl.where(by_count, 1.0, at)
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
def _probe_kernel(x_ptr, x_stride, V, inv_temp, settings_ptr, par_ptr, state_ptr, bounds_ptr, cut_ptr, part_ptr,
                  n_chunks, CHUNK: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr,
                  PER_ROW: tl.constexpr):
    """Per (row, chunk) of rows still searching: the chunk's weight and count at or above each probe."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    searching, olo, ohi = _searching(state_ptr, bounds_ptr, cut_ptr, row, BUCKET)
    if searching:
        row_temp = row_inv_temp(row, inv_temp, settings_ptr, PER_ROW)
        start = chunk * CHUNK
        mass_d, count_d = _probe_sums(x_ptr + row.to(tl.int64) * x_stride, start, start + CHUNK, V, row_temp,
                                      tl.load(par_ptr + row * 3), SENTINEL, _probes(olo, ohi, NPROBE_),
                                      TILE, NPROBE_)
        slot = part_ptr + (row * n_chunks + chunk).to(tl.int64) * (2 * NPROBE_) + tl.arange(0, NPROBE_)
        tl.store(slot, mass_d)
        tl.store(slot + NPROBE_, count_d)


@triton.jit
def _narrow_kernel(state_ptr, bounds_ptr, cut_ptr, part_ptr, n_chunks, top_k, settings_ptr, NC_PAD: tl.constexpr,
                   BUCKET: tl.constexpr, NPROBE_: tl.constexpr, PER_ROW: tl.constexpr):
    """Per row still searching: sum the chunks' probe partials and keep the probe interval holding the
    cut (by count for ``top_k > MAX_CANDIDATES``, else by mass)."""
    row = tl.program_id(0)
    searching, olo, ohi = _searching(state_ptr, bounds_ptr, cut_ptr, row, BUCKET)
    if searching:
        _row_temp, row_k, _row_p = row_filter(row, 1.0, top_k, 1.0, settings_ptr, PER_ROW)
        c = tl.arange(0, NC_PAD)[:, None]
        slot = part_ptr + (row * n_chunks + c).to(tl.int64) * (2 * NPROBE_) + tl.arange(0, NPROBE_)[None, :]
        mass_d = tl.sum(tl.load(slot, mask=c < n_chunks, other=0.0), axis=0)
        count_d = tl.sum(tl.load(slot + NPROBE_, mask=c < n_chunks, other=0.0), axis=0)
        cut = cut_ptr + row * 4
        olo, ohi, above_mass, above_count, count = _narrow(_probes(olo, ohi, NPROBE_), mass_d, count_d,
                                                           tl.load(cut + 3), olo, ohi, tl.load(cut),
                                                           tl.load(cut + 1), row_k > CANDIDATE_LIMIT, NPROBE_)
        tl.store(bounds_ptr + row * 2, olo)
        tl.store(bounds_ptr + row * 2 + 1, ohi)
        store_cut_state(cut, above_mass, above_count, count, tl.load(cut + 3))


@triton.jit
def _gather_kernel(x_ptr, x_stride, V, inv_temp, settings_ptr, state_ptr, bounds_ptr, cut_ptr, fill_ptr, bucket_ptr,
                   CHUNK: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr, PER_ROW: tl.constexpr):
    """Per (row, chunk) of rows whose interval holds at most ``BUCKET`` entries: append them to the
    row's bucket (space reserved with one atomic per chunk; ``_cut_finish`` sorts the bucket)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    olo = tl.load(bounds_ptr + row * 2)
    ohi = tl.load(bounds_ptr + row * 2 + 1)
    if (tl.load(state_ptr + row) == 2) & (tl.load(cut_ptr + row * 4 + 2) <= BUCKET):
        row_temp = row_inv_temp(row, inv_temp, settings_ptr, PER_ROW)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        start = chunk * CHUNK
        n = tl.zeros([], tl.int32)
        at = start
        while at < start + CHUNK:
            _, valid, _, o, _ = _row_entry(x_row, at, V, row_temp, SENTINEL, TILE)
            n += tl.sum((valid & (o >= olo) & (o <= ohi)).to(tl.int32), axis=0)
            at += TILE
        if n > 0:
            base = tl.atomic_add(fill_ptr + row, n)
            _gather(x_row, start, start + CHUNK, V, row_temp, SENTINEL, olo, ohi,
                    bucket_ptr + row.to(tl.int64) * BUCKET, base, TILE)


@triton.jit
def _search_kernel(x_ptr, x_stride, V, inv_temp, top_k, top_p, settings_ptr, par_ptr, kappa_ptr, state_ptr,
                   bounds_ptr, cut_ptr, fill_ptr, bucket_ptr, TILE: tl.constexpr, BUCKET: tl.constexpr,
                   NPROBE_: tl.constexpr, PER_ROW: tl.constexpr):
    """Rows left at state 2 by ``_select_kernel``: finish the k-th key (``top_k > MAX_CANDIDATES``) and/or
    the nucleus cut from the search state the multi-program passes left; state 3 marks them (drawn
    after the write)."""
    row = tl.program_id(0)
    if tl.load(state_ptr + row) == 2:
        row_temp, row_k, row_p = row_filter(row, inv_temp, top_k, top_p, settings_ptr, PER_ROW)
        big_k = row_k > CANDIDATE_LIMIT
        x_row = x_ptr + row.to(tl.int64) * x_stride
        bucket_row = bucket_ptr + row.to(tl.int64) * BUCKET
        x0 = tl.load(par_ptr + row * 3)
        cut = cut_ptr + row * 4
        count = tl.load(cut + 2)
        gathered = (count <= BUCKET).to(tl.int32)
        # gathered: what the gather found (the start state's count only bounds it where no pass narrowed it)
        count = tl.where(gathered > 0, tl.load(fill_ptr + row).to(tl.float32), count)
        kappa, above, at = cut_interval(x_row, V, row_temp, x0, tl.load(cut + 3), tl.full([], SENTINEL, tl.int64),
                                        bucket_row, tl.load(bounds_ptr + row * 2), tl.load(bounds_ptr + row * 2 + 1),
                                        tl.load(cut), tl.load(cut + 1), count, gathered, big_k, TILE, BUCKET, NPROBE_)
        if big_k:
            kept = above + at
            a_cut = at
            if row_p < 1.0:
                denom = tl.maximum(row_p * kept, TINY)
                olo = tl.maximum(ord_image(x0 - 88.0), (kappa >> 32).to(tl.int32))
                nothing = tl.zeros([], tl.float32)  # a fresh search state (tensors: loop-carried in cut_interval)
                kappa, above, at = cut_interval(x_row, V, row_temp, x0, denom, kappa, bucket_row, olo, ord_image(x0),
                                                nothing, nothing, nothing + V, gathered * 0, big_k != big_k, TILE,
                                                BUCKET, NPROBE_)
                a_cut = tl.minimum(at, tl.maximum(denom - above, 0.0))
            else:
                denom = tl.maximum(kept, TINY)
        else:
            denom = tl.load(par_ptr + row * 3 + 1)
            a_cut = tl.minimum(at, tl.maximum(denom - above, 0.0))
        tl.store(par_ptr + row * 3 + 1, denom)
        tl.store(par_ptr + row * 3 + 2, a_cut)
        tl.store(kappa_ptr + row, kappa)
        tl.store(state_ptr + row, 3)


def bucket_size(vocab: int) -> int:
    """Entries the search gathers and sorts at the end (smaller for small vocabularies)."""
    return min(1024, max(64, next_pow2(vocab) // 8))


def plan(rows: int, vocab: int, n_chunks: int) -> dict:
    """Scratch of ``search``: the chunks' probe partials and the rows' gather buckets."""
    return {"probe_partials": (rows * n_chunks * 2 * NPROBE, torch.float32),
            "bucket": (rows * bucket_size(vocab), torch.int64)}


def narrow(x, x_stride, rows, vocab, inv_temp, k, settings, per_row, chunk, n_chunks, state, buf):
    """The multi-program part of the search, for every row at state 2: ``SEARCH_PASSES`` probe passes
    narrowing the row's interval (by count where the row's ``k > MAX_CANDIDATES``, else by mass, towards
    ``cut[row, 3]``; ``x0 = par[row, 0]``), then the gather of the rows whose interval holds at most
    ``bucket_size(vocab)`` entries (``fill`` zero before). ``(inv_temp, k)``, or each row's from
    ``settings`` (``per_row``), as the filter's; ``buf``: ``par``, ``bounds``, ``cut``, ``fill`` and
    this ``plan``'s buffers. A row program finishes the cut from there (``cut_interval``)."""
    bucket = bucket_size(vocab)
    tile = min(256, chunk)
    par, bounds, cut, fill = (buf[name] for name in ("par", "bounds", "cut", "fill"))
    part, scratch = buf["probe_partials"], buf["bucket"]
    for _ in range(SEARCH_PASSES):
        _probe_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, settings, par, state, bounds, cut, part,
                                        n_chunks, CHUNK=chunk, TILE=tile, BUCKET=bucket, NPROBE_=NPROBE,
                                        PER_ROW=per_row, num_warps=4)
        _narrow_kernel[(rows,)](state, bounds, cut, part, n_chunks, k, settings, NC_PAD=next_pow2(n_chunks),
                                BUCKET=bucket, NPROBE_=NPROBE, PER_ROW=per_row, num_warps=4)
    _gather_kernel[(rows, n_chunks)](x, x_stride, vocab, inv_temp, settings, state, bounds, cut, fill, scratch,
                                     CHUNK=chunk, TILE=tile, BUCKET=bucket, PER_ROW=per_row, num_warps=4)


def search(x, x_stride, rows, vocab, inv_temp, k, p, settings, per_row, chunk, n_chunks, state, buf):
    """Cut the rows at state 2 (-> 3): ``narrow``'s multi-program passes and gather, then one program
    per row. A row with ``top_k > MAX_CANDIDATES`` finds the k-th entry first (a nucleus cut inside it
    is left to the row program). ``(inv_temp, k, p)``, or each row's from ``settings`` (``per_row``),
    as the filter's. ``buf``: the filter's row state (``par``, ``kappa``, ``bounds``, ``cut``,
    ``fill``) and this ``plan``'s buffers."""
    narrow(x, x_stride, rows, vocab, inv_temp, k, settings, per_row, chunk, n_chunks, state, buf)
    _search_kernel[(rows,)](x, x_stride, vocab, inv_temp, k, p, settings, buf["par"], buf["kappa"], state,
                            buf["bounds"], buf["cut"], buf["fill"], buf["bucket"], TILE=min(256, chunk),
                            BUCKET=bucket_size(vocab), NPROBE_=NPROBE, PER_ROW=per_row, num_warps=8)
