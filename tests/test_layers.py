"""The layers family: the PyTorch reference against Hugging Face's Qwen3 modules (fp32 and bf16), the
Triton kernels against the reference, bad input, and on a GPU real sizes and a CUDA-graph replay.

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` on tiny shapes: ragged batches
(requests with 0 queries, context lengths that are 0 or not a multiple of any tile), causal and
bidirectional attention, window starts, GQA groups of 1, 2 and 4, head dims 8, 16 and 64, strided
row views of a merged QKV projection. The interpreter's SM count is 4, so the small batches take the
split-K path (partials + combine) and the larger ones the single pass; a test checks both are hit.

Tolerances: fp32 compares to ``1e-5`` (summation order). In bf16 the Triton kernels reproduce every
rounding of the reference's op order, so ``rms_norm``'s residual sum is compared exactly and the
normalised outputs to two bf16 steps (``rtol=2e-2``: the f32 norm's reduction order and ``rsqrt`` may
move the rounding of ``x * inv_rms`` by one step, and the weight product's rounding by one more).
RoPE can cancel such a step (``x1 cos - x2 sin``), so the rotated q/k also get ``atol=2e-2`` (a
step of a value below 4). Attention feeds bf16-rounded probabilities to the P @ V product (tensor
cores), hence ``2e-2``.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import DEVICE, gpu, requires_triton
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

import dspark.kernels as K

EPS = 1e-6


def tolerance(dtype: torch.dtype, kind: str = "pointwise") -> dict:
    """See the module docstring; ``kind`` is ``pointwise``, ``rope`` or ``attention``."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(pointwise=dict(atol=1e-5, rtol=2e-2), rope=dict(atol=2e-2, rtol=2e-2),
                attention=dict(atol=2e-2, rtol=2e-2))[kind]


def on_backends(run):
    """``run()`` under the reference and then the Triton backend: ``(reference, triton)``."""
    results = []
    for name in ("reference", "triton"):
        with K.use_backend(name):
            results.append(run())
    return results


def rope_table(d: int, max_pos: int, device=DEVICE) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    return K.rope_cos_sin_table(inv_freq, max_pos)


# ------------------------------------------------------------------------------------ layouts


class Layout:
    """A ragged batch: request ``b`` has ``counts[b]`` new queries after ``ctx[b]`` cached tokens,
    in cache line ``slots[b]``; ``windows`` (or None) hides keys before ``windows[b]``."""

    def __init__(self, counts, ctx, slots, windows=None, device=DEVICE):
        self.counts, self.ctx, self.slots, self.windows = list(counts), list(ctx), list(slots), windows
        self.device = device

    @property
    def n(self) -> int:
        return sum(self.counts)

    def tensors(self, index_dtype=torch.int32) -> dict:
        cu = [0]
        for c in self.counts:
            cu.append(cu[-1] + c)
        t = lambda v: torch.tensor(v, dtype=index_dtype, device=self.device)  # noqa: E731
        return dict(slot_ids=t(self.slots), context_lens=t(self.ctx), cu_query_lens=t(cu),
                    max_query_len=max(self.counts + [1]),
                    window_starts=None if self.windows is None else t(self.windows))

    def token_positions(self):
        """Per new token: (position, slot)."""
        pos, slot = [], []
        for c, x, s in zip(self.counts, self.ctx, self.slots):
            pos += list(range(x, x + c))
            slot += [s] * c
        return (torch.tensor(pos, dtype=torch.int64, device=self.device),
                torch.tensor(slot, dtype=torch.int64, device=self.device))


