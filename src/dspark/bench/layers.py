"""Benchmarks of the layers family on the GPU (bf16, Qwen3-0.6B and Qwen3-8B shapes): fused residual +
RMSNorm, q/k norm + RoPE + KV store, cached attention (decode, verify / draft blocks, prefill), SwiGLU.

``python -m dspark.bench.layers --out layers.json`` (or ``python -m dspark.bench --family layers``)
writes the JSON and prints the markdown tables of ``dspark.bench.report``.

Times are medians of ``triton.testing.do_bench`` (CUDA events, the L2 flushed before every
repetition). dspark's Triton ops are captured in a CUDA graph and timed as replays (device time, as
the engine runs them). The PyTorch reference is timed as a graph replay too where it can be
captured, and eagerly for attention (its per-request loop reads lengths on the host); ``reference_timing``
says which. Attention is also compared with ``scaled_dot_product_attention`` over the dense padded cache
(every request's whole ``MAX_LEN`` line with a boolean mask, GQA through ``enable_gqa``), as a graph
replay. ``bytes`` is what an op must move at least: for attention the valid K/V of every request
(``context + T`` keys) plus q and the output; ``splits`` is the split-K factor the launch chose.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import dspark.kernels as K
from dspark.kernels.triton.layers import _attention_config
from dspark.model.layers import rope_inv_freq

from .common import append_row, capture_graph, cold_l2_us, graph_us, row

MODELS = {
    "qwen3-0.6b": dict(hidden=1024, n_q=16, n_kv=8, d=128, inter=3072),
    "qwen3-8b": dict(hidden=4096, n_q=32, n_kv=8, d=128, inter=12288),
}
BATCHES, QUERIES, CONTEXTS = (1, 8, 32, 64), (1, 8), (512, 2048)
PREFILL, MAX_LEN, DTYPE = 2048, 4096, torch.bfloat16
EPS = 1e-6


def _triton_us(fn) -> float:
    with K.use_backend("triton"):
        return graph_us(fn)


def _reference_us(fn, capturable: bool) -> tuple[float, str]:
    with K.use_backend("reference"):
        return (graph_us(fn), "graph") if capturable else (cold_l2_us(fn), "eager")


def _op_row(kernel, shape, fn, num_bytes, ceiling) -> dict:
    us = _triton_us(fn)
    reference_us, timing = _reference_us(fn, capturable=True)
    r = row(kernel, "triton", shape, us, num_bytes, ceiling, reference_us=reference_us)
    r["reference_timing"] = timing
    return r


def _token_counts(quick: bool) -> list[int]:
    counts = {b * t for b in BATCHES for t in QUERIES} | {PREFILL}
    return sorted(counts)[::2] if quick else sorted(counts)


# ------------------------------------------------------------------------------ elementwise ops


def _bench_rms_norm(ceiling: float, quick: bool) -> list[dict]:
    rows = []
    for name, cfg in MODELS.items():
        for n in _token_counts(quick):
            x, residual = (torch.randn(n, cfg["hidden"], device="cuda", dtype=DTYPE) for _ in range(2))
            weight = torch.randn(cfg["hidden"], device="cuda", dtype=DTYPE)
            append_row(rows, lambda: _op_row("rms_norm (+ residual)", dict(model=name, N=n, H=cfg["hidden"]),
                                           lambda: K.rms_norm(x, weight, EPS, residual=residual),
                                           4 * x.numel() * x.element_size(), ceiling))
    return rows


def _bench_silu_and_mul(ceiling: float, quick: bool) -> list[dict]:
    rows = []
    for name, cfg in MODELS.items():
        for n in _token_counts(quick):
            x = torch.randn(n, 2 * cfg["inter"], device="cuda", dtype=DTYPE)
            append_row(rows, lambda: _op_row("silu_and_mul", dict(model=name, N=n, I=cfg["inter"]),
                                           lambda: K.silu_and_mul(x), 3 * x.numel() // 2 * x.element_size(), ceiling))
    return rows


def _bench_qk_norm_rope_store(ceiling: float, quick: bool) -> list[dict]:
    rows = []
    for name, cfg in MODELS.items():
        n_q, n_kv, d = cfg["n_q"], cfg["n_kv"], cfg["d"]
        table = K.rope_cos_sin_table(rope_inv_freq(d, 1e6, "cuda"), MAX_LEN)
        norms = dict(q_norm_weight=torch.ones(d, device="cuda", dtype=DTYPE),
                     k_norm_weight=torch.ones(d, device="cuda", dtype=DTYPE))
        for n in _token_counts(quick):
            slots = 1 if n >= PREFILL else min(n, max(BATCHES))  # a prefill fills one line
            k_cache, v_cache = (torch.zeros(slots, MAX_LEN, n_kv, d, device="cuda", dtype=DTYPE) for _ in range(2))
            qkv = torch.randn(n, (n_q + 2 * n_kv) * d, device="cuda", dtype=DTYPE)  # merged projection output
            q, k, v = (p.view(n, -1, d) for p in qkv.split([n_q * d, n_kv * d, n_kv * d], dim=1))
            token = torch.arange(n, device="cuda")
            slot_ids, positions = token % slots, 100 + token // slots
            num_bytes = n * (2 * n_q + 4 * n_kv) * d * 2 + n * d * 4  # q in+out, k/v in+stored, cos/sin
            append_row(rows, lambda: _op_row(
                "qk_norm_rope_store", dict(model=name, N=n, n_q=n_q, n_kv=n_kv, d=d),
                lambda: K.qk_norm_rope_store(q, k, v, positions, slot_ids, table, k_cache, v_cache, **norms),
                num_bytes, ceiling))
    return rows


# ---------------------------------------------------------------------------------- attention


class _Attention:
    """``B`` requests of ``T`` new queries after ``ctx`` cached tokens, each in its own cache line."""

    def __init__(self, cfg: dict, batch: int, queries: int, ctx: int, causal: bool):
        self.n_q, self.n_kv, self.d = cfg["n_q"], cfg["n_kv"], cfg["d"]
        self.batch, self.queries, self.ctx, self.causal = batch, queries, ctx, causal
        gen = torch.Generator(device="cuda").manual_seed(batch * 7 + queries + ctx)
        self.k_cache, self.v_cache = (torch.randn(batch, MAX_LEN, self.n_kv, self.d, device="cuda", dtype=DTYPE,
                                                  generator=gen) for _ in range(2))
        self.q = torch.randn(batch * queries, self.n_q, self.d, device="cuda", dtype=DTYPE, generator=gen)
        index = dict(device="cuda", dtype=torch.int32)
        self.slot_ids = torch.arange(batch, **index)
        self.context_lens = torch.full((batch,), ctx, **index)
        self.cu_query_lens = torch.arange(batch + 1, **index) * queries

    def ours(self):
        return lambda: K.cached_attention(self.q, self.k_cache, self.v_cache, self.slot_ids, self.context_lens,
                                          self.cu_query_lens, self.queries, causal=self.causal)

    def sdpa(self, expand_heads: bool):
        """SDPA over every request's whole padded line (keys past ``ctx + T`` masked out), with its GQA
        support or on K/V heads repeated beforehand (which lets the memory-efficient kernel take a mask)."""
        q = self.q.view(self.batch, self.queries, self.n_q, self.d).transpose(1, 2)
        k, v = (c.transpose(1, 2) for c in (self.k_cache, self.v_cache))  # [B, n_kv, MAX_LEN, d]
        k, v = (c.repeat_interleave(self.n_q // self.n_kv, dim=1) if expand_heads else c.contiguous() for c in (k, v))
        t = torch.arange(self.queries, device="cuda")
        last = self.ctx + (t if self.causal else torch.full_like(t, self.queries - 1))  # last visible key per query
        mask = (torch.arange(MAX_LEN, device="cuda")[None, :] <= last[:, None])[None, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=not expand_heads)

    def shape(self, model: str) -> dict:
        return dict(model=model, B=self.batch, T=self.queries, ctx=self.ctx, causal=self.causal, n_q=self.n_q,
                    n_kv=self.n_kv, d=self.d)

    def bytes(self) -> int:
        kv = 2 * self.batch * (self.ctx + self.queries) * self.n_kv * self.d * 2
        return kv + 2 * self.q.numel() * 2

    def splits(self) -> int:
        return _attention_config(self.q.device, DTYPE, self.batch, self.n_kv, self.n_q // self.n_kv, self.d, MAX_LEN,
                                 self.queries)["SPLITS"]


def _attention_row(model: str, a: _Attention, ceiling: float) -> dict:
    us = _triton_us(a.ours())
    reference_us, timing = _reference_us(a.ours(), capturable=False)
    r = row("cached_attention", "triton", a.shape(model), us, a.bytes(), ceiling, reference_us=reference_us)
    sdpa_us = min(cold_l2_us(capture_graph(a.sdpa(expand)).replay) for expand in (False, True))
    r.update(reference_timing=timing, sdpa_padded_us=round(sdpa_us, 2), speedup_vs_sdpa=round(sdpa_us / us, 2),
             splits=a.splits())
    return r


def _attention_shapes(quick: bool):
    """(B, T, ctx, causal): decode and verify (causal), draft blocks (bidirectional), one prefill."""
    for ctx in CONTEXTS[:1] if quick else CONTEXTS:
        for batch in BATCHES:
            for queries in QUERIES:
                yield batch, queries, ctx, True
            if not quick:
                yield batch, 8, ctx, False
    yield 1, PREFILL, 0, True


def _bench_attention(ceiling: float, quick: bool) -> list[dict]:
    rows = []
    for name, cfg in MODELS.items():
        for batch, queries, ctx, causal in _attention_shapes(quick):
            a = _Attention(cfg, batch, queries, ctx, causal)
            append_row(rows, lambda: _attention_row(name, a, ceiling))
            del a
    return rows


def run(ceiling_gbps: float, quick: bool = False):
    """All layers benchmark rows (see the module docstring), yielded group by group."""
    for bench in (_bench_attention, _bench_qk_norm_rope_store, _bench_rms_norm, _bench_silu_and_mul):
        yield from bench(ceiling_gbps, quick)


def main(argv: list[str] | None = None) -> int:
    """``python -m dspark.bench --family layers`` with the given arguments, then the report's tables."""
    import json

    from . import report
    from .__main__ import main as bench_main
    from .__main__ import parser as bench_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    code = bench_main(["--family", "layers", *argv])
    if code == 0:
        out, _ = bench_parser().parse_known_args(argv)
        with open(out.out) as f:
            print(report.tables(json.load(f)))
    return code


if __name__ == "__main__":
    sys.exit(main())
