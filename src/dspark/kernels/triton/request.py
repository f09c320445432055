"""Triton request filters: vLLM's temperature, min_p, top-k and top-p per row without sorting a row
(contract: ``dspark.kernels.request_probabilities``).

A fixed sequence of launches serves rows of any settings (one CUDA graph); the passes over the
vocabulary are (row, chunk) programs, the steps between them one program per row, and a row that a
step does not concern leaves its programs at once:

1. ``_scale_kernel``: ``x = (logits + bias) / T`` (a greedy row's T is 1) written to the output --
   the later passes read it there; a greedy row's is not written: its one-hot needs only the argmax --
   and per chunk the softmax partials, the smallest finite ``x``, the finite count and the largest
   filter key (``order_key``: value, then the lower index); for a top-k or top-p row also the
   largest key of every ``filter.GROUP`` entries.
2. ``_setup_kernel``: the row's max ``x0``, normaliser, argmax and state; a top-k row's count search
   starts from [smallest finite, x0], which holds its k-th entry.
3. top-k: ``_candidates_kernel`` -- the row's ``MAX_CANDIDATES`` largest entries, exactly, from the
   group maxima (``filter.top_candidates``: a few thousand keys read, no pass over the row) -- gives
   the k-th key of a k among them; a larger k is searched: ``search.narrow`` by count, then
   ``_finish_kernel``. The kept entries are the keys at or above the row's *floor*: the lowest key
   of the k-th value (ties with it kept), or min_p's ``x0 + log(min_p)`` where higher (min_p keeps a
   set of the largest values, so applying it first, as vLLM, or after top-k keeps the same entries).
4. ``_mass_kernel``: the mass ``exp(x - x0)`` and count of the entries at or above a floor.
5. ``_nucleus_kernel``: a row without top-p is done (its normaliser is that mass); a top-p row
   starts the mass search for ``top_p`` of its kept mass ``S`` over its ``n`` kept entries, from
   ``x0 + log((1 - top_p) S / n)`` (less 0.01 and two ulps for rounding; the floor where higher):
   the entries below it hold less than ``(1 - top_p) S`` together, so none of them is kept.
6. top-p: the cut is the largest key whose mass at or above it reaches ``top_p * S`` -- the entries
   ranked above it hold less, so it is the last kept one (the standard nucleus; ties rank by the
   lower index) -- found among the candidates (``_candidates_kernel``, their masses summed in rank
   order) where they hold it, as on LLM rows; else by ``search.narrow`` by mass, then
   ``_finish_kernel``; and the kept mass.
7. ``_write_kernel``: ``exp(x - x0) / mass`` at the keys at or above the cut, in place; a greedy
   row's one-hot; NaN for a row without a finite maximum.

Every launch runs whatever the rows: a row the candidates decided leaves the search's programs at once.

Row states: ``DONE`` (to write), ``GREEDY``, ``SEARCHING`` (in the current search: ``search.py``'s
state 2), ``NUCLEUS`` (top-p without a floor: waits for step 5), ``MASS`` (waits for step 4),
``INVALID``. Per row the workspace holds ``par = (x0, normaliser, finite count)``, ``kappa`` (the
floor or cut key; a greedy row's argmax) and ``search.py``'s search state (``bounds``, ``cut``, ``fill``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import GREEDY_TEMPERATURE as _GREEDY_TEMPERATURE
from .._shared import next_pow2
from . import search as tsearch
from ._shared import MAX_CANDIDATES, SENTINEL, TINY, claim, is_degenerate, key_index, key_value, merge, ord_image
from ._shared import order_key, row_chunk, tile_stats
from .filter import GROUP, _candidate_slots, combine_stats, top_candidates
from .search import NPROBE, cut_interval, store_cut_state

__all__ = ["request_probabilities"]

GREEDY_TEMPERATURE = tl.constexpr(_GREEDY_TEMPERATURE)
DONE = tl.constexpr(0)
GREEDY = tl.constexpr(1)
SEARCHING = tl.constexpr(2)  # search.py's state of the rows its passes narrow
NUCLEUS = tl.constexpr(3)
MASS = tl.constexpr(4)
INVALID = tl.constexpr(5)
BY_COUNT = MAX_CANDIDATES + 1  # a k past the filter's candidates: search.narrow narrows by count
CANDIDATE_SLOTS = _candidate_slots(MAX_CANDIDATES)  # a row's candidates hold its MAX_CANDIDATES largest entries


# ------------------------------------------------------------------------------ device helpers


@triton.jit
def _settings(row, per, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr):
    """Row ``row``'s ``(temperature, top_k, top_p, min_p, greedy)`` from setting ``row // per``; a
    greedy row (``T < GREEDY_TEMPERATURE`` or ``top_k == 1``) gets temperature 1."""
    s = row // per
    t = tl.load(temp_ptr + s)
    k = tl.load(top_k_ptr + s).to(tl.int64)
    greedy = (t < GREEDY_TEMPERATURE) | (k == 1)
    return tl.where(greedy, 1.0, t), k, tl.load(top_p_ptr + s), tl.load(min_p_ptr + s), greedy


@triton.jit
def _min_p_floor(x0, min_p):
    """The lowest key of min_p's kept entries, ``x >= x0 + log(min_p)`` (``SENTINEL``: min_p off)."""
    return tl.where(min_p > 0.0, ord_image(x0 + tl.log(min_p)).to(tl.int64) << 32, SENTINEL)


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _scale_kernel(logits_ptr, bias_ptr, out_ptr, V, per, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, max_ptr, sum_ptr,
                  low_ptr, finite_ptr, best_ptr, group_ptr, n_chunks, n_groups, CHUNK: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Per (row, chunk): ``x = (logits + bias) / T`` (IEEE add and division, as torch; ``HAS_BIAS``:
    row ``row // per`` of ``bias``) into ``out`` -- not for a greedy row, whose one-hot needs only its
    argmax; the chunk's max, ``sum exp(x - max)``, smallest finite ``x`` (+inf: none), finite count
    and largest key; for a top-k or top-p row, the largest key of every ``GROUP_SIZE`` entries (the
    candidates' first stage)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t, k, top_p, _min_p, greedy = _settings(row, per, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    offset = row.to(tl.int64) * V + index
    x = tl.load(logits_ptr + offset, mask=mask, other=float("-inf"))
    if HAS_BIAS:
        x += tl.load(bias_ptr + (row // per).to(tl.int64) * V + index, mask=mask, other=0.0)
    x = tl.div_rn(x, t)
    tl.store(out_ptr + offset, x, mask=index < tl.where(greedy, 0, V))  # a greedy row: none
    m, s = tile_stats(x, 0)
    finite = mask & (x > float("-inf")) & (x < float("inf"))
    slot = row * n_chunks + chunk
    tl.store(max_ptr + slot, m)
    tl.store(sum_ptr + slot, s)
    tl.store(low_ptr + slot, tl.min(tl.where(finite, x, float("inf")), axis=0))
    tl.store(finite_ptr + slot, tl.sum(finite.to(tl.float32), axis=0))
    keys = tl.where(mask, order_key(x, index), SENTINEL)
    tl.store(best_ptr + slot, tl.max(keys, axis=0))
    searched = ((k > 1) & (k < V)) | (top_p < 1.0)
    group = chunk * (CHUNK // GROUP_SIZE) + tl.arange(0, CHUNK // GROUP_SIZE)
    tl.store(group_ptr + row.to(tl.int64) * n_groups + group, tl.max(tl.reshape(keys, [CHUNK // GROUP_SIZE, GROUP_SIZE]), axis=1),
             mask=group < tl.where(greedy, 0, tl.where(searched, n_groups, 0)))


@triton.jit
def _setup_kernel(per, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, max_ptr, sum_ptr, low_ptr, finite_ptr, best_ptr,
                  n_chunks, par_ptr, kappa_ptr, state_ptr, bounds_ptr, cut_ptr, fill_ptr, NC_PAD: tl.constexpr):
    """Per row: combine the chunk partials; the row's state, ``par``, ``kappa`` (argmax, or min_p's
    floor) and a top-k row's count search (``k < finite count``; else top-k keeps every entry)."""
    row = tl.program_id(0)
    _t, k, top_p, min_p, greedy = _settings(row, per, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    j = tl.arange(0, NC_PAD)
    live = j < n_chunks
    slot = row * n_chunks + j
    x0, total = combine_stats(tl.load(max_ptr + slot, mask=live, other=float("-inf")),
                              tl.load(sum_ptr + slot, mask=live, other=0.0))
    low = tl.min(tl.load(low_ptr + slot, mask=live, other=float("inf")), axis=0)
    finite = tl.sum(tl.load(finite_ptr + slot, mask=live, other=0.0), axis=0)
    best = tl.max(tl.load(best_ptr + slot, mask=live, other=SENTINEL), axis=0)
    invalid = ~((x0 > float("-inf")) & (x0 < float("inf"))) | is_degenerate(total)
    top_k = (k > 1) & (k.to(tl.float32) < finite)
    state = tl.where(top_k, SEARCHING, tl.where(min_p > 0.0, MASS, tl.where(top_p < 1.0, NUCLEUS, DONE)))
    state = tl.where(greedy, GREEDY, tl.where(invalid, INVALID, state))
    tl.store(state_ptr + row, state)
    tl.store(kappa_ptr + row, tl.where(greedy, key_index(best).to(tl.int64), _min_p_floor(x0, min_p)))
    tl.store(par_ptr + row * 3, x0)
    tl.store(par_ptr + row * 3 + 1, total)
    tl.store(par_ptr + row * 3 + 2, finite)
    tl.store(bounds_ptr + row * 2, ord_image(low))
    tl.store(bounds_ptr + row * 2 + 1, ord_image(x0))
    store_cut_state(cut_ptr + row * 4, 0.0, 0.0, finite, k.to(tl.float32))
    tl.store(fill_ptr + row, 0)


@triton.jit
def _finish_kernel(x_ptr, V, per, min_p_ptr, par_ptr, kappa_ptr, state_ptr, bounds_ptr, cut_ptr, fill_ptr, bucket_ptr,
                   TOP_K: tl.constexpr, TILE: tl.constexpr, BUCKET: tl.constexpr, NPROBE_: tl.constexpr):
    """Per row still ``SEARCHING`` after ``search.narrow``: ``cut_interval`` finishes the cut. ``TOP_K``:
    the k-th key by count gives the floor (its value's lowest key, or min_p's where higher) -> ``MASS``;
    else the nucleus cut by mass gives ``kappa`` and the kept mass -> ``DONE``."""
    row = tl.program_id(0)
    if tl.load(state_ptr + row) == SEARCHING:
        x0 = tl.load(par_ptr + row * 3)
        cut = cut_ptr + row * 4
        count = tl.load(cut + 2)
        gathered = count <= BUCKET
        # gathered: the entries the gather found (a nucleus start's count only bounds them; the bucket
        # past them holds an earlier call's keys)
        count = tl.where(gathered, tl.load(fill_ptr + row).to(tl.float32), count)
        by_count = (tl.zeros([], tl.int32) + TOP_K) > 0  # a tensor: cut_interval selects with it
        kappa, above, at = cut_interval(x_ptr + row.to(tl.int64) * V, V, 1.0, x0, tl.load(cut + 3),
                                        tl.full([], SENTINEL, tl.int64), bucket_ptr + row.to(tl.int64) * BUCKET,
                                        tl.load(bounds_ptr + row * 2), tl.load(bounds_ptr + row * 2 + 1),
                                        tl.load(cut), tl.load(cut + 1), count, gathered.to(tl.int32), by_count,
                                        TILE, BUCKET, NPROBE_)
        if TOP_K:
            floor = tl.maximum((kappa >> 32) << 32, _min_p_floor(x0, tl.load(min_p_ptr + row // per)))
            tl.store(kappa_ptr + row, floor)
            tl.store(state_ptr + row, MASS)
        else:
            tl.store(par_ptr + row * 3 + 1, above + at)
            tl.store(kappa_ptr + row, kappa)
            tl.store(state_ptr + row, DONE)


@triton.jit
def _candidates_kernel(x_ptr, V, per, top_k_ptr, min_p_ptr, par_ptr, kappa_ptr, state_ptr, cut_ptr, group_ptr,
                       n_groups, scratch_ptr, TOP_K: tl.constexpr, NG_PAD: tl.constexpr, KT: tl.constexpr,
                       GROUP_SIZE: tl.constexpr, NPROBE_: tl.constexpr):
    """Per row ``SEARCHING``: its ``KT // 2`` largest entries from the scale pass's group maxima
    (``filter.top_candidates``), which decide most rows without a search. ``TOP_K``: a k among them
    gives the k-th key and the floor as ``_finish_kernel`` does -> ``MASS``. Else the nucleus: the
    largest kept key (at or above ``kappa``, the floor) whose at-or-above mass reaches ``top_p * S``
    (``cut[row, 3]``), when one of them does, and that mass -> ``DONE``. Rows not decided stay
    ``SEARCHING`` with their search state."""
    row = tl.program_id(0)
    if tl.load(state_ptr + row) == SEARCHING:
        g = tl.arange(0, NG_PAD)
        group_keys = tl.load(group_ptr + row.to(tl.int64) * n_groups + g, mask=g < n_groups, other=SENTINEL)
        take = tl.minimum(KT // 2, V)
        x_row = x_ptr + row.to(tl.int64) * V
        top = top_candidates(x_row, x_row, V, 1.0, group_keys, n_groups, take,
                             scratch_ptr + row.to(tl.int64) * KT, KT, GROUP_SIZE, NPROBE_, False)
        rank = tl.arange(0, KT)
        exact = (top != SENTINEL) & (rank < take)  # the take largest keys, descending
        x0 = tl.load(par_ptr + row * 3)
        if TOP_K:
            k = tl.load(top_k_ptr + row // per).to(tl.int32)
            if k <= take:
                kth = tl.max(tl.where(exact & (rank == k - 1), top, SENTINEL), axis=0)
                floor = tl.maximum((kth >> 32) << 32, _min_p_floor(x0, tl.load(min_p_ptr + row // per)))
                tl.store(kappa_ptr + row, floor)
                tl.store(state_ptr + row, MASS)
        else:
            kept = exact & (top >= tl.load(kappa_ptr + row))
            e = tl.where(kept, tl.exp(key_value(top) - x0), 0.0)
            reach = tl.cumsum(e, axis=0)  # mass at or above
            hit = kept & (reach >= tl.load(cut_ptr + row * 4 + 3) - TINY)
            if tl.sum(hit.to(tl.int32), axis=0) > 0:
                kappa = tl.max(tl.where(hit, top, SENTINEL), axis=0)
                tl.store(par_ptr + row * 3 + 1, tl.sum(tl.where(top == kappa, reach, 0.0), axis=0))
                tl.store(kappa_ptr + row, kappa)
                tl.store(state_ptr + row, DONE)


@triton.jit
def _mass_kernel(x_ptr, V, par_ptr, kappa_ptr, state_ptr, mass_ptr, count_ptr, n_chunks, CHUNK: tl.constexpr):
    """Per (row, chunk) of ``MASS`` rows: the mass ``exp(x - x0)`` and count of the keys at or above the floor."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(state_ptr + row) == MASS:
        index = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = index < V
        x = tl.load(x_ptr + row.to(tl.int64) * V + index, mask=mask, other=float("-inf"))
        kept = mask & (order_key(x, index) >= tl.load(kappa_ptr + row))
        slot = row * n_chunks + chunk
        tl.store(mass_ptr + slot, tl.sum(tl.where(kept, tl.exp(x - tl.load(par_ptr + row * 3)), 0.0), axis=0))
        tl.store(count_ptr + slot, tl.sum(kept.to(tl.float32), axis=0))


@triton.jit
def _nucleus_kernel(per, top_p_ptr, par_ptr, kappa_ptr, state_ptr, bounds_ptr, cut_ptr, fill_ptr, mass_ptr, count_ptr,
                    n_chunks, NC_PAD: tl.constexpr):
    """Per ``MASS`` / ``NUCLEUS`` row: the kept mass ``S`` and count ``n`` (the floor's, or the whole
    row's); without top-p the row is ``DONE`` with normaliser ``S``, else it starts the mass search
    for ``top_p * S`` (module docstring, step 5). Every row's gather fill is reset."""
    row = tl.program_id(0)
    tl.store(fill_ptr + row, 0)
    state = tl.load(state_ptr + row)
    if (state == MASS) | (state == NUCLEUS):
        j = tl.arange(0, NC_PAD)
        live = j < n_chunks
        slot = row * n_chunks + j
        x0 = tl.load(par_ptr + row * 3)
        floored = state == MASS
        kept = tl.where(floored, tl.sum(tl.load(mass_ptr + slot, mask=live, other=0.0), axis=0),
                        tl.load(par_ptr + row * 3 + 1))
        n = tl.where(floored, tl.sum(tl.load(count_ptr + slot, mask=live, other=0.0), axis=0),
                     tl.load(par_ptr + row * 3 + 2))
        top_p = tl.load(top_p_ptr + row // per)
        if top_p < 1.0:
            start = ord_image(x0 + tl.maximum(tl.log((1.0 - top_p) * kept / n) - 0.01, -88.0)) - 2
            floor = (tl.load(kappa_ptr + row) >> 32).to(tl.int32)
            tl.store(bounds_ptr + row * 2, tl.where(floored, tl.maximum(floor, start), start))
            tl.store(bounds_ptr + row * 2 + 1, ord_image(x0))
            store_cut_state(cut_ptr + row * 4, 0.0, 0.0, n, top_p * kept)
            tl.store(state_ptr + row, SEARCHING)
        else:
            tl.store(par_ptr + row * 3 + 1, kept)
            tl.store(state_ptr + row, DONE)


@triton.jit
def _write_kernel(out_ptr, V, par_ptr, kappa_ptr, state_ptr, CHUNK: tl.constexpr):
    """Per (row, chunk): the probabilities, in place over ``x``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = index < V
    offset = row.to(tl.int64) * V + index
    state = tl.load(state_ptr + row)
    kappa = tl.load(kappa_ptr + row)
    if state == GREEDY:
        p = tl.where(index == kappa, 1.0, 0.0)
    else:
        x = tl.load(out_ptr + offset, mask=mask, other=float("-inf"))
        p = tl.where(order_key(x, index) >= kappa, tl.exp(x - tl.load(par_ptr + row * 3)), 0.0)
        p = tl.where(state == INVALID, float("nan"), p / tl.load(par_ptr + row * 3 + 1))
    tl.store(out_ptr + offset, p, mask=mask)


# ------------------------------------------------------------------------------ host side


def plan(rows: int, vocab: int) -> dict:
    """Scratch of ``request_probabilities``: chunk partials, the rows' state and the search's buffers."""
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    n_chunks = triton.cdiv(vocab, _chunk(vocab))
    partials = {name: (rows * n_chunks, f32) for name in ("request_max", "request_sum", "request_low",
                                                          "request_finite", "request_mass", "request_count")}
    return merge(partials, tsearch.plan(rows, vocab, n_chunks), {
        "request_best": (rows * n_chunks, i64), "request_par": (rows * 3, f32), "request_kappa": (rows, i64),
        "request_state": (rows, i32), "request_bounds": (rows * 2, i32), "request_cut": (rows * 4, f32),
        "request_fill": (rows, i32),
        # the filter's names: one buffer serves both
        "groups": (rows * triton.cdiv(vocab, GROUP), i64), "compact": (rows * CANDIDATE_SLOTS, i64)})


def _chunk(vocab: int) -> int:
    """Entries per (row, chunk) program: whole groups."""
    return max(row_chunk(vocab), GROUP)


def request_probabilities(logits, temperature, top_k, top_p, min_p, logit_bias, workspace):
    """``dspark.kernels.request_probabilities``: ``logits`` f32 ``[R, V]``, settings ``[S]`` and
    ``logit_bias`` ``[S, V]`` (or None), ``R = S * L``."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if not rows:
        return out
    per = rows // temperature.shape[0]
    settings = (temperature, top_k, top_p, min_p)
    chunk = _chunk(vocab)
    n_chunks, n_groups = triton.cdiv(vocab, chunk), triton.cdiv(vocab, GROUP)
    nc_pad = next_pow2(n_chunks)
    tile, bucket = min(256, chunk), tsearch.bucket_size(vocab)
    buf = claim(workspace, plan(rows, vocab), out.device)
    partials = [buf[f"request_{name}"] for name in ("max", "sum", "low", "finite", "best")]
    par, kappa, state, bounds, cut, fill = (buf[f"request_{name}"] for name in
                                            ("par", "kappa", "state", "bounds", "cut", "fill"))
    search = {"par": par, "bounds": bounds, "cut": cut, "fill": fill, "probe_partials": buf["probe_partials"],
              "bucket": buf["bucket"]}

    groups = buf["groups"]
    _scale_kernel[(rows, n_chunks)](logits, logits if logit_bias is None else logit_bias, out, vocab, per, *settings,
                                    *partials, groups, n_chunks, n_groups, CHUNK=chunk, GROUP_SIZE=GROUP,
                                    HAS_BIAS=logit_bias is not None, num_warps=4)
    _setup_kernel[(rows,)](per, *settings, *partials, n_chunks, par, kappa, state, bounds, cut, fill, NC_PAD=nc_pad,
                           num_warps=4)
    for top_k_search in (True, False):
        _candidates_kernel[(rows,)](out, vocab, per, top_k, min_p, par, kappa, state, cut, groups, n_groups,
                                    buf["compact"], TOP_K=top_k_search, NG_PAD=next_pow2(n_groups),
                                    KT=CANDIDATE_SLOTS, GROUP_SIZE=GROUP, NPROBE_=NPROBE, num_warps=8)
        tsearch.narrow(out, vocab, rows, vocab, 1.0, BY_COUNT if top_k_search else 0, out, 0, chunk, n_chunks, state,
                       search)
        _finish_kernel[(rows,)](out, vocab, per, min_p, par, kappa, state, bounds, cut, fill, buf["bucket"],
                                TOP_K=top_k_search, TILE=tile, BUCKET=bucket, NPROBE_=NPROBE, num_warps=8)
        if top_k_search:
            mass, count = buf["request_mass"], buf["request_count"]
            _mass_kernel[(rows, n_chunks)](out, vocab, par, kappa, state, mass, count, n_chunks, CHUNK=chunk,
                                           num_warps=4)
            _nucleus_kernel[(rows,)](per, top_p, par, kappa, state, bounds, cut, fill, mass, count, n_chunks,
                                     NC_PAD=nc_pad, num_warps=4)
    _write_kernel[(rows, n_chunks)](out, vocab, par, kappa, state, CHUNK=chunk, num_warps=4)
    return out