def attention_inputs(layout: Layout, n_kv: int, rep: int, d: int, dtype, max_len: int, strided_q=False, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_slots = max(layout.slots) + 2
    k_cache = torch.randn(num_slots, max_len, n_kv, d, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_slots, max_len, n_kv, d, generator=gen).to(dtype).to(DEVICE)
    n_q = n_kv * rep
    if strided_q:  # the q part of a merged [N, (n_q + 2 n_kv) d] projection
        q = torch.randn(layout.n, (n_q + 2 * n_kv) * d, generator=gen).to(dtype).to(DEVICE)[:, :n_q * d]
        q = q.view(layout.n, n_q, d)
    else:
        q = torch.randn(layout.n, n_q, d, generator=gen).to(dtype).to(DEVICE)
    return q, k_cache, v_cache


def eager_reference(q, k_cache, v_cache, layout: Layout, visible, scale: float):
    """Hugging Face's eager attention per request with an explicit additive mask: ``visible(b, count,
    ctx)`` is request b's bool ``[count, ctx + count]`` (query t, key position k)."""
    rep = q.shape[1] // k_cache.shape[2]
    module = types.SimpleNamespace(num_key_value_groups=rep, training=False)
    out, row = torch.zeros_like(q), 0
    for b, (count, ctx, slot) in enumerate(zip(layout.counts, layout.ctx, layout.slots)):
        if count == 0:
            continue
        seen = visible(b, count, ctx).to(q.device)
        mask = torch.zeros(count, ctx + count, device=q.device).masked_fill(~seen, float("-inf"))
        key, value = (c[slot, :ctx + count].transpose(0, 1)[None] for c in (k_cache, v_cache))
        attn, _ = eager_attention_forward(module, q[row:row + count].transpose(0, 1)[None], key, value,
                                          mask[None, None], scale)
        out[row:row + count] = attn[0]
        row += count
    return out


def _positions(count: int, ctx: int):
    """(key positions ``[1, ctx+count]``, query positions ``[count, 1]``) of one request."""
    return torch.arange(ctx + count)[None, :], ctx + torch.arange(count)[:, None]


def hf_attention(q, k_cache, v_cache, layout: Layout, causal: bool, scale: float):
    """``eager_reference`` with causal (or bidirectional) visibility and the layout's windows."""
    def visible(b, count, ctx):
        keys, query_pos = _positions(count, ctx)
        start = 0 if layout.windows is None else layout.windows[b]
        return (keys >= start) & ((keys <= query_pos) if causal else torch.ones(count, 1, dtype=torch.bool))

    return eager_reference(q, k_cache, v_cache, layout, visible, scale)


# Layouts: decode, verify/draft blocks, ragged with empty requests, windows, and a short prefill.
DECODE = Layout([1, 1, 1], [37, 0, 18], [2, 0, 1])
RAGGED = Layout([3, 0, 7], [10, 5, 0], [1, 3, 0])
BLOCK = Layout([7], [45], [1], windows=[40])
WINDOWED = Layout([2, 3, 1], [20, 33, 0], [0, 2, 1], windows=[0, 30, 0])
PREFILL = Layout([40], [5], [0])

ATTENTION_CASES = [
    # layout, n_kv, rep, d, dtype, causal, max_len, strided q
    (DECODE, 2, 2, 16, torch.float32, True, 48, False),
    (DECODE, 1, 4, 8, torch.float32, True, 40, True),
    (RAGGED, 2, 1, 16, torch.float32, True, 24, False),
    (RAGGED, 4, 2, 16, torch.float32, False, 24, True),
    (BLOCK, 1, 2, 64, torch.float32, False, 56, False),
    (BLOCK, 2, 4, 16, torch.float32, True, 56, False),
    (WINDOWED, 2, 2, 8, torch.float32, True, 40, False),
    (WINDOWED, 1, 1, 16, torch.float32, False, 40, False),
    (PREFILL, 1, 4, 16, torch.float32, True, 48, False),
    (RAGGED, 2, 2, 16, torch.bfloat16, True, 24, True),
    (BLOCK, 2, 2, 64, torch.bfloat16, False, 56, False),
    (WINDOWED, 2, 4, 16, torch.bfloat16, True, 40, False),
]


# ------------------------------------------------------------------- reference vs Hugging Face


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rms_norm_matches_hf(dtype):
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    norm = Qwen3RMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
        expected_sum = x + residual
        expected = norm(expected_sum)
    with K.use_backend("reference"):
        y, s = K.rms_norm(x, norm.weight.detach(), EPS, residual=residual)
        plain = K.rms_norm(x, norm.weight.detach(), EPS)
    assert torch.equal(s, expected_sum)
    torch.testing.assert_close(y, expected, **tolerance(dtype))
    with torch.no_grad():
        torch.testing.assert_close(plain, norm(x), **tolerance(dtype))


def test_rope_table_matches_hf_rotary_embedding():
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    rotary = Qwen3RotaryEmbedding(config)
    table = K.rope_cos_sin_table(rotary.inv_freq, 64, rotary.attention_scaling)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(64)[None])
    torch.testing.assert_close(torch.cat([table[:, 0], table[:, 0]], -1), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([table[:, 1], table[:, 1]], -1), sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_qk_norm_rope_store_matches_hf(dtype):
    n, n_q, n_kv, d, max_len = 6, 4, 2, 16, 20
    q, k, v = (torch.randn(n, h, d).to(dtype) for h in (n_q, n_kv, n_kv))
    positions, slots = torch.tensor([0, 1, 2, 7, 19, 3]), torch.tensor([0, 0, 0, 2, 1, 2])
    q_norm, k_norm = Qwen3RMSNorm(d, eps=EPS).to(dtype), Qwen3RMSNorm(d, eps=EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(d))
        k_norm.weight.copy_(torch.randn(d))
        table = rope_table(d, 32, device="cpu")
        cos = torch.cat([table[:, 0], table[:, 0]], -1)[positions].to(dtype)[None]  # HF: [1, N, d]
        sin = torch.cat([table[:, 1], table[:, 1]], -1)[positions].to(dtype)[None]
        q_hf, k_hf = apply_rotary_pos_emb(q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None], cos, sin)
    k_cache, v_cache = torch.zeros(3, max_len, n_kv, d, dtype=dtype), torch.zeros(3, max_len, n_kv, d, dtype=dtype)
    with K.use_backend("reference"):
        q_out = K.qk_norm_rope_store(q, k, v, positions, slots, table, k_cache, v_cache,
                                     q_norm_weight=q_norm.weight.detach(), k_norm_weight=k_norm.weight.detach(), eps=EPS)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), **tolerance(dtype, "rope"))
    k_stored = k_cache[slots, positions]
    torch.testing.assert_close(k_stored, k_hf[0].transpose(0, 1), **tolerance(dtype, "rope"))
    assert torch.equal(v_cache[slots, positions], v)
    untouched = torch.ones(3, max_len, dtype=torch.bool)
    untouched[slots, positions] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("layout, causal", [(RAGGED, True), (BLOCK, False), (WINDOWED, True)])
