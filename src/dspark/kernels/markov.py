"""Markov family: correction logits, fused greedy steps (fp16/bf16 and FP8 W2), whole greedy round.

The Markov head adds a rank-R bigram bias to the draft backbone's logits (kernels.md 3.11):
``z[b, v] = backbone[b*L + step + logits_offset, v] + sum_r W1[prev_b, r] * W2[v, r]``, where
``prev_b`` is ``first_prev_tokens[b]`` at step 0 and the token drafted at ``step - 1`` otherwise,
``L = logits_stride or P``. ``backbone_logits`` is fp32 ``[B, L, V]`` or ``[B*L, V]``; ``markov_w1``
and ``markov_w2`` are ``[V, R]`` fp16 or bf16 (bf16 is a dspark extension); math is fp32.

FP8 W2 (kernels.md 3.15, 3.16): ``markov_w2`` as uint8 E4M3 codes ``[V, R]`` with ``w2_row_scales``
fp16 ``[V]`` (from ``quantize_markov_w2_fp8``) gives ``z[b, v] = backbone + scale_v * (codes[v] .
W1[prev_b])``, the scale applied to the fp32 dot. Every Markov function takes it (the sampled ones
in ``dspark.kernels.sampling`` too); one GEMM kernel serves them all on the Triton backend.

Greedy slots are int64 ``[B, P]`` tensors holding the unsigned 64-bit packed keys of kernels.md 3.14
(``dspark.kernels.reference.markov.pack_greedy_keys``); a slot is written as the unsigned maximum of
its previous content and the step's best key, as NVIDIA's ``atomicMax`` does, so slots must be zeroed
once per round before step 0 (``markov_greedy_round`` does it).

Greedy decisions on NaN logits are garbage (an all-NaN row drafts token 0): the greedy functions
reject NaN in the backbone rows they read, checked for CPU tensors (on CUDA with
``DSPARK_CHECK_VALUES=1``, see ``dspark.kernels._validate``); unchecked, NaN ranks as in NVIDIA's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import implementation
from ._shared import FP8_RANKS, MAX_FUSED_RANK, MAX_TOKEN_ID
from ._validate import HALF_DTYPES, Checker
from .reference.markov import unpack_greedy_keys

__all__ = [
    "markov_partial_count",
    "fused_greedy_supported",
    "build_markov_logits",
    "markov_greedy_fused_step",
    "quantize_markov_w2_fp8",
    "markov_greedy_fused_step_fp8",
    "finalize_greedy_draft_tokens",
    "store_draft_step_top1",
    "markov_greedy_round",
]


def markov_partial_count(vocab_size: int) -> int:
    """Vocabulary blocks of NVIDIA's unfused Markov kernel, ``ceil(vocab_size / 16)`` (kernels.md 3.1)."""
    v = Checker("markov_partial_count").integer("vocab_size", vocab_size, low=1)
    return -(-v // 16)


def fused_greedy_supported(markov_rank: int) -> bool:
    """Whether the fused greedy step (fp16/bf16 W2) accepts Markov rank ``markov_rank``.

    dspark accepts exactly NVIDIA's set: ``0 < R <= 512`` and ``R % 8 == 0`` (kernels.md 3.13). The
    FP8 step accepts ``R`` in ``FP8_RANKS`` = {16, 32, 64, 128, 256, 512}. ``build_markov_logits``
    and the sampled steps accept any ``R >= 1``.
    """
    r = Checker("fused_greedy_supported").integer("markov_rank", markov_rank)
    return 0 < r <= MAX_FUSED_RANK and r % 8 == 0


# ------------------------------------------------------------------------------ shared validation


@dataclass
class MarkovInputs:
    """Validated Markov inputs: device, sizes, the normalised ``[rows, V]`` logits and the weights in
    backend order ``(markov_w1, markov_w2, w2_row_scales)``."""

    device: torch.device
    batch: int
    vocab: int
    rank: int
    logits: torch.Tensor
    stride: int
    offset: int
    weights: tuple
    fp8: bool


def markov_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, *, width, needed,
                  logits_stride, logits_offset, greedy_rows=None, w2_name="markov_w2") -> MarkovInputs:
    """Check the inputs every Markov function shares; ``width`` is P (the default row stride).

    ``needed`` rows per batch entry (from ``logits_offset``) must lie inside the row stride. FP8 when
    ``markov_w2`` (``w2_name`` in messages) holds uint8 codes, which needs ``w2_row_scales``.
    ``greedy_rows = (first, count)``: the rows ``first .. first+count-1`` (after the offset) a greedy
    decision is taken on, checked for NaN.
    """
    first = c.tensor("first_prev_tokens", first_prev_tokens, dtype=torch.int32, ndim=1)
    device, batch = first.device, first.shape[0]
    w1 = c.tensor("markov_w1", markov_w1, dtype=HALF_DTYPES, ndim=2, device=device)
    vocab, rank = w1.shape
    if rank < 1 or vocab < 1:
        c.fail(f"markov_w1 must be [V, R] with V >= 1 and R >= 1, got {list(w1.shape)}")
    fp8 = isinstance(markov_w2, torch.Tensor) and markov_w2.dtype == torch.uint8
    if fp8 and w2_row_scales is None:
        c.fail(f"{w2_name} holds uint8 FP8 codes, so w2_row_scales (float16 [V]) must be given")
    if not fp8 and w2_row_scales is not None:
        got = getattr(markov_w2, "dtype", type(markov_w2).__name__)
        c.fail(f"w2_row_scales is given, so {w2_name} must hold uint8 FP8 codes, got {got}")
    w2 = c.tensor(w2_name, markov_w2, dtype=torch.uint8 if fp8 else w1.dtype, device=device)
    if w2.shape != w1.shape:
        c.fail(f"{w2_name} must have the shape [V, R] = {list(w1.shape)} of markov_w1, got {list(w2.shape)}")
    if fp8:
        c.tensor("w2_row_scales", w2_row_scales, dtype=torch.float16, shape=[vocab], device=device)
    logits = c.tensor("backbone_logits", backbone_logits, dtype=torch.float32, ndim=(2, 3), device=device)
    if logits.shape[-1] != vocab:
        c.fail(f"backbone_logits must have V = {vocab} columns like markov_w1, got shape {list(logits.shape)}")
    stride = c.integer("logits_stride", logits_stride, low=0) or width
    offset = c.integer("logits_offset", logits_offset, low=0)
    logits = c.rows("backbone_logits", logits, batch, stride, offset, needed)
    c.ids_in_range("first_prev_tokens", first, vocab)
    if greedy_rows is not None:
        row, count = greedy_rows[0] + offset, greedy_rows[1]
        c.no_nan(f"backbone_logits rows {row}..{row + count - 1} of each batch entry",
                 logits.view(batch, stride, vocab)[:, row:row + count])
    weights = (w1.contiguous(), w2.contiguous(), w2_row_scales.contiguous() if fp8 else None)
    return MarkovInputs(device, batch, vocab, rank, logits, stride, offset, weights, fp8)


