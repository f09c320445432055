"""Sampling family: uniforms, probabilities, samplers and stores of the sampled draft path, and the
sampled Markov steps (kernels.md 2.1-2.4, 3.9, 3.10, 3.12, 3.18-3.20, 3.22). The probabilistic
(speculative-sampling) accept is in ``dspark.kernels.verify``.

Terms: B batch rows, V vocabulary, P the draft width (``draft_token_ids [B, P]``), S the draft stride
(the same width, seen from the verify side), ``P_v`` the drafts verified this round. Token ids and
lengths are int32, logits/probabilities/uniforms float32.

Sampling follows NVIDIA's inverse-CDF walk exactly: with ``t = clampUniform(u)`` the sampled index is
the first one whose sequential fp32 sum of the positive entries exceeds ``t`` (strict), else the last
positive index, else 0 -- the reference reproduces the C++ choice bit for bit for the same uniforms
(``dspark.kernels.reference.sampling``). Uniforms come from ``fill_uniforms`` (SplitMix64, exact).

Filters (kernels.md 3.9): ``top_k`` 0, negative or ``>= V`` keeps every entry (vLLM's -1 works);
``top_p`` in ``(0, 1]``, ``>= 1 - 1e-6`` keeps every entry. Ops that need scratch on the Triton
backend take ``workspace=`` (a ``dspark.kernels.Workspace``; a private default without one).

``request_probabilities`` is the engine's request stage instead (a dspark addition): vLLM's and
transformers' temperature, min_p, top-k and top-p per row, with their standard nucleus.

Per-row settings: ``logits_to_probabilities``, ``markov_sample_step`` and ``vanilla_markov_sample``
also take ``temperature``, ``top_k`` and ``top_p`` as tensors, one entry per batch row (f32, an
integer dtype, f32), so that one launch -- and one CUDA graph -- serves rows of any settings. Their
values are not range-checked (that would synchronise the host); each row's result is the one its
own scalar settings define (exact, up to fp32 rounding of the sums).
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._shared import MAX_TOKEN_ID, row_filter_settings
from ._validate import Checker
from .markov import markov_inputs, markov_step_inputs
from .workspace import resolve

__all__ = [
    "fill_uniforms",
    "logits_to_probabilities",
    "markov_sample_step",
    "vanilla_markov_sample",
    "sample_probability_rows",
    "store_draft_step_probabilities",
    "normalize_top_k_rows",
    "request_probabilities",
    "sample_top_k_rows_and_store",
]

_UINT64_MAX = (1 << 64) - 1


# ------------------------------------------------------------------------------ shared validation


def _filters(c: Checker, temperature, top_k, top_p) -> tuple[float, int, float]:
    """``temperature >= 0``, ``top_k`` any int (``<= 0`` = off, passed on as 0), ``top_p`` in ``(0, 1]``."""
    if any(isinstance(v, torch.Tensor) for v in (temperature, top_k, top_p)):
        c.fail("temperature, top_k and top_p must be all numbers or all tensors [rows] (per-row settings), got "
               f"{type(temperature).__name__}, {type(top_k).__name__}, {type(top_p).__name__}", TypeError)
    temperature = c.real("temperature", temperature, low=0.0)
    top_k = max(0, c.integer("top_k", top_k))
    top_p = c.real("top_p", top_p)
    if not 0 < top_p <= 1:
        c.fail(f"top_p must be in (0, 1], got {top_p}")
    return temperature, top_k, top_p


def _settings(c: Checker, temperature, top_k, top_p, rows: int, vocab: int, device):
    """``(temperature, top_k, top_p, None)`` checked numbers, or for per-row ``[rows]`` tensors
    ``(1.0, 0, 1.0, f32 [rows, 3] (inv_temp, k, p))`` (``row_filter_settings``)."""
    if not all(isinstance(v, torch.Tensor) for v in (temperature, top_k, top_p)):
        return (*_filters(c, temperature, top_k, top_p), None)
    c.tensor("temperature", temperature, dtype=(torch.float32, torch.float64), shape=[rows], device=device)
    c.tensor("top_k", top_k, dtype=(torch.int32, torch.int64), shape=[rows], device=device)
    c.tensor("top_p", top_p, dtype=(torch.float32, torch.float64), shape=[rows], device=device)
    return 1.0, 0, 1.0, row_filter_settings(temperature, top_k, top_p, vocab)


def _draft_ids(c: Checker, draft_token_ids, batch: int, device: torch.device) -> torch.Tensor:
    """int32 ``[B, P]`` contiguous draft-token buffer (written in place), ``P >= 1``."""
    draft = c.tensor("draft_token_ids", draft_token_ids, dtype=torch.int32, shape=[batch, None], device=device,
                     contiguous=True)
    if draft.shape[1] < 1:
        c.fail(f"draft_token_ids must have P >= 1 columns, got shape {list(draft.shape)}")
    return draft


def _step_uniforms(c: Checker, proposal_uniforms, batch: int, width: int, device: torch.device) -> torch.Tensor:
    """f32 ``[B, P]`` proposal uniforms."""
    return c.tensor("proposal_uniforms", proposal_uniforms, dtype=torch.float32, shape=[batch, width],
                    device=device).contiguous()


def _scratch(c: Checker, probability_scratch, device: torch.device | None = None) -> torch.Tensor:
    """f32 ``[B, V]`` probability rows, ``V >= 1``."""
    scratch = c.tensor("probability_scratch", probability_scratch, dtype=torch.float32, ndim=2, device=device)
    if scratch.shape[1] < 1:
        c.fail(f"probability_scratch must have V >= 1 columns, got shape {list(scratch.shape)}")
    return scratch.contiguous()


# ------------------------------------------------------------------------------ uniforms, probabilities


def fill_uniforms(total_elements, philox_seed, philox_offset, device="cpu"):
    """Counter-based uniforms (kernels.md 2.1, 3.10); returns f32 ``[total_elements]`` on ``device``.

    ``u[i] = top24(splitmix64(seed XOR (offset + 0xD1B54A32D192ED03 * (i + 1)))) * 2^-24`` with all
    arithmetic modulo 2^64 -- bit-exact with NVIDIA's ``dsparkFillUniforms`` (the "philox" names are
    NVIDIA's; the generator is SplitMix64). ``philox_seed`` and ``philox_offset`` are unsigned 64-bit
    ints; values lie in ``[0, 1 - 2^-24]``.
    """
    c = Checker("fill_uniforms")
    total = c.integer("total_elements", total_elements, low=0)
    seed = c.integer("philox_seed", philox_seed, low=0, high=_UINT64_MAX)
    offset = c.integer("philox_offset", philox_offset, low=0, high=_UINT64_MAX)
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        c.fail(f"device must be a torch.device or device string, got {device!r} ({exc})", TypeError)
    return implementation("fill_uniforms", device)(total, seed, offset, device)


def logits_to_probabilities(logits, temperature, top_k=0, top_p=1.0, *, workspace=None):
    """Temperature, top-k and (mass-clipped) top-p probabilities (kernels.md 3.9).

    ``logits`` f32 ``[rows, V]`` (or ``[B, L, V]``, treated as ``B*L`` rows); returns f32 of the same
    shape. Settings are numbers, or per-row tensors (module docstring) with one entry per row of
    ``[rows, V]`` or per batch row of ``[B, L, V]``. ``x = logits * invTemp(T)`` with ``invTemp = 1/T``
    (fp32), then:

    * ``T < 1e-3``: one-hot at the argmax (ties to the lower index); ``top_k``/``top_p`` ignored.
    * ``top_k`` in ``(0, V)`` keeps the ``top_k`` largest ``x`` (ties to the lower index); 0, negative
      or ``>= V`` keeps all (kernels.md: ``K < 0 or K > V`` means ``K = V``).
    * ``top_p < 1 - 1e-6``: NVIDIA's mass-clipped nucleus, not the standard one: of the kept mass
      ``S``, exactly ``top_p * S`` is handed out in descending order (the crossing token gets only what
      is still missing) and divided by it; (0.5, 0.3, 0.15, 0.05) at 0.75 -> (2/3, 1/3, 0, 0).
    * otherwise the plain softmax.

    Rows whose softmax normaliser is not finite and positive (no finite logit, a NaN, or +inf) are
    uniform ``1/V``: NVIDIA does so on the unfiltered path only; dspark on every path (documented
    deviation; NVIDIA's filtered output is meaningless there). Normalisers are accurate (float64)
    sums, where NVIDIA's top-p-only path sums sequentially in fp32 (up to ~6e-4 too high on 151 936
    entries); results otherwise agree to fp32 rounding. ``workspace``: see the module docstring.
    """
    c = Checker("logits_to_probabilities")
    x = c.tensor("logits", logits, dtype=torch.float32, ndim=(2, 3))
    if x.shape[-1] < 1:
        c.fail(f"logits must have V >= 1 columns, got shape {list(x.shape)}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    temperature, top_k, top_p, settings = _settings(c, temperature, top_k, top_p, x.shape[0], x.shape[-1], x.device)
    if settings is not None and x.dim() == 3:
        settings = settings.repeat_interleave(x.shape[1], dim=0)
    probs = implementation("logits_to_probabilities", x.device)(rows, temperature, top_k, top_p, resolve(c, workspace),
                                                                settings)
    return probs.reshape(x.shape)


def request_probabilities(logits, temperature, top_k, top_p, min_p, *, logit_bias=None, workspace=None):
    """A request's probabilities as vLLM's sampler and transformers' warpers define them (a dspark
    addition: the engine's request stage, ``dspark.engine.drafting.RowSampling``).

    ``logits`` f32 ``[rows, V]`` (masked entries -inf; no NaN), or ``[B, L, V]`` (``B*L`` rows);
    returns f32 of the same shape. Per-row settings, one entry per row of ``[rows, V]`` or per batch
    row of ``[B, L, V]``: ``temperature`` f32, ``top_k`` int32/int64, ``top_p`` f32 in ``(0, 1]``,
    ``min_p`` f32 in ``[0, 1]`` (values are not range-checked: that would synchronise the host), and
    ``logit_bias`` f32 ``[batch, V]`` or None: added to the logits first (an fp32 add, the same values
    as adding it beforehand; the Triton backend adds it in its first pass instead of a pass of its
    own). Each row, ``logits`` meaning the biased logits:

    * greedy (``temperature < GREEDY_TEMPERATURE`` or ``top_k == 1``): one-hot at the first largest logit;
    * else ``x = logits / temperature`` (an fp32 division) and ``w = exp(x - max x)``; min_p keeps
      ``p >= min_p * p_max``; top-k (``1 < top_k < V``; else off) keeps the entries ``>=`` the k-th
      largest ``x`` (ties with it kept); top-p (``< 1``) ranks what is left by ``x`` descending, ties
      to the lower index, and keeps an entry while the mass ranked above it is below ``top_p`` of the
      kept mass (the standard nucleus: the boundary entry kept whole, the top entry always); the
      result is ``w / sum(w)`` over the kept entries.
    * a row without a finite maximum (all -inf, or +inf) is NaN, as a softmax of it.

    Backends. The reference is vLLM's torch code (one sort of each row; min_p on the fp32 softmax,
    top-p as ``cumsum <= 1 - top_p`` over the ascending fp32 softmax). The Triton backend sorts
    nothing and never synchronises the host (CUDA-graph capturable once ``workspace`` is sized):
    min_p keeps ``x >= max x + log(min_p)`` (fp32); the k-th entry and the nucleus cut come from each
    row's 128 largest entries (found from the maxima of groups of 32, stored in the first pass) where
    those hold them -- top-k up to 128, the nucleus of LLM-like rows -- else from a search in value
    space, with fp32 partial sums either way. The kept sets are the same except at boundaries decided by fp32
    rounding: an entry whose ``x`` lies within a few fp32 ulps of ``max x + log(min_p)`` (the
    reference compares rounded softmax values), or whose normalised mass ranked at or below it is
    within the rounding of either side's sums (~1e-6 on 152k entries) of ``1 - top_p``; top-k and
    ties are decided exactly alike. Kept probabilities agree to fp32 rounding (``rtol`` ~1e-5: the
    GPU's exp is an approximate one). ``workspace``: see the module docstring.
    """
    c = Checker("request_probabilities")
    x = c.tensor("logits", logits, dtype=torch.float32, ndim=(2, 3))
    if x.shape[-1] < 1:
        c.fail(f"logits must have V >= 1 columns, got shape {list(x.shape)}")
    batch = x.shape[0]
    settings = (c.tensor("temperature", temperature, dtype=torch.float32, shape=[batch], device=x.device),
                c.tensor("top_k", top_k, dtype=(torch.int32, torch.int64), shape=[batch], device=x.device),
                c.tensor("top_p", top_p, dtype=torch.float32, shape=[batch], device=x.device),
                c.tensor("min_p", min_p, dtype=torch.float32, shape=[batch], device=x.device))
    if logit_bias is not None:
        logit_bias = c.tensor("logit_bias", logit_bias, dtype=torch.float32, shape=[batch, x.shape[-1]],
                              device=x.device).contiguous()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    probs = implementation("request_probabilities", x.device)(rows, *(t.contiguous() for t in settings),
                                                              logit_bias, resolve(c, workspace))
    return probs.reshape(x.shape)


def normalize_top_k_rows(top_k_values, temperature):
    """Softmax of top-k values (kernels.md 3.20); returns f32 ``[rows, K]``.

    ``top_k_values`` f32 ``[rows, K]``; ``p = softmax(values * invTemp(T))``. Unlike
    ``logits_to_probabilities``, ``T < 1e-3`` means ``invTemp = 1`` (a plain softmax, no one-hot), as
    NVIDIA does. Rows without a finite normaliser get ``1/K``.
    """
    c = Checker("normalize_top_k_rows")
    values = c.tensor("top_k_values", top_k_values, dtype=torch.float32, ndim=2)
    if values.shape[1] < 1:
        c.fail(f"top_k_values must have K >= 1 columns, got shape {list(values.shape)}")
    temperature = c.real("temperature", temperature, low=0.0)
    return implementation("normalize_top_k_rows", values.device)(values.contiguous(), temperature)


# ------------------------------------------------------------------------------ draft-side steps


def sample_probability_rows(probability_scratch, proposal_uniforms, draft_token_ids, step, *, workspace=None) -> None:
    """Draw one token per row (kernels.md 3.18); writes ``draft_token_ids[:, step]``, returns None.

    ``probability_scratch`` f32 ``[B, V]``, ``proposal_uniforms`` f32 ``[B, P]``, ``draft_token_ids``
    int32 ``[B, P]`` (contiguous); the token is the inverse-CDF draw of row b with
    ``proposal_uniforms[b, step]``. ``workspace``: see the module docstring.
    """
    c = Checker("sample_probability_rows")
    scratch = _scratch(c, probability_scratch)
    batch, device = scratch.shape[0], scratch.device
    draft = _draft_ids(c, draft_token_ids, batch, device)
    uniforms = _step_uniforms(c, proposal_uniforms, batch, draft.shape[1], device)
    step = c.integer("step", step, low=0, high=draft.shape[1] - 1)
    implementation("sample_probability_rows", device)(scratch, uniforms, draft, step, resolve(c, workspace))


def store_draft_step_probabilities(probability_scratch, draft_probabilities, step) -> None:
    """``draft_probabilities[:, step] = probability_scratch`` (kernels.md 3.19); returns None.

    ``probability_scratch`` f32 ``[B, V]``; ``draft_probabilities`` f32 ``[B, P, V]``, contiguous.
    """
    c = Checker("store_draft_step_probabilities")
    scratch = _scratch(c, probability_scratch)
    batch, vocab = scratch.shape
    probs = c.tensor("draft_probabilities", draft_probabilities, dtype=torch.float32, shape=[batch, None, vocab],
                     device=scratch.device, contiguous=True)
    step = c.integer("step", step, low=0, high=probs.shape[1] - 1)
    implementation("store_draft_step_probabilities", scratch.device)(scratch, probs, step)


def sample_top_k_rows_and_store(top_k_values, top_k_indices, proposal_uniforms, draft_token_ids,
                                draft_top_k_probabilities, draft_top_k_indices, step, temperature) -> None:
    """Sparse draft step (kernels.md 3.22); writes column/row ``step`` of three buffers, returns None.

    ``top_k_values`` f32 ``[B, K]`` and ``top_k_indices`` int32 ``[B, K]`` (token ids, >= 0) are one
    draft step's top-k logits. ``draft_top_k_probabilities[:, step]`` (f32 ``[B, P, K]``) receives
    ``normalize_top_k_rows(top_k_values, temperature)``, ``draft_top_k_indices[:, step]`` (int32
    ``[B, P, K]``) the ids, and ``draft_token_ids[:, step]`` (int32 ``[B, P]``) the id drawn from them
    with ``proposal_uniforms[:, step]`` (f32 ``[B, P]``; fallback ``top_k_indices[:, 0]``).
    """
    c = Checker("sample_top_k_rows_and_store")
    values = c.tensor("top_k_values", top_k_values, dtype=torch.float32, ndim=2)
    (batch, k), device = values.shape, values.device
    if k < 1:
        c.fail(f"top_k_values must have K >= 1 columns, got shape {list(values.shape)}")
    indices = c.tensor("top_k_indices", top_k_indices, dtype=torch.int32, shape=[batch, k], device=device)
    draft = _draft_ids(c, draft_token_ids, batch, device)
    width = draft.shape[1]
    uniforms = _step_uniforms(c, proposal_uniforms, batch, width, device)
    probs = c.tensor("draft_top_k_probabilities", draft_top_k_probabilities, dtype=torch.float32,
                     shape=[batch, width, k], device=device, contiguous=True)
    ids = c.tensor("draft_top_k_indices", draft_top_k_indices, dtype=torch.int32, shape=[batch, width, k],
                   device=device, contiguous=True)
    step = c.integer("step", step, low=0, high=width - 1)
    temperature = c.real("temperature", temperature, low=0.0)
    c.ids_in_range("top_k_indices", indices, MAX_TOKEN_ID + 1)
    implementation("sample_top_k_rows_and_store", device)(
        values.contiguous(), indices.contiguous(), uniforms, draft, probs, ids, step, temperature)


def markov_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, draft_token_ids,
                       draft_probabilities, step, temperature, top_k=0, top_p=1.0, *, w2_row_scales=None,
                       logits_stride=0, logits_offset=0, workspace=None) -> None:
    """One sampled Markov draft step (one iteration of kernels.md 3.12; a dspark addition); returns None.

    ``z = build_markov_logits(...)`` for ``step`` (previous token ``first_prev_tokens`` at step 0, else
    ``draft_token_ids[:, step-1]``), ``q = logits_to_probabilities(z, temperature, top_k, top_p)``;
    writes ``draft_probabilities[:, step] = q`` (f32 ``[B, P, V]``, contiguous) and
    ``draft_token_ids[:, step]`` (int32 ``[B, P]``, contiguous) = the draw from ``q`` with
    ``proposal_uniforms[:, step]`` (f32 ``[B, P]``). ``backbone_logits`` f32 ``[B, L, V]`` or
    ``[B*L, V]`` (``L = logits_stride or P``, row ``b*L + step + logits_offset``); ``markov_w1`` and
    ``markov_w2`` fp16 or bf16 ``[V, R]``, or FP8 ``markov_w2`` codes with ``w2_row_scales`` (see
    ``dspark.kernels.markov``); ``first_prev_tokens`` int32 ``[B]``. On the Triton backend the step
    never synchronises the host and, once ``workspace`` is sized, allocates nothing (graph-capturable).
    """
    c = Checker("markov_sample_step")
    m, draft, step = markov_step_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens,
                                        draft_token_ids, step, logits_stride, logits_offset)
    draft = _draft_ids(c, draft, m.batch, m.device)
    width = draft.shape[1]
    uniforms = _step_uniforms(c, proposal_uniforms, m.batch, width, m.device)
    probs = c.tensor("draft_probabilities", draft_probabilities, dtype=torch.float32, shape=[m.batch, width, m.vocab],
                     device=m.device, contiguous=True)
    temperature, top_k, top_p, settings = _settings(c, temperature, top_k, top_p, m.batch, m.vocab, m.device)
    implementation("markov_sample_step", m.device)(
        m.logits, *m.weights, first_prev_tokens.contiguous(), uniforms, draft, probs, step, temperature, top_k, top_p,
        m.stride, m.offset, resolve(c, workspace), settings)


def vanilla_markov_sample(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, temperature,
                          top_k=0, top_p=1.0, *, w2_row_scales=None, logits_stride=0, logits_offset=0, workspace=None):
    """A whole sampled Markov drafting round (kernels.md 3.12): ``markov_sample_step`` for steps 0..P-1.

    Inputs as ``markov_sample_step``, ``P`` from ``proposal_uniforms`` f32 ``[B, P]``; returns
    ``(draft_token_ids int32 [B, P], draft_probabilities f32 [B, P, V])``, ``draft_probabilities[b, s]``
    being the distribution token ``s`` was drawn from.
    """
    c = Checker("vanilla_markov_sample")
    uniforms = c.tensor("proposal_uniforms", proposal_uniforms, dtype=torch.float32, ndim=2)
    width = uniforms.shape[1]
    if width < 1:
        c.fail(f"proposal_uniforms must be [B, P] with P >= 1, got shape {list(uniforms.shape)}")
    m = markov_inputs(c, backbone_logits, markov_w1, markov_w2, w2_row_scales, first_prev_tokens, width=width,
                      needed=width, logits_stride=logits_stride, logits_offset=logits_offset)
    uniforms = _step_uniforms(c, uniforms, m.batch, width, m.device)
    temperature, top_k, top_p, settings = _settings(c, temperature, top_k, top_p, m.batch, m.vocab, m.device)
    draft_token_ids = torch.zeros(m.batch, width, dtype=torch.int32, device=m.device)
    draft_probabilities = torch.empty(m.batch, width, m.vocab, dtype=torch.float32, device=m.device)
    step_fn, workspace = implementation("markov_sample_step", m.device), resolve(c, workspace)
    for step in range(width):  # the round is its steps on either backend
        step_fn(m.logits, *m.weights, first_prev_tokens.contiguous(), uniforms, draft_token_ids, draft_probabilities,
                step, temperature, top_k, top_p, m.stride, m.offset, workspace, settings)
    return draft_token_ids, draft_probabilities