def test_reference_cached_attention_matches_hf_eager(layout, causal):
    q, k_cache, v_cache = attention_inputs(layout, 2, 2, 16, torch.float32, 56)
    with K.use_backend("reference"):
        out = K.cached_attention(q, k_cache, v_cache, causal=causal, scale=0.3, **layout.tensors())
    torch.testing.assert_close(out, hf_attention(q, k_cache, v_cache, layout, causal, 0.3), atol=1e-5, rtol=1e-5)


def _sliding_reference(q, k_cache, v_cache, layout, window, scale):
    """The sliding-window mask of transformers' masking_utils: key k visible to the query at
    position p iff p - window < k <= p."""
    def visible(b, count, ctx):
        keys, query_pos = _positions(count, ctx)
        return (keys <= query_pos) & (keys > query_pos - window)

    return eager_reference(q, k_cache, v_cache, layout, visible, scale)


@pytest.mark.parametrize("layout, window", [(RAGGED, 4), (PREFILL, 6), (DECODE, 9), (PREFILL, 64)])
def test_sliding_window_is_per_query(layout, window):
    """``sliding_window``: each query its own window (a prompt or verify row spans several)."""
    q, k_cache, v_cache = attention_inputs(layout, 2, 2, 16, torch.float32, 56)
    with K.use_backend("reference"):
        out = K.cached_attention(q, k_cache, v_cache, causal=True, sliding_window=window, scale=0.3, **layout.tensors())
    torch.testing.assert_close(out, _sliding_reference(q, k_cache, v_cache, layout, window, 0.3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"sliding_window must be in \[1, inf\], got 0"):
        K.cached_attention(q, k_cache, v_cache, causal=True, sliding_window=0, **layout.tensors())


@requires_triton
@pytest.mark.parametrize("layout, window, dtype", [(RAGGED, 4, torch.float32), (PREFILL, 6, torch.float32),
                                                   (PREFILL, 17, torch.bfloat16), (DECODE, 9, torch.float32)])
def test_triton_sliding_window_matches_reference(layout, window, dtype):
    q, k_cache, v_cache = attention_inputs(layout, 2, 2, 16, dtype, 56)
    expected, actual = on_backends(lambda: K.cached_attention(q, k_cache, v_cache, causal=True, sliding_window=window,
                                                              **layout.tensors(torch.int64)))
    torch.testing.assert_close(actual, expected, **tolerance(dtype, "attention"))


def test_reference_silu_and_mul_matches_hf_activation():
    x = torch.randn(4, 2 * 24)
    with K.use_backend("reference"):
        out = K.silu_and_mul(x)
    torch.testing.assert_close(out, ACT2FN["silu"](x[:, :24]) * x[:, 24:], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------- Triton == reference


@requires_triton
def test_a_gradient_to_carry_runs_the_reference_on_every_backend():
    """Training runs the engine's draft forward: with an input requiring grad (grad mode on) the ops
    run their PyTorch reference, which autograd differentiates, even with Triton forced."""
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(16, device=DEVICE)
    k_cache, v_cache = (torch.zeros(2, 8, 2, 8, device=DEVICE) for _ in range(2))
    table = rope_table(8, 8)
    with K.use_backend("triton"):
        y, summed = K.rms_norm(x, weight, EPS, residual=x.detach())
        kv = K.silu_and_mul(y).view(4, 1, 8).expand(4, 2, 8)
        K.qk_norm_rope_store(None, kv, kv, torch.arange(4, device=DEVICE), torch.tensor([0, 0, 1, 1], device=DEVICE),
                             table, k_cache, v_cache, k_norm_weight=torch.ones(8, device=DEVICE), eps=EPS)
        (k_cache.sum() + v_cache.square().sum() + summed.sum()).backward()
        with torch.no_grad():
            assert K.rms_norm(x, weight, EPS).grad_fn is None
    with K.use_backend("reference"):
        expected = torch.autograd.grad(_layer_ops_loss(x, weight, table), x)[0]
    torch.testing.assert_close(x.grad, expected)


def _layer_ops_loss(x, weight, table):
    """The same ops as above, spelled out in PyTorch."""
    y = weight * torch.nn.functional.rms_norm(x + x.detach(), (16,), eps=EPS)
    kv = torch.nn.functional.silu(y[:, :8]) * y[:, 8:]
    k = torch.nn.functional.rms_norm(kv, (8,), eps=EPS)
    cos, sin = (torch.cat([table[:4, i], table[:4, i]], dim=-1) for i in (0, 1))
    rotated = k * cos + torch.cat([-k[:, 4:], k[:, :4]], dim=-1) * sin
    return 2 * rotated.sum() + 2 * kv.square().sum() + (x + x.detach()).sum()


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 100), (3, 1024)])
def test_triton_rms_norm_matches_reference(rows, hidden, dtype):
    x, residual = torch.randn(rows, hidden).to(dtype).to(DEVICE), torch.randn(rows, hidden).to(dtype).to(DEVICE)
    weight = torch.randn(hidden).to(dtype).to(DEVICE)
    (y_ref, s_ref), (y, s) = on_backends(lambda: K.rms_norm(x, weight, EPS, residual=residual))
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, **tolerance(dtype))
    plain_ref, plain = on_backends(lambda: K.rms_norm(x, weight, EPS))
    torch.testing.assert_close(plain, plain_ref, **tolerance(dtype))