def markov_step_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, draft_token_ids,
                       step, logits_stride, logits_offset):
    """Inputs of one Markov step that reads its previous token from ``draft_token_ids`` int32 ``[B, P]``
    (column ``step - 1``): returns ``(MarkovInputs, draft_token_ids, step)``."""
    draft = c.tensor("draft_token_ids", draft_token_ids, dtype=torch.int32, ndim=2)
    width = draft.shape[1]
    step = c.integer("step", step, low=0, high=width - 1)
    m = markov_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, width=width,
                      needed=step + 1, logits_stride=logits_stride, logits_offset=logits_offset)
    c.tensor("draft_token_ids", draft, shape=[m.batch, width], device=m.device)
    if step > 0:
        c.ids_in_range(f"draft_token_ids[:, {step - 1}]", draft[:, step - 1], m.vocab)
    return m, draft, step


def _check_rank(c, m: MarkovInputs) -> None:
    """The fused greedy step's ranks (NVIDIA's sets, kernels.md 3.13 and 3.16)."""
    if m.fp8 and m.rank not in FP8_RANKS:
        c.fail(f"markov rank R = {m.rank} is not supported by the FP8 fused step; expected one of {FP8_RANKS}")
    if not m.fp8 and not fused_greedy_supported(m.rank):
        c.fail(f"markov rank R = {m.rank} is not supported by the fused greedy step; "
               f"expected a multiple of 8 in [8, {MAX_FUSED_RANK}]")


