"""Sampled Markov drafting over candidate sets (a dspark addition; runtime.md §12, after vLLM's DSpark
``topk_markov`` drafter): each draft step samples among the candidates of its slot -- the backbone's
top-C logits, and optionally the M likeliest successors of the previous token under the Markov
bigram (``markov_successor_table``) -- instead of the whole vocabulary, so a step costs
O((C + M) * R) instead of a pass over V.

Step ``s`` of row b, with ``prev`` = ``first_prev_tokens[b]`` at step 0, else the token drafted at
``s - 1``, and ``ids = candidate_ids[b, s]`` (``[C + M]``: C distinct token ids, then -- with a
successor table -- the step writes ``successor_ids[prev]``; an id equal to an earlier one is a
duplicate and gets no mass):

* ``z[c] = backbone[b*L + s + logits_offset, ids[c]] + W2[ids[c]] . W1[prev]`` (the vanilla Markov
  correction of kernels.md 3.11 on the candidates only, fp32);
* the request's filters over the candidates, in vLLM's sampler order (as ``dspark.engine``'s request
  stage does over the vocabulary): a greedy row (``temperature < GREEDY_TEMPERATURE`` or ``top_k ==
  1``) is one-hot at the first largest ``z``; otherwise ``x = z / T``, ``w = exp(x - max x)``;
  ``min_p`` keeps ``w >= min_p`` (``p >= min_p * p_max``); ``top_k`` keeps the entries with fewer than
  ``top_k`` larger ``x`` (ties with the k-th kept; 0 or ``>= C`` keeps all); ``top_p < 1`` keeps an
  entry while the mass of the entries ranked above it (``x`` descending, ties to the lower candidate
  index) is below ``top_p`` of the kept mass (the standard nucleus, the boundary entry kept whole);
  ``q = w / sum(w)`` over what is left;
* the draft is ``ids[c]`` for the inverse-CDF draw ``c`` from ``q`` with ``proposal_uniforms[b, s]``
  (kernels.md 2.4: candidate order, strict ``<``, fallback the last positive entry).

``q`` (``candidate_probabilities [B, P, C + M]``) is exactly the distribution each draft was drawn from,
zero outside its candidates, so speculative sampling against it stays lossless; added into a
dense ``[B, P, V]`` row of zeros (``scatter_add_``: a duplicate adds 0) it is what
``K.probabilistic_accept`` takes. Each row is
computed from its own inputs only (request-stable). Settings are per-row tensors ``[B]``:
``temperature`` f32, ``top_k`` int32/int64, ``top_p`` f32, ``min_p`` f32 (not range-checked: that
would synchronise the host). Weights fp16 or bf16 ``[V, R]`` (no FP8 W2), logits fp32, token ids
int32, probabilities and uniforms f32; backbone rows are finite.
"""

from __future__ import annotations

import torch

from ._backend import implementation
from ._validate import HALF_DTYPES, Checker
from .markov import markov_inputs, markov_step_inputs

__all__ = ["markov_successor_table", "markov_candidate_sample_step", "markov_candidate_sample"]

_TABLE_ROWS = 1024  # previous tokens per chunk of markov_successor_table: [1024, V] fp32 bias rows at a time


def markov_successor_table(markov_w1, markov_w2, count):
    """The ``count`` likeliest successors of every token under the Markov bigram: int32 ``[V, count]``,
    row ``v`` the ids of the ``count`` largest ``W2 . W1[v]`` (``torch.topk`` order).

    ``markov_w1`` / ``markov_w2`` fp16 or bf16 ``[V, R]``; ``1 <= count <= V``. Built once per draft
    (V rows of a ``[V, R] x [R, V]`` product, in chunks), in PyTorch on either device.
    """
    c = Checker("markov_successor_table")
    w1 = c.tensor("markov_w1", markov_w1, dtype=HALF_DTYPES, ndim=2)
    c.tensor("markov_w2", markov_w2, dtype=w1.dtype, shape=list(w1.shape), device=w1.device)
    count = c.integer("count", count, low=1, high=w1.shape[0])
    w2 = markov_w2.float()
    rows = [(w1[start:start + _TABLE_ROWS].float() @ w2.t()).topk(count, dim=-1).indices
            for start in range(0, w1.shape[0], _TABLE_ROWS)]
    return torch.cat(rows).to(torch.int32)