QK_CASES = [
    # n, n_q, n_kv, d, dtype, with q, with norms, merged qkv views
    (5, 4, 2, 16, torch.float32, True, True, True),
    (3, 2, 2, 8, torch.float32, True, False, False),
    (4, 8, 2, 64, torch.float32, False, True, True),
    (1, 4, 1, 16, torch.bfloat16, True, True, False),
    (6, 4, 2, 64, torch.bfloat16, True, True, True),
    (4, 2, 1, 8, torch.bfloat16, False, False, True),
]


@requires_triton
@pytest.mark.parametrize("n, n_q, n_kv, d, dtype, with_q, with_norms, merged", QK_CASES)
def test_triton_qk_norm_rope_store_matches_reference(n, n_q, n_kv, d, dtype, with_q, with_norms, merged):
    num_slots, max_len = 3, 12
    if merged:
        qkv = torch.randn(n, (n_q + 2 * n_kv) * d).to(dtype).to(DEVICE)
        q, k, v = (part.view(n, -1, d) for part in qkv.split([n_q * d, n_kv * d, n_kv * d], dim=1))
    else:
        q, k, v = (torch.randn(n, h, d).to(dtype).to(DEVICE) for h in (n_q, n_kv, n_kv))
    positions = torch.randint(0, max_len, (n,), device=DEVICE)
    slots = torch.randint(0, num_slots, (n,), device=DEVICE, dtype=torch.int32)
    weights = dict(q_norm_weight=torch.randn(d).to(dtype).to(DEVICE), k_norm_weight=torch.randn(d).to(dtype).to(DEVICE))
    base_k, base_v = (torch.randn(num_slots, max_len, n_kv, d).to(dtype).to(DEVICE) for _ in range(2))
    table = rope_table(d, 16)

    def run():
        k_cache, v_cache = base_k.clone(), base_v.clone()
        q_out = K.qk_norm_rope_store(q if with_q else None, k, v, positions, slots, table, k_cache, v_cache,
                                     eps=EPS, **(weights if with_norms else {}))
        return q_out, k_cache, v_cache

    (q_ref, k_ref, v_ref), (q_out, k_out, v_out) = on_backends(run)
    if with_q:
        torch.testing.assert_close(q_out, q_ref, **tolerance(dtype, "rope"))
    else:
        assert q_out is None and q_ref is None
    torch.testing.assert_close(k_out, k_ref, **tolerance(dtype, "rope"))
    assert torch.equal(v_out, v_ref)


@requires_triton
@pytest.mark.parametrize("layout, n_kv, rep, d, dtype, causal, max_len, strided", ATTENTION_CASES)
def test_triton_cached_attention_matches_reference(layout, n_kv, rep, d, dtype, causal, max_len, strided):
    q, k_cache, v_cache = attention_inputs(layout, n_kv, rep, d, dtype, max_len, strided_q=strided)
    expected, actual = on_backends(
        lambda: K.cached_attention(q, k_cache, v_cache, causal=causal, **layout.tensors(torch.int64)))
    torch.testing.assert_close(actual, expected, **tolerance(dtype, "attention"))