def _stacked(c, stacked_logits, m: MarkovInputs, width: int):
    """Optional f32 ``[B, P+1, V]`` contiguous stacked-logits buffer (tree mode)."""
    if stacked_logits is None:
        return None
    return c.tensor("stacked_logits", stacked_logits, dtype=torch.float32, shape=[m.batch, width + 1, m.vocab],
                    device=m.device, contiguous=True)


def _buffer(c, name, buffer, dtype, m: MarkovInputs, width: int) -> torch.Tensor:
    """A caller's ``[B, P]`` buffer, checked (written in place: contiguous), or a new one when None."""
    if buffer is None:
        return torch.empty((m.batch, width), dtype=dtype, device=m.device)
    return c.tensor(name, buffer, dtype=dtype, shape=[m.batch, width], device=m.device, contiguous=True)


# ------------------------------------------------------------------------------ public functions


def build_markov_logits(backbone_logits, markov_w1, markov_w2, first_prev_tokens, draft_token_ids, step, *,
                        w2_row_scales=None, logits_stride=0, logits_offset=0):
    """Markov-corrected logits of draft step ``step`` (kernels.md 3.11); returns f32 ``[B, V]``.

    ``backbone_logits`` f32 ``[B, L, V]`` or ``[B*L, V]`` (``L = logits_stride or P``);
    ``markov_w1``/``markov_w2`` fp16 or bf16 ``[V, R]`` (any ``R >= 1``), or FP8 ``markov_w2`` codes
    with ``w2_row_scales`` (module docstring); ``first_prev_tokens`` int32 ``[B]``;
    ``draft_token_ids`` int32 ``[B, P]``, whose column ``step - 1`` is the previous token when
    ``step > 0``; ``0 <= step < P``.
    """
    c = Checker("build_markov_logits")
    m, draft, step = markov_step_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens,
                                        draft_token_ids, step, logits_stride, logits_offset)
    return implementation("build_markov_logits", m.device)(
        m.logits, *m.weights, first_prev_tokens.contiguous(), draft.contiguous(), step, m.stride, m.offset)


def _fused_step(name, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, greedy_slots, step,
                stacked_logits, stacked_depth_row, logits_stride, logits_offset, w2_name="markov_w2"):
    """Validate and dispatch one fused greedy step (FP8 when ``markov_w2`` holds codes)."""
    c = Checker(name)
    width = c.tensor("greedy_slots", greedy_slots, dtype=torch.int64, ndim=2).shape[1]
    step = c.integer("step", step, low=0, high=width - 1)
    m = markov_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, width=width,
                      needed=step + 1, logits_stride=logits_stride, logits_offset=logits_offset,
                      greedy_rows=(step, 1), w2_name=w2_name)
    _check_rank(c, m)
    slots = _buffer(c, "greedy_slots", greedy_slots, torch.int64, m, width)
    stacked = _stacked(c, stacked_logits, m, width)
    stacked_depth_row = c.integer("stacked_depth_row", stacked_depth_row, low=0, high=width)
    if step > 0:  # the slot read as the previous token must hold a key of an id in [0, V)
        c.ids_in_range(f"greedy_slots[:, {step - 1}] (the previous step's winner)",
                       unpack_greedy_keys(slots[:, step - 1]), m.vocab)
    implementation("markov_greedy_fused_step", m.device)(
        m.logits, *m.weights, first_prev_tokens.contiguous(), slots, step, stacked, stacked_depth_row, m.stride,
        m.offset)


