"""Benchmarks of the sampled DSpark path on the GPU: probabilities (temperature, top-k, top-p), dense
draws, probabilistic accept, and the whole sampled drafting round (P fused Markov steps, CUDA graph);
the engine's round over the vocabulary (Markov logits, request stage, draw) beside its round over
candidate sets (``markov_candidate_sample``: C backbone candidates + M bigram successors, q added into
the dense ``[B, 7, V]`` rows verification reads).

``python -m dspark.bench --family sampling --out sampling.json`` runs ``run``.

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up first, L2 flushed before every
repetition). dspark's Triton calls are captured in a CUDA graph and timed as replays (device time, as
the engine runs them); the PyTorch reference and ``torch.compile`` of it are timed as eager calls.
``bytes`` is what the operation must move at least: logits read + probabilities written, the rows a
draw reads, W2 seven times + the ``[B, 7, V]`` probabilities written for a round.
"""

from __future__ import annotations

import torch

import dspark.kernels as K
from dspark.kernels.reference import sampling as ref_sampling
from dspark.kernels.reference import verify as ref_verify

from .common import append_row, baseline_us
from .common import graph_us as _graph_us
from .common import row, try_compile

VOCAB, PROPOSAL_LEN, TEMPERATURE = 151936, 7, 0.8
CANDIDATE_SETS = ((32, 0), (64, 0), (48, 16))  # (C backbone candidates, M successors) per step
BATCHES, RANKS = (1, 8, 64), (64, 256)
FILTERS = {"none": (0, 1.0), "top-k 50": (50, 1.0), "top-p 0.9": (0, 0.9), "top-k 50 + top-p 0.9": (50, 0.9)}


def _compiled_us(fn, *args) -> float | None:
    """``torch.compile(fn)(*args)`` median, or None where it does not compile here."""
    compiled = try_compile(fn)
    if compiled is None:
        return None
    try:
        compiled(*args)
        return baseline_us(lambda: compiled(*args))
    except Exception:  # noqa: BLE001 - benchmark only: report "not measured"
        return None


def _logits(rows: int, flat: bool, seed: int) -> torch.Tensor:
    """LLM-like rows: a few dominant tokens over a Gaussian tail (nucleus of tens of tokens), or flat
    rows (top-p 0.9 keeps tens of thousands of tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen) * (0.5 if flat else 2.0)
    if not flat:
        hot = torch.randint(0, VOCAB, (rows, 16), device="cuda", generator=gen)
        logits.scatter_add_(1, hot, torch.rand(rows, 16, device="cuda", generator=gen) * 4 + 10)
    return logits


def draw_inputs(batch: int) -> tuple:
    """``(probs [B, V], uniforms [B, P], tokens [B, P])`` of ``sample_probability_rows`` at benchmark size."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    probs = torch.softmax(torch.randn(batch, VOCAB, device="cuda", generator=gen) * 2, -1)
    uniforms = torch.rand(batch, PROPOSAL_LEN, device="cuda", generator=gen)
    tokens = torch.zeros(batch, PROPOSAL_LEN, dtype=torch.int32, device="cuda")
    return probs, uniforms, tokens


def accept_inputs(batch: int) -> tuple:
    """Arguments of ``probabilistic_accept`` at benchmark size: random target/draft rows, drafts
    sampled from the draft rows, full proposal lengths."""
    gen = torch.Generator(device="cuda").manual_seed(100 + batch)
    target = torch.softmax(torch.randn(batch, PROPOSAL_LEN + 1, VOCAB, device="cuda", generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(batch, PROPOSAL_LEN, VOCAB, device="cuda", generator=gen) * 2, -1)
    tokens = torch.multinomial(draft.reshape(-1, VOCAB), 1, generator=gen).reshape(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), PROPOSAL_LEN, dtype=torch.int32, device="cuda")
    uniforms = torch.rand(batch, 2 * PROPOSAL_LEN + 1, device="cuda", generator=gen)
    return target, draft, tokens, lengths, uniforms, PROPOSAL_LEN