def _row_settings(c: Checker, batch: int, device, temperature, top_k, top_p, min_p) -> tuple:
    """The per-row settings ``[B]``, checked (dtypes, shapes, device) and made contiguous."""
    return (c.tensor("temperature", temperature, dtype=(torch.float32,), shape=[batch], device=device).contiguous(),
            c.tensor("top_k", top_k, dtype=(torch.int32, torch.int64), shape=[batch], device=device).contiguous(),
            c.tensor("top_p", top_p, dtype=(torch.float32,), shape=[batch], device=device).contiguous(),
            c.tensor("min_p", min_p, dtype=(torch.float32,), shape=[batch], device=device).contiguous())


def _successors(c: Checker, successor_ids, vocab: int, device) -> tuple[torch.Tensor | None, int]:
    """The optional int32 ``[V, M]`` successor table, contiguous, and M (0 without one)."""
    if successor_ids is None:
        return None, 0
    table = c.tensor("successor_ids", successor_ids, dtype=torch.int32, shape=[vocab, None], device=device)
    c.ids_in_range("successor_ids", table, vocab)
    return table.contiguous(), table.shape[1]


def _logit_bias(c: Checker, logit_bias, batch: int, vocab: int, device) -> torch.Tensor | None:
    """The optional f32 ``[B, V]`` logit bias, contiguous."""
    if logit_bias is None:
        return None
    return c.tensor("logit_bias", logit_bias, dtype=torch.float32, shape=[batch, vocab], device=device).contiguous()


def markov_candidate_sample_step(backbone_logits, markov_w1, markov_w2, first_prev_tokens, candidate_ids,
                                 proposal_uniforms, draft_token_ids, candidate_probabilities, step, temperature,
                                 top_k, top_p, min_p, *, successor_ids=None, logits_stride=0,
                                 logits_offset=0, logit_bias=None) -> None:
    """One sampled Markov step over candidate sets (module docstring); returns None.

    ``backbone_logits`` f32 ``[B, L, V]`` or ``[B*L, V]`` (``L = logits_stride or P``, row ``b*L + step
    + logits_offset``); ``markov_w1`` / ``markov_w2`` fp16 or bf16 ``[V, R]``; ``first_prev_tokens``
    int32 ``[B]``; ``candidate_ids`` int32 ``[B, P, C + M]`` (contiguous), of which step ``step``'s
    first C are its distinct backbone candidates; ``successor_ids`` None (M = 0) or int32 ``[V, M]``
    (``markov_successor_table``), whose row ``prev`` the step writes into ``candidate_ids[:, step,
    C:]``; ``proposal_uniforms`` f32 ``[B, P]``; settings ``[B]`` (module docstring). Writes
    ``candidate_probabilities[:, step]`` (f32 ``[B, P, C + M]``, contiguous) = q and
    ``draft_token_ids[:, step]`` (int32 ``[B, P]``, contiguous) = the draft; column ``step - 1`` of
    ``draft_token_ids`` is the previous token when ``step > 0``. ``logit_bias`` f32 ``[B, V]`` or None:
    added to row b's backbone logits (an fp32 add, as adding it to ``backbone_logits`` beforehand,
    without the pass over them). Never synchronises the host on the Triton backend (graph-capturable).
    """
    c = Checker("markov_candidate_sample_step")
    c.tensor("markov_w2", markov_w2, dtype=HALF_DTYPES)  # no FP8 codes
    m, draft, step = markov_step_inputs(c, backbone_logits, markov_w1, markov_w2, None, first_prev_tokens,
                                        draft_token_ids, step, logits_stride, logits_offset)
    width = draft.shape[1]
    c.tensor("draft_token_ids", draft, contiguous=True)
    successor_ids, successors = _successors(c, successor_ids, m.vocab, m.device)
    ids = c.tensor("candidate_ids", candidate_ids, dtype=torch.int32, shape=[m.batch, width, None], device=m.device,
                   contiguous=True)
    if ids.shape[2] <= successors:
        c.fail(f"candidate_ids must hold C >= 1 backbone candidates and the M = {successors} successors per step, "
               f"got shape {list(ids.shape)}")
    c.ids_in_range(f"candidate_ids[:, {step}, :C]", ids[:, step, :ids.shape[2] - successors], m.vocab)
    probs = c.tensor("candidate_probabilities", candidate_probabilities, dtype=torch.float32,
                     shape=list(ids.shape), device=m.device, contiguous=True)
    uniforms = c.tensor("proposal_uniforms", proposal_uniforms, dtype=torch.float32, shape=[m.batch, width],
                        device=m.device).contiguous()
    settings = _row_settings(c, m.batch, m.device, temperature, top_k, top_p, min_p)
    bias = _logit_bias(c, logit_bias, m.batch, m.vocab, m.device)
    implementation("markov_candidate_sample_step", m.device)(
        m.logits, m.weights[0], m.weights[1], first_prev_tokens.contiguous(), ids, successor_ids, uniforms, draft,
        probs, step, *settings, m.stride, m.offset, bias)