def markov_greedy_fused_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, greedy_slots, step, *,
                             stacked_logits=None, stacked_depth_row=0, logits_stride=0, logits_offset=0) -> None:
    """One greedy Markov step: correction + exact argmax as a packed key (kernels.md 3.14).

    Writes ``greedy_slots[:, step]`` (int64 ``[B, P]``, contiguous) as the unsigned max of its content
    and ``max_v key(z[b, v], v)``; returns None. The previous token is ``first_prev_tokens[b]`` (int32
    ``[B]``) at step 0, else the index in ``greedy_slots[:, step - 1]``. ``markov_w1``/``markov_w2``
    fp16 or bf16 ``[V, R]`` with ``fused_greedy_supported(R)``. Optional ``stacked_logits`` f32
    ``[B, P+1, V]`` receives ``z`` at depth row ``stacked_depth_row`` (0..P). Keys order +0.0 above
    -0.0 and let +NaN win, as NVIDIA's do (NaN rows are rejected where values are checked, see the
    module docstring).
    """
    _fused_step("markov_greedy_fused_step", backbone_logits, markov_w1, markov_w2, None, first_prev_tokens,
                greedy_slots, step, stacked_logits, stacked_depth_row, logits_stride, logits_offset)


def markov_greedy_fused_step_fp8(backbone_logits, markov_w1, w2_fp8, w2_row_scales, first_prev_tokens, greedy_slots,
                                 step, *, stacked_logits=None, stacked_depth_row=0, logits_stride=0,
                                 logits_offset=0) -> None:
    """``markov_greedy_fused_step`` with FP8 W2 (kernels.md 3.16); returns None.

    ``w2_fp8`` uint8 E4M3 codes ``[V, R]`` and ``w2_row_scales`` f16 ``[V]`` from
    ``quantize_markov_w2_fp8``; ``z[b, v] = backbone + scale_v * (codes[v] . W1[prev_b])``.
    ``R`` in ``FP8_RANKS``.
    """
    c = Checker("markov_greedy_fused_step_fp8")
    c.tensor("w2_fp8", w2_fp8, dtype=torch.uint8)
    c.tensor("w2_row_scales", w2_row_scales)  # None here would otherwise select the fp16 path
    _fused_step("markov_greedy_fused_step_fp8", backbone_logits, markov_w1, w2_fp8, w2_row_scales, first_prev_tokens,
                greedy_slots, step, stacked_logits, stacked_depth_row, logits_stride, logits_offset, w2_name="w2_fp8")


def quantize_markov_w2_fp8(markov_w2):
    """Quantise ``markov_w2`` (fp16 or bf16 ``[V, R]``, ``R % 16 == 0``) to FP8 E4M3 per row (3.15).

    Returns ``(w2_fp8 uint8 [V, R], w2_row_scales f16 [V])``: ``scale = absmax/448`` in fp32 (1 for a
    zero row), codes = round-to-nearest-even E4M3 of ``w * (1/scale)`` saturated to +-448, scale
    stored rounded to fp16 (dequantised weight = ``code * float(scale_f16)``; as in NVIDIA's, a row
    with absmax below ~1.3e-5 gets an fp16 scale of 0). Non-finite weights are rejected (a value
    check: CPU tensors, or ``DSPARK_CHECK_VALUES=1``).
    """
    c = Checker("quantize_markov_w2_fp8")
    w2 = c.tensor("markov_w2", markov_w2, dtype=HALF_DTYPES, ndim=2)
    rank = w2.shape[1]
    if rank < 16 or rank % 16:
        c.fail(f"markov_w2 must have a rank (column count) that is a positive multiple of 16, "
               f"got shape {list(w2.shape)}")
    c.finite("markov_w2", w2)
    return implementation("quantize_markov_w2_fp8", w2.device)(w2.contiguous())