def paged(cache: torch.Tensor, block_size: int, seed: int = 0):
    """The lines of a contiguous cache ``[S, L, ...]`` scattered over shuffled blocks ``[S*L/bs + 1,
    bs, ...]`` (block 0 unused, as the engine's null block), and their block table int32 ``[S, L/bs]``."""
    lines, length = cache.shape[:2]
    per_line = length // block_size
    order = torch.randperm(lines * per_line, generator=torch.Generator().manual_seed(seed)) + 1
    blocks = torch.zeros(lines * per_line + 1, block_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    blocks[order] = cache.reshape(lines * per_line, block_size, *cache.shape[2:])
    return blocks, order.view(lines, per_line).to(torch.int32).to(cache.device)


PAGED_CASES = [  # layout, causal, sliding window, tree masks
    (RAGGED, True, None, False), (WINDOWED, True, None, False), (PREFILL, True, 8, False), (BLOCK, False, None, False),
    (Layout([4, 3], [13, 2], [2, 0]), True, None, True),
]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("layout, causal, window, tree", PAGED_CASES)
def test_paged_cached_attention_equals_contiguous_lines(backend, layout, causal, window, tree):
    """Lines read through a block table give exactly the contiguous lines' attention (blocks of 8 and 16)."""
    q, k_cache, v_cache = attention_inputs(layout, 2, 2, 16, torch.float32, 64)
    extra = dict(sliding_window=window)
    if tree:  # each new token sees itself and every even-indexed earlier one
        extra["tree_mask"] = torch.tensor([sum(1 << j for j in range(t + 1) if j == t or j % 2 == 0)
                                           for c in layout.counts for t in range(c)], device=DEVICE)
    with K.use_backend(backend):
        expected = K.cached_attention(q, k_cache, v_cache, causal=causal, **layout.tensors(), **extra)
        for block_size in (8, 16):
            k_blocks, table = paged(k_cache, block_size)
            v_blocks, _ = paged(v_cache, block_size)
            actual = K.cached_attention(q, k_blocks, v_blocks, causal=causal, block_table=table, **layout.tensors(),
                                        **extra)
            assert torch.equal(actual, expected), block_size


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_paged_qk_norm_rope_store_writes_the_rows_its_block_table_names(backend):
    n, n_kv, d, lines, length = 9, 2, 16, 3, 32
    q, k, v = (torch.randn(n, h, d, device=DEVICE) for h in (4, n_kv, n_kv))
    positions = torch.randint(0, length, (n,), device=DEVICE)
    slots = torch.randint(0, lines, (n,), device=DEVICE, dtype=torch.int32)
    with K.use_backend(backend):
        k_lines, v_lines = (torch.zeros(lines, length, n_kv, d, device=DEVICE) for _ in range(2))
        q_expected = K.qk_norm_rope_store(q, k, v, positions, slots, rope_table(d, length), k_lines, v_lines, eps=EPS)
        (k_blocks, table), (v_blocks, _) = paged(torch.zeros_like(k_lines), 8), paged(torch.zeros_like(v_lines), 8)
        q_out = K.qk_norm_rope_store(q, k, v, positions, slots, rope_table(d, length), k_blocks, v_blocks, eps=EPS,
                                     block_table=table)
    assert torch.equal(q_out, q_expected)
    assert torch.equal(k_blocks, paged(k_lines, 8)[0]) and torch.equal(v_blocks, paged(v_lines, 8)[0])


def test_paged_kernels_refuse_a_block_id_outside_the_cache():
    k_blocks = torch.zeros(4, 8, 2, 16)
    with pytest.raises(ValueError, match="block_table"):
        K.cached_attention(torch.zeros(1, 2, 16), k_blocks, k_blocks, torch.tensor([0]), torch.tensor([0]),
                           torch.tensor([0, 1]), 1, causal=True, block_table=torch.tensor([[0, 4]], dtype=torch.int32))


@requires_triton
def test_attention_cases_cover_split_and_single_pass():
    """Under the interpreter (4 SMs) the cases take both paths; on a GPU the real-size tests do."""
    from dspark.kernels.triton.layers import _attention_config

    splits = {_attention_config(torch.device("cpu"), dtype, len(layout.counts), n_kv, rep, d, max_len,
                                max(layout.counts))["SPLITS"] > 1
              for layout, n_kv, rep, d, dtype, _, max_len, _ in ATTENTION_CASES}
    assert splits == {True, False}


@requires_triton
def test_triton_cached_attention_with_max_query_len_above_the_counts():
    """A launch sized for more queries than any request has (a CUDA-graph bucket) is still exact."""
    q, k_cache, v_cache = attention_inputs(RAGGED, 2, 2, 16, torch.float32, 24)
    args = dict(RAGGED.tensors(), max_query_len=16)
    expected, actual = on_backends(lambda: K.cached_attention(q, k_cache, v_cache, causal=True, **args))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 24), (4, 1500)])
def test_triton_silu_and_mul_matches_reference(rows, inter, dtype):
    x = (torch.randn(rows, 2 * inter) * 4).to(dtype).to(DEVICE)
    expected, actual = on_backends(lambda: K.silu_and_mul(x))
    torch.testing.assert_close(actual, expected, **tolerance(dtype))


@requires_triton
def test_triton_kernels_never_address_out_of_range_slots_or_positions():
    """On the GPU values are not checked: bad slots / positions store nothing, a bad slot reads no keys."""
    from dspark.kernels.triton import layers as T

    n_kv, d, max_len = 2, 16, 8
    k_cache, v_cache = torch.zeros(2, max_len, n_kv, d, device=DEVICE), torch.zeros(2, max_len, n_kv, d, device=DEVICE)
    k, v = torch.randn(3, n_kv, d, device=DEVICE), torch.randn(3, n_kv, d, device=DEVICE)
    positions = torch.tensor([max_len, -1, 3], device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)  # token 2: slot 2 does not exist
    T.qk_norm_rope_store(None, k, v, positions, positions, slots, rope_table(d, 16), k_cache, v_cache, None, None, EPS)
    assert not k_cache.any() and not v_cache.any()
    q = torch.randn(2, 2 * n_kv, d, device=DEVICE)
    out = T.cached_attention(q, k_cache + 1, v_cache + 1, torch.tensor([5, 0], device=DEVICE),
                             torch.tensor([3, 0], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE), 1, True,
                             None, None, None, d ** -0.5)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[1], torch.ones_like(out[1]))


# -------------------------------------------------------------------------------- bad input


def _qk_args(**override):
    n, n_q, n_kv, d = 3, 4, 2, 8
    args = dict(q=torch.randn(n, n_q, d), k=torch.randn(n, n_kv, d), v=torch.randn(n, n_kv, d),
                positions=torch.tensor([0, 1, 2]), slot_ids=torch.tensor([0, 0, 1]), cos_sin=rope_table(d, 8, "cpu"),
                k_cache=torch.zeros(2, 8, n_kv, d), v_cache=torch.zeros(2, 8, n_kv, d))
    args.update(override)
    return args