def markov_candidate_sample(backbone_logits, markov_w1, markov_w2, first_prev_tokens, proposal_uniforms, temperature,
                            top_k, top_p, min_p, *, candidates, successor_ids=None, logits_stride=0,
                            logits_offset=0, logit_bias=None):
    """A whole sampled drafting round over candidate sets: each slot's candidates are the ``candidates``
    largest of its backbone logits (plus ``logit_bias``), in descending order (the reference: ``torch.topk``, tied entries
    in its order; Triton, up to ``MAX_CANDIDATES`` of them: selected from group maxima in one read of
    the logits, ties to the lower index -- ``torch.topk`` on the GPU takes several radix passes over
    a 152k-entry row) and, with ``successor_ids`` (int32 ``[V, M]``), the previous token's M
    successors; then ``markov_candidate_sample_step`` for steps 0..P-1.

    Inputs as ``markov_candidate_sample_step``, ``P`` from ``proposal_uniforms`` f32 ``[B, P]``,
    ``1 <= candidates <= V``. Returns ``(draft_token_ids int32 [B, P], candidate_ids int32
    [B, P, C + M], candidate_probabilities f32 [B, P, C + M])``: ``candidate_probabilities[b, s]``
    over ``candidate_ids[b, s]`` is the distribution draft ``s`` was drawn from (duplicates hold 0). No
    host synchronisation on the Triton backend.
    """
    c = Checker("markov_candidate_sample")
    uniforms = c.tensor("proposal_uniforms", proposal_uniforms, dtype=torch.float32, ndim=2)
    width = uniforms.shape[1]
    if width < 1:
        c.fail(f"proposal_uniforms must be [B, P] with P >= 1, got shape {list(uniforms.shape)}")
    c.tensor("markov_w2", markov_w2, dtype=HALF_DTYPES)  # no FP8 codes
    m = markov_inputs(c, backbone_logits, markov_w1, markov_w2, None, first_prev_tokens, width=width, needed=width,
                      logits_stride=logits_stride, logits_offset=logits_offset)
    count = c.integer("candidates", candidates, low=1, high=m.vocab)
    successor_ids, successors = _successors(c, successor_ids, m.vocab, m.device)
    uniforms = c.tensor("proposal_uniforms", uniforms, shape=[m.batch, width], device=m.device).contiguous()
    settings = _row_settings(c, m.batch, m.device, temperature, top_k, top_p, min_p)
    bias = _logit_bias(c, logit_bias, m.batch, m.vocab, m.device)
    ids = torch.zeros(m.batch, width, count + successors, dtype=torch.int32, device=m.device)
    implementation("candidate_top_ids", m.device)(m.logits, m.stride, m.offset, ids, count, bias)
    tokens = torch.zeros(m.batch, width, dtype=torch.int32, device=m.device)
    probs = torch.empty(m.batch, width, count + successors, dtype=torch.float32, device=m.device)
    step_fn = implementation("markov_candidate_sample_step", m.device)
    for step in range(width):  # the round is its steps on either backend
        step_fn(m.logits, m.weights[0], m.weights[1], first_prev_tokens.contiguous(), ids, successor_ids, uniforms,
                tokens, probs, step, *settings, m.stride, m.offset, bias)
    return tokens, ids, probs