def finalize_greedy_draft_tokens(greedy_slots):
    """int32 ``[B, P]`` tokens unpacked from int64 ``[B, P]`` greedy slots (kernels.md 3.17).

    A slot never written (still 0) unpacks to -1, as in NVIDIA's kernel.
    """
    c = Checker("finalize_greedy_draft_tokens")
    slots = c.tensor("greedy_slots", greedy_slots, dtype=torch.int64, ndim=2)
    slots = slots.contiguous()
    tokens = torch.empty(slots.shape, dtype=torch.int32, device=slots.device)
    return implementation("finalize_greedy_draft_tokens", slots.device)(slots, tokens)


def store_draft_step_top1(top1_indices, draft_token_ids, step) -> None:
    """``draft_token_ids[:, step] = top1_indices`` (kernels.md 3.21); returns None.

    ``top1_indices`` int32 ``[B]`` or ``[B, 1]``; ``draft_token_ids`` int32 ``[B, P]``, contiguous.
    """
    c = Checker("store_draft_step_top1")
    draft = c.tensor("draft_token_ids", draft_token_ids, dtype=torch.int32, ndim=2, contiguous=True)
    batch, width = draft.shape
    top1 = c.tensor("top1_indices", top1_indices, dtype=torch.int32, ndim=(1, 2), device=draft.device)
    if top1.dim() == 2:
        c.tensor("top1_indices", top1, shape=[batch, 1])
    c.tensor("top1_indices", top1.reshape(-1), shape=[batch])
    step = c.integer("step", step, low=0, high=width - 1)
    c.ids_in_range("top1_indices", top1, MAX_TOKEN_ID)
    implementation("store_draft_step_top1", draft.device)(top1.reshape(-1).contiguous(), draft, step)


def markov_greedy_round(backbone_logits, markov_w1, markov_w2, first_prev_tokens, *, proposal_len, w2_row_scales=None,
                        logits_stride=0, logits_offset=0, greedy_slots=None, draft_token_ids=None,
                        stacked_logits=None):
    """A whole greedy drafting round (dspark addition): returns draft tokens int32 ``[B, P]``.

    Zeroes the slots, runs ``P = proposal_len`` fused steps (FP8 when ``markov_w2`` holds uint8 codes
    and ``w2_row_scales`` f16 ``[V]`` is given), finalizes. Inputs as ``markov_greedy_fused_step``;
    ``backbone_logits`` must hold rows ``offset .. offset+P-1`` of every batch entry.
    ``greedy_slots`` (int64 ``[B, P]``) and ``draft_token_ids`` (int32 ``[B, P]``, returned) are
    optional preallocated buffers: with both given nothing is allocated and (Triton backend) the host
    is never synchronised, so the round can be captured in a CUDA graph (value checks still run for
    CPU tensors). ``stacked_logits`` f32 ``[B, P+1, V]`` receives step ``s``'s corrected row at depth
    row ``s + 1`` (row 0 is left untouched).
    """
    c = Checker("markov_greedy_round")
    width = c.integer("proposal_len", proposal_len, low=1)
    m = markov_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, width=width,
                      needed=width, logits_stride=logits_stride, logits_offset=logits_offset, greedy_rows=(0, width))
    _check_rank(c, m)
    slots = _buffer(c, "greedy_slots", greedy_slots, torch.int64, m, width)
    draft = _buffer(c, "draft_token_ids", draft_token_ids, torch.int32, m, width)
    stacked = _stacked(c, stacked_logits, m, width)
    # the round is its steps, composed here once for both backends
    step_fn = implementation("markov_greedy_fused_step", m.device)
    first = first_prev_tokens.contiguous()
    slots.zero_()
    for step in range(width):
        step_fn(m.logits, *m.weights, first, slots, step, stacked, step + 1, m.stride, m.offset)
    return implementation("finalize_greedy_draft_tokens", m.device)(slots, draft)