def _attention_args(**override):
    layout = Layout([2, 1], [3, 0], [0, 1])
    q, k_cache, v_cache = attention_inputs(layout, 2, 2, 8, torch.float32, 8)
    args = dict(q=q.cpu(), k_cache=k_cache.cpu(), v_cache=v_cache.cpu(), causal=True, **layout.tensors())
    for key in ("slot_ids", "context_lens", "cu_query_lens"):
        args[key] = args[key].cpu()
    args.update(override)
    return args


BAD_INPUTS = [
    # (call, argument named in the error)
    (lambda: K.rms_norm([1.0], torch.ones(1), EPS), "x"),
    (lambda: K.rms_norm(torch.ones(2, 4, dtype=torch.int32), torch.ones(4), EPS), "x"),
    (lambda: K.rms_norm(torch.ones(4), torch.ones(4), EPS), "x"),
    (lambda: K.rms_norm(torch.ones(2, 4), torch.ones(5), EPS), "weight"),
    (lambda: K.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.bfloat16), EPS), "weight"),
    (lambda: K.rms_norm(torch.ones(2, 4), torch.ones(4), -1.0), "eps"),
    (lambda: K.rms_norm(torch.ones(2, 4), torch.ones(4), "small"), "eps"),
    (lambda: K.rms_norm(torch.ones(2, 4), torch.ones(4), EPS, residual=torch.ones(3, 4)), "residual"),
    (lambda: K.qk_norm_rope_store(**_qk_args(q=torch.randn(3, 3, 8))), "q"),
    (lambda: K.qk_norm_rope_store(**_qk_args(q=torch.randn(2, 4, 8))), "q"),
    (lambda: K.qk_norm_rope_store(**_qk_args(q=torch.randn(3, 4, 8).half())), "q"),
    (lambda: K.qk_norm_rope_store(**_qk_args(k=torch.randn(3, 1, 8))), "k"),
    (lambda: K.qk_norm_rope_store(**_qk_args(v=torch.randn(4, 2, 8))), "v"),
    (lambda: K.qk_norm_rope_store(**_qk_args(positions=torch.tensor([0.0, 1.0, 2.0]))), "positions"),
    (lambda: K.qk_norm_rope_store(**_qk_args(positions=torch.tensor([0, 1, 8]))), "positions"),
    (lambda: K.qk_norm_rope_store(**_qk_args(slot_ids=torch.tensor([0, 2, 1]))), "slot_ids"),
    (lambda: K.qk_norm_rope_store(**_qk_args(slot_ids=torch.tensor([0, 1]))), "slot_ids"),
    (lambda: K.qk_norm_rope_store(**_qk_args(cos_sin=torch.zeros(8, 2, 3))), "cos_sin"),
    (lambda: K.qk_norm_rope_store(**_qk_args(cos_sin=torch.zeros(8, 2, 4).double())), "cos_sin"),
    (lambda: K.qk_norm_rope_store(**_qk_args(k_cache=torch.zeros(2, 8, 16))), "k_cache"),
    (lambda: K.qk_norm_rope_store(**_qk_args(v_cache=torch.zeros(2, 7, 2, 8))), "v_cache"),
    (lambda: K.qk_norm_rope_store(**_qk_args(q_norm_weight=torch.ones(4))), "q_norm_weight"),
    (lambda: K.qk_norm_rope_store(**_qk_args(k_norm_weight=torch.ones(8).half())), "k_norm_weight"),
    (lambda: K.qk_norm_rope_store(**_qk_args(eps=-1e-6)), "eps"),
    (lambda: K.qk_norm_rope_store(**_qk_args(q=torch.randn(3, 4, 7), k=torch.randn(3, 2, 7), v=torch.randn(3, 2, 7),
                                            k_cache=torch.zeros(2, 8, 2, 7), v_cache=torch.zeros(2, 8, 2, 7))),
     "head dimension"),
    (lambda: K.cached_attention(**_attention_args(q=torch.randn(3, 3, 8))), "q"),
    (lambda: K.cached_attention(**_attention_args(q=torch.randn(3, 4, 16))), "q"),
    (lambda: K.cached_attention(**_attention_args(k_cache=torch.zeros(2, 8, 2, 8, dtype=torch.int32))), "k_cache"),
    (lambda: K.cached_attention(**_attention_args(v_cache=torch.zeros(2, 8, 2, 4))), "v_cache"),
    (lambda: K.cached_attention(**_attention_args(slot_ids=torch.tensor([[0, 1]]))), "slot_ids"),
    (lambda: K.cached_attention(**_attention_args(slot_ids=torch.tensor([0, 3]))), "slot_ids"),
    (lambda: K.cached_attention(**_attention_args(context_lens=torch.tensor([3]))), "context_lens"),
    (lambda: K.cached_attention(**_attention_args(context_lens=torch.tensor([7, 0]))), "context_lens"),
    (lambda: K.cached_attention(**_attention_args(cu_query_lens=torch.tensor([0, 2]))), "cu_query_lens"),
    (lambda: K.cached_attention(**_attention_args(cu_query_lens=torch.tensor([0, 3, 2]))), "cu_query_lens"),
    (lambda: K.cached_attention(**_attention_args(max_query_len=1)), "max_query_len"),
    (lambda: K.cached_attention(**_attention_args(max_query_len=2.0)), "max_query_len"),
    (lambda: K.cached_attention(**_attention_args(causal=1)), "causal"),
    (lambda: K.cached_attention(**_attention_args(window_starts=torch.tensor([0]))), "window_starts"),
    (lambda: K.cached_attention(**_attention_args(scale=-1.0)), "scale"),
    (lambda: K.silu_and_mul(torch.ones(2, 5)), "x"),
    (lambda: K.silu_and_mul(torch.ones(4)), "x"),
    (lambda: K.rope_cos_sin_table(torch.ones(4, dtype=torch.float64), 8), "inv_freq"),
    (lambda: K.rope_cos_sin_table(torch.ones(4), 0), "max_positions"),
]