def round_inputs(rank: int, batch: int) -> tuple:
    """``(backbone, w1, w2, first, uniforms, tokens, probs)`` of a sampled round at benchmark size."""
    gen = torch.Generator(device="cuda").manual_seed(rank + batch)
    backbone = torch.randn(batch, PROPOSAL_LEN, VOCAB, device="cuda", generator=gen) * 2
    w1 = (torch.randn(VOCAB, rank, device="cuda", generator=gen) * rank**-0.25).half()
    w2 = (torch.randn(VOCAB, rank, device="cuda", generator=gen) * rank**-0.25).half()
    first = torch.randint(0, VOCAB, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    uniforms = torch.rand(batch, PROPOSAL_LEN, device="cuda", generator=gen)
    tokens = torch.zeros(batch, PROPOSAL_LEN, dtype=torch.int32, device="cuda")
    probs = torch.zeros(batch, PROPOSAL_LEN, VOCAB, device="cuda")
    return backbone, w1, w2, first, uniforms, tokens, probs


def _bench_probabilities(ceiling: float, quick: bool) -> list[dict]:
    out = []
    for batch in (8, 64):
        rows = 8 * batch  # the target side: B * (P + 1) rows
        for flat in (False, True):
            logits = _logits(rows, flat, seed=rows)
            nbytes = 2 * rows * VOCAB * 4
            for name, (top_k, top_p) in FILTERS.items():
                if flat and (top_p == 1.0 or quick and top_k):
                    continue  # top-k alone does not depend on the row's shape

                def measure(k=top_k, p=top_p, name=name, flat=flat):
                    def call(backend):
                        with K.use_backend(backend):
                            return K.logits_to_probabilities(logits, TEMPERATURE, k, p)
                    compiled = name == "none" and not flat and (rows == 64 or not quick)
                    shape = dict(rows=rows, V=VOCAB, T=TEMPERATURE, filter=name, logits="flat" if flat else "peaked")
                    return row("logits_to_probabilities", "triton", shape, _graph_us(lambda: call("triton")), nbytes,
                               ceiling, reference_us=baseline_us(lambda: call("reference")),
                               compiled_us=_compiled_us(ref_sampling.logits_to_probabilities, logits, TEMPERATURE, k, p,
                                                        None)
                               if compiled else None,
                               target=">= 50% of copy bandwidth unfiltered and top-k <= 128; top-p <= 5x unfiltered")

                append_row(out, measure)
    return out


def _bench_draws(ceiling: float, quick: bool) -> list[dict]:
    out = []
    for batch in BATCHES:
        probs, uniforms, tokens = draw_inputs(batch)

        def draw(backend):
            with K.use_backend(backend):
                K.sample_probability_rows(probs, uniforms, tokens, 3)

        append_row(out, lambda: row(
            "sample_probability_rows", "triton", dict(B=batch, V=VOCAB), _graph_us(lambda: draw("triton")),
            batch * VOCAB * 4, ceiling, reference_us=baseline_us(lambda: draw("reference")),
            compiled_us=None if quick or batch != 64 else _compiled_us(ref_sampling.sample_from_probs, probs,
                                                                      uniforms[:, 3]),
            target=">= 40% of copy bandwidth at B=64, <= 20 us at B=1"))
    return out


def _bench_accept(ceiling: float, quick: bool) -> list[dict]:
    out = []
    for batch in BATCHES:
        args = accept_inputs(batch)

        def accept(backend):
            with K.use_backend(backend):
                return K.probabilistic_accept(*args)

        def measure(accept=accept, args=args, batch=batch):
            _, accept_length = accept("triton")
            residual_rows = int((accept_length.long() - 1 < PROPOSAL_LEN).sum())  # target + draft row read
            return row("probabilistic_accept", "triton", dict(B=batch, V=VOCAB, P_v=PROPOSAL_LEN,
                                                              residual_rows=residual_rows),
                       _graph_us(lambda: accept("triton")), (batch + residual_rows) * VOCAB * 4, ceiling,
                       reference_us=baseline_us(lambda: accept("reference")),
                       compiled_us=None if quick or batch != 64 else _compiled_us(ref_verify.probabilistic_accept,
                                                                                  *args, None),
                       target=">= 40% of copy bandwidth at B=64, <= 20 us at B=1")

        append_row(out, measure)
    return out


def _bench_round(ceiling: float, quick: bool) -> list[dict]:
    out = []
    for rank in RANKS:
        for batch in BATCHES:
            backbone, w1, w2, first, uniforms, tokens, probs = round_inputs(rank, batch)
            ideal_bytes = PROPOSAL_LEN * (VOCAB * rank * 2 + batch * VOCAB * 4)
            for name, (top_k, top_p) in FILTERS.items():
                if quick and name not in ("none", "top-k 50 + top-p 0.9"):
                    continue

                def sampled_round(k=top_k, p=top_p):
                    for step in range(PROPOSAL_LEN):
                        K.markov_sample_step(backbone, w1, w2, first, uniforms, tokens, probs, step, TEMPERATURE, k, p)

                def measure(sampled_round=sampled_round, name=name):
                    with K.use_backend("triton"):
                        us = _graph_us(sampled_round)
                    with K.use_backend("reference"):
                        reference_us = baseline_us(sampled_round)
                    return row("sampled_round", "triton", dict(B=batch, V=VOCAB, R=rank, P=PROPOSAL_LEN,
                                                               dtype="float16", T=TEMPERATURE, filter=name),
                               us, ideal_bytes, ceiling, reference_us=reference_us,
                               target="<= 2x reading W2 7 times + writing [B,7,V] fp32 (pct_of_copy_ceiling >= 50)")

                append_row(out, measure)
            yield from out  # row by row as the shapes finish (a long run cut short keeps them)
            out.clear()


def _row_settings(batch: int, top_k: int, top_p: float) -> tuple:
    """Per-row ``(temperature, top_k, top_p, min_p)`` tensors ``[B]`` of the engine's request stage."""
    full = lambda value, dtype=torch.float32: torch.full((batch,), value, dtype=dtype, device="cuda")  # noqa: E731
    return full(TEMPERATURE), full(top_k, torch.int32), full(top_p), full(0.0)


def _bench_candidate_round(ceiling: float, quick: bool):
    """The engine's sampled drafting round: over the vocabulary (``build_markov_logits``, the request
    stage, ``sample_probability_rows``, the store) and over candidate sets of C tokens."""
    for rank in RANKS:
        table = None
        for batch in BATCHES:
            backbone, w1, w2, first, uniforms, tokens, probs = round_inputs(rank, batch)
            if table is None:
                table = K.markov_successor_table(w1, w2, max(m for _, m in CANDIDATE_SETS))
            for name, (top_k, top_p) in FILTERS.items():
                if quick and name != "top-k 50 + top-p 0.9":
                    continue
                settings = _row_settings(batch, top_k, top_p)

                def vocabulary_round(settings=settings):
                    for step in range(PROPOSAL_LEN):
                        corrected = K.build_markov_logits(backbone, w1, w2, first, tokens, step)
                        q = K.request_probabilities(corrected, *settings)
                        K.sample_probability_rows(q, uniforms, tokens, step)
                        K.store_draft_step_probabilities(q, probs, step)

                shape = dict(B=batch, V=VOCAB, R=rank, P=PROPOSAL_LEN, dtype="float16", T=TEMPERATURE, filter=name)
                out = []
                append_row(out, lambda: row(
                    "engine_sampled_round", "triton", {**shape, "candidates": "vocabulary"},
                    _graph_us(vocabulary_round), PROPOSAL_LEN * (VOCAB * rank * 2 + 2 * batch * VOCAB * 4), ceiling,
                    target="the full-vocabulary baseline of candidate_sampled_round"))
                for count, successors in CANDIDATE_SETS:
                    def candidate_round(settings=settings, count=count, successors=successors):
                        drafted, ids, q = K.markov_candidate_sample(
                            backbone, w1, w2, first, uniforms, *settings, candidates=count,
                            successor_ids=table[:, :successors].contiguous() if successors else None)
                        probs.zero_().scatter_add_(2, ids.long(), q)  # the dense rows verification reads
                        return drafted

                    def measure(candidate_round=candidate_round, count=count, successors=successors):
                        with K.use_backend("triton"):
                            us = _graph_us(candidate_round)
                        with K.use_backend("reference"):
                            reference_us = baseline_us(candidate_round)
                        # backbone read once (top-k), C rows of W2 per step, dense q written
                        nbytes = (2 * batch * PROPOSAL_LEN * VOCAB * 4
                                  + PROPOSAL_LEN * batch * (count + successors) * rank * 2)
                        return row("candidate_sampled_round", "triton",
                                   {**shape, "candidates": count, "successors": successors}, us, nbytes,
                                   ceiling, reference_us=reference_us,
                                   target="<= 0.5x engine_sampled_round of the same shape and filter")

                    append_row(out, measure)
                yield from out


def run(ceiling_gbps: float, quick: bool = False):
    """All sampled-path benchmark rows at V = 151936 (``dspark.bench.common.row``), yielded group by group."""
    for bench in (_bench_draws, _bench_accept, _bench_probabilities, _bench_round, _bench_candidate_round):
        yield from bench(ceiling_gbps, quick)