@pytest.mark.parametrize("call, name", BAD_INPUTS)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
        call()


# ------------------------------------------------------------------- GPU: real sizes, graphs


QWEN3_8B = dict(hidden=4096, n_q=32, n_kv=8, d=128, inter=12288)


@gpu
@requires_triton
def test_gpu_real_size_ops_match_reference():
    """Qwen3-8B heads, B=8 requests of T=8 queries after 700 context tokens, bf16."""
    cfg, dtype = QWEN3_8B, torch.bfloat16
    layout = Layout([8] * 8, [700 + 13 * b for b in range(8)], list(range(8)), device="cuda")
    x = torch.randn(layout.n, cfg["hidden"], device="cuda", dtype=dtype)
    weight = torch.randn(cfg["hidden"], device="cuda", dtype=dtype)
    (y_ref, s_ref), (y, s) = on_backends(lambda: K.rms_norm(x, weight, EPS, residual=x.flip(0)))
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, **tolerance(dtype))
    gate_up = torch.randn(layout.n, 2 * cfg["inter"], device="cuda", dtype=dtype)
    act_ref, act = on_backends(lambda: K.silu_and_mul(gate_up))
    torch.testing.assert_close(act, act_ref, **tolerance(dtype))

    q, k_cache, v_cache = attention_inputs(layout, cfg["n_kv"], cfg["n_q"] // cfg["n_kv"], cfg["d"], dtype, 1024)
    qkv = torch.randn(layout.n, (cfg["n_q"] + 2 * cfg["n_kv"]) * cfg["d"], device="cuda", dtype=dtype)
    q_new, k_new, v_new = (p.view(layout.n, -1, cfg["d"]) for p in qkv.split(
        [cfg["n_q"] * cfg["d"], cfg["n_kv"] * cfg["d"], cfg["n_kv"] * cfg["d"]], dim=1))
    positions, token_slots = layout.token_positions()
    norms = dict(q_norm_weight=torch.rand(cfg["d"], device="cuda", dtype=dtype) + 0.5,
                 k_norm_weight=torch.rand(cfg["d"], device="cuda", dtype=dtype) + 0.5)
    table = rope_table(cfg["d"], 1024, device="cuda")
    for causal in (True, False):
        def step():
            kc, vc = k_cache.clone(), v_cache.clone()
            q_rot = K.qk_norm_rope_store(q_new, k_new, v_new, positions, token_slots, table, kc, vc, **norms)
            return q_rot, kc, K.cached_attention(q_rot, kc, vc, causal=causal, **layout.tensors())

        (q_ref, kc_ref, out_ref), (q_rot, kc, out) = on_backends(step)
        torch.testing.assert_close(q_rot, q_ref, **tolerance(dtype, "rope"))
        torch.testing.assert_close(kc, kc_ref, **tolerance(dtype, "rope"))
        torch.testing.assert_close(out, out_ref, **tolerance(dtype, "attention"))


@gpu
@requires_triton
@pytest.mark.parametrize("batch, count, ctx", [(1, 1, 3000), (1, 1500, 0), (64, 1, 500)])
def test_gpu_attention_decode_and_prefill_sizes_match_reference(batch, count, ctx):
    layout = Layout([count] * batch, [ctx] * batch, list(range(batch)), device="cuda")
    q, k_cache, v_cache = attention_inputs(layout, 8, 2, 128, torch.bfloat16, ctx + count)
    expected, actual = on_backends(lambda: K.cached_attention(q, k_cache, v_cache, causal=True, **layout.tensors()))
    torch.testing.assert_close(actual, expected, **tolerance(torch.bfloat16, "attention"))


@gpu
@requires_triton
def test_gpu_store_and_attention_replay_as_a_cuda_graph_with_new_lengths():
    """One capture; each replay sees new context lengths (and positions) through the same buffers."""
    n_q, n_kv, d, count, max_len, dtype = 32, 8, 128, 8, 2048, torch.bfloat16
    batch = 2
    n = batch * count
    k_base, v_base = (torch.randn(batch + 1, max_len, n_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    k_cache, v_cache = k_base.clone(), v_base.clone()
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=dtype) for h in (n_q, n_kv, n_kv))
    table = rope_table(d, max_len, device="cuda")
    norms = dict(q_norm_weight=torch.rand(d, device="cuda", dtype=dtype) + 0.5,
                 k_norm_weight=torch.rand(d, device="cuda", dtype=dtype) + 0.5)
    layout = Layout([count] * batch, [100, 300], [2, 0], device="cuda")
    buffers = layout.tensors()
    positions, token_slots = layout.token_positions()

    def step():
        q_rot = K.qk_norm_rope_store(q, k, v, positions, token_slots, table, k_cache, v_cache, **norms)
        return K.cached_attention(q_rot, k_cache, v_cache, causal=True, **buffers)

    with K.use_backend("triton"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()

    for ctx in ([100, 300], [1500, 37], [0, 2040]):
        new = Layout([count] * batch, ctx, [2, 0], device="cuda")
        buffers["context_lens"].copy_(new.tensors()["context_lens"])
        new_positions, _ = new.token_positions()
        positions.copy_(new_positions)
        k_cache.copy_(k_base)
        v_cache.copy_(v_base)
        graph.replay()
        with K.use_backend("reference"):
            kc, vc = k_base.clone(), v_base.clone()
            q_rot = K.qk_norm_rope_store(q, k, v, new_positions, token_slots, table, kc, vc, **norms)
            expected = K.cached_attention(q_rot, kc, vc, causal=True, **new.tensors())
        torch.testing.assert_close(k_cache, kc, **tolerance(dtype, "rope"))
        torch.testing.assert_close(out, expected, **tolerance(dtype, "attention"))



# ---------------------------------------------------------------------------- tree verification


def _tree_masks(layout: Layout, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random trees (node 0 the root, parents before children): per query its ancestor bitmask, and
    per request the bool [count, count] visibility (ancestors and itself)."""
    gen = torch.Generator().manual_seed(seed)
    bits, seen = [], []
    for count in layout.counts:
        vis = torch.eye(count, dtype=torch.bool)
        for i in range(1, count):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            vis[i] |= vis[parent]
        seen.append(vis)
        bits += [sum(1 << j for j in range(count) if vis[i, j]) for i in range(count)]
    return torch.tensor(bits, dtype=torch.int64, device=DEVICE), seen


def _tree_reference(q, k_cache, v_cache, layout: Layout, seen, scale):
    """The tree mask: context visible, new keys by ancestry (``seen[b]`` bool ``[count, count]``)."""
    def visible(b, count, ctx):
        return torch.cat([torch.ones(count, ctx, dtype=torch.bool), seen[b]], dim=1)

    return eager_reference(q, k_cache, v_cache, layout, visible, scale)


TREES = Layout([9, 1, 16], [12, 0, 30], [2, 0, 1])


def test_tree_mask_attention_sees_context_and_ancestors():
    q, k_cache, v_cache = attention_inputs(TREES, 2, 2, 16, torch.float32, 56)
    bits, seen = _tree_masks(TREES, 0)
    with K.use_backend("reference"):
        out = K.cached_attention(q, k_cache, v_cache, causal=True, tree_mask=bits, scale=0.3, **TREES.tensors())
    torch.testing.assert_close(out, _tree_reference(q, k_cache, v_cache, TREES, seen, 0.3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tree_mask needs causal attention"):
        K.cached_attention(q, k_cache, v_cache, causal=False, tree_mask=bits, **TREES.tensors())


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tree_mask_matches_reference(dtype):
    q, k_cache, v_cache = attention_inputs(TREES, 2, 2, 16, dtype, 56, seed=1)
    bits, _ = _tree_masks(TREES, 1)
    expected, actual = on_backends(lambda: K.cached_attention(q, k_cache, v_cache, causal=True, tree_mask=bits,
                                                              **TREES.tensors(torch.int64)))
    torch.testing.assert_close(actual, expected, **tolerance(dtype, "attention"))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_cache_positions_store_at_their_own_rows(backend):
    """Tree nodes: RoPE at base + depth, K/V at base + node index."""
    n_kv, d, n = 2, 16, 4
    k = torch.randn(n, n_kv, d, device=DEVICE)
    v = torch.randn(n, n_kv, d, device=DEVICE)
    slots = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    angles = torch.tensor([5, 6, 6, 7], device=DEVICE)
    rows = torch.tensor([5, 6, 7, 8], device=DEVICE)
    table = rope_table(d, 16)
    k_cache, v_cache = torch.zeros(1, 12, n_kv, d, device=DEVICE), torch.zeros(1, 12, n_kv, d, device=DEVICE)
    k_want, v_want = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    with K.use_backend(backend):
        K.qk_norm_rope_store(None, k, v, angles, slots, table, k_cache, v_cache, cache_positions=rows)
        for i in range(n):  # one token at a time at its angle in a scratch line, copied to its row
            k_tmp, v_tmp = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
            K.qk_norm_rope_store(None, k[i:i + 1], v[i:i + 1], angles[i:i + 1], slots[:1], table, k_tmp, v_tmp)
            k_want[0, int(rows[i])], v_want[0, int(rows[i])] = k_tmp[0, int(angles[i])], v_tmp[0, int(angles[i])]
    torch.testing.assert_close(k_cache, k_want)
    torch.testing.assert_close(v_cache, v_want)
