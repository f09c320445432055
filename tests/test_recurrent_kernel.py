"""A verify window through a recurrence in one call (``dspark.kernels.gated_delta_scan``, the gated
delta rule; ``selective_state_scan``, Mamba-2): both backends (Triton under ``TRITON_INTERPRET=1`` on
the CPU) give transformers' own recurrent steps' outputs and states (``torch_recurrent_gated_delta_rule``,
``mamba2_selective_state_update``), per request of a ragged batch, from a ring entry or from zero,
each token's state written at its own (line, entry); bad inputs are refused by name. The conv before
them (``causal_conv_window``) gives ``F.conv1d`` over each token's inputs and the rings
``hybrid.causal_conv``'s PyTorch path leaves."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import BACKEND_PARAMS, DEVICE, INTERPRETER_WARNINGS, gpu, requires_triton

import dspark.kernels as K
from dspark.model import hybrid
from dspark.model.llama import AttentionBatch

pytestmark = [INTERPRETER_WARNINGS]
I64 = torch.int64
HEADS, DK, DV, LINES, ENTRIES = 3, 16, 12, 5, 4  # dv not a multiple of the Triton value block
# requests: 3 tokens from line 1's entry 2; 1 token from zero; none; 4 tokens from line 4's entry 0
FIRSTS, COUNTS, READ_LINES, READ_ENTRIES = [0, 3, 4, 4], [3, 1, 0, 4], [1, 2, 0, 4], [2, -1, 3, 0]
WRITE_LINES, WRITE_ENTRIES = [0, 0, 3, 2, 4, 4, 1, 1], [1, 3, 0, 2, 1, 2, 3, 0]


def _i64(xs):
    return torch.tensor(xs, dtype=I64, device=DEVICE)


def _hf_rule():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule


def _inputs(n: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, HEADS, DK, generator=gen) for _ in range(2))
    v = torch.randn(n, HEADS, DV, generator=gen)
    g = -torch.rand(n, HEADS, generator=gen) * 0.5
    beta = torch.rand(n, HEADS, generator=gen)
    states = torch.randn(LINES, ENTRIES, HEADS, DK, DV, generator=gen)
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), states)]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_scan_matches_transformers_recurrence_per_request(backend, dtype):
    firsts, counts, read_lines, read_entries = FIRSTS, COUNTS, READ_LINES, READ_ENTRIES
    q, k, v, g, beta, states = _inputs(8, dtype)
    write_lines, write_entries = _i64(WRITE_LINES), _i64(WRITE_ENTRIES)
    before = states.clone()
    with K.use_backend(backend):
        out = K.gated_delta_scan(q, k, v, g, beta, states, _i64(read_lines), _i64(read_entries), _i64(firsts),
                                 _i64(counts), write_lines, write_entries, scale=DK ** -0.5)
    rule = _hf_rule()
    expected_states = before.clone()
    for first, count, line, entry in zip(firsts, counts, read_lines, read_entries):
        if not count:
            continue
        span = slice(first, first + count)
        state = before[line, entry][None] if entry >= 0 else torch.zeros(1, HEADS, DK, DV, device=DEVICE)
        for i in range(first, first + count):  # one token at a time: every state after it
            o, state = rule(q[None, i:i + 1], k[None, i:i + 1], v[None, i:i + 1], g[None, i:i + 1],
                            beta[None, i:i + 1], initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out[i].float(), o[0, 0].float(), atol=2e-2 if dtype != torch.float32 else 1e-5,
                                       rtol=1e-2 if dtype != torch.float32 else 1e-5)
            expected_states[write_lines[i], write_entries[i]] = state[0]
        whole, _ = rule(q[None, span], k[None, span], v[None, span], g[None, span], beta[None, span],
                        initial_state=before[line, entry][None] if entry >= 0 else None, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[span].float(), whole[0].float(), atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_state_scan_matches_transformers_mamba2_step_per_request(backend, dtype):
    from transformers.models.bamba.modeling_bamba import mamba2_selective_state_update

    heads, groups, head_dim, size, n = 4, 2, 20, 12, 8  # head_dim not a multiple of the Triton block
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, heads, head_dim, generator=gen)
    dt = torch.rand(n, heads, generator=gen) * 0.5
    a = -torch.rand(heads, generator=gen) - 0.5
    b, c = (torch.randn(n, groups, size, generator=gen) for _ in range(2))
    d = torch.randn(heads, generator=gen)
    states = torch.randn(5, 4, heads, head_dim, size, generator=gen)
    x, dt, b, c, d = (t.to(dtype).to(DEVICE) for t in (x, dt, b, c, d))
    a, states = a.to(DEVICE), states.to(DEVICE)
    before = states.clone()
    with K.use_backend(backend):
        out = K.selective_state_scan(x, dt, a, b, c, d, states, _i64(READ_LINES), _i64(READ_ENTRIES), _i64(FIRSTS),
                                     _i64(COUNTS), _i64(WRITE_LINES), _i64(WRITE_ENTRIES))
    expected = before.clone()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for first, count, line, entry in zip(FIRSTS, COUNTS, READ_LINES, READ_ENTRIES):
        state = before[line, entry][None].clone() if entry >= 0 else torch.zeros(1, heads, head_dim, size,
                                                                               device=DEVICE)
        for i in range(first, first + count):  # transformers' recurrent step, as the engine ran it
            o = mamba2_selective_state_update(state, x[i:i + 1], dt[i:i + 1, :, None].expand(-1, -1, head_dim),
                                              a[:, None, None].expand(-1, head_dim, size), b[i:i + 1], c[i:i + 1],
                                              d[:, None].expand(-1, head_dim))
            torch.testing.assert_close(out[i].float(), o[0].float(), **tolerance)
            expected[WRITE_LINES[i], WRITE_ENTRIES[i]] = state[0]
    torch.testing.assert_close(states, expected, **tolerance)


# checkpoint + replay: 6 requests on lines 4, 0, 5, 2, 1, 3 (line 6 unused), windows of at most 4
# tokens; per window each request's tokens and accepted prefix (all of 0 .. 4 accepted, ragged rows,
# a request with no tokens); the request on line 5 starts its first window from zero
REPLAY_LINES, WINDOW = [4, 0, 5, 2, 1, 3], 4
WINDOW_COUNTS = [[4, 4, 3, 4, 2, 4], [4, 1, 4, 4, 4, 0], [4, 4, 2, 1, 4, 3]]
ACCEPTED = [[0, 4, 3, 1, 2, 4], [2, 1, 4, 0, 3, 0], [4, 3, 0, 1, 4, 2]]


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("reference", torch.bfloat16),
                                            pytest.param("triton", torch.bfloat16, marks=requires_triton)])
def test_gated_delta_replay_scan_is_the_per_position_scan_rolled_back(backend, dtype):
    """Windows run by ``gated_delta_replay_scan`` (two checkpoint slots and two halves of kept
    entries in turn, as the engine runs them) give ``gated_delta_scan``'s outputs, and each call's
    new checkpoint is the per-position scan's state after the last window's accepted prefix, to the
    bit (same backend, same steps), the one it read left as it was, and a snapshot after a given
    count of replayed tokens (none, the start state, part or all of the prefix) that scan's state
    there; a last call without tokens replays the last window."""
    lines, requests = _i64(REPLAY_LINES), len(REPLAY_LINES)
    *_, ring = _inputs(1, dtype, seed=3)
    ring = torch.cat([ring, ring[:2]])[:, :1].repeat(1, WINDOW + 1, 1, 1, 1)  # 7 lines; entry 0: the window's start
    fresh = torch.tensor([r == 2 for r in range(requests)], device=DEVICE)  # its first window from zero
    checkpoints = ring[:, :3].clone()  # slot 2: the snapshots'
    kept = [torch.zeros(7, 2 * WINDOW, HEADS, *size, dtype=t, device=DEVICE)
            for size, t in (((DK,), dtype), ((DV,), dtype), ((), torch.float32), ((), dtype))]
    replay, last, kinds = torch.zeros_like(lines), ring.clone(), set()
    for w, counts in enumerate(WINDOW_COUNTS + [[0] * requests]):
        q, k, v, g, beta, _ = _inputs(sum(counts), dtype, seed=10 + w)
        counts_, half = _i64(counts), w % 2  # the slot and half written last
        firsts = torch.cumsum(counts_, 0) - counts_
        read = torch.where(fresh & (w == 0), -1, half)
        before = checkpoints.clone()
        snapshots = _i64([(a + w + i) % (a + 2) - 1 for i, a in enumerate(replay.tolist())])  # -1 .. replayed
        with K.use_backend(backend):
            out = K.gated_delta_replay_scan(q, k, v, g, beta, checkpoints, *kept, lines, read,
                                            torch.full_like(lines, half * WINDOW), replay,
                                            torch.full_like(lines, 1 - half),
                                            torch.full_like(lines, (1 - half) * WINDOW), firsts, counts_,
                                            snapshots, torch.full_like(lines, 2), scale=DK ** -0.5)
            expected = K.gated_delta_scan(q, k, v, g, beta, ring, lines, read.clamp(max=0), firsts, counts_,
                                          lines.repeat_interleave(counts_), torch.arange(len(q), device=DEVICE) -
                                          firsts.repeat_interleave(counts_) + 1, scale=DK ** -0.5)
        assert torch.equal(out, expected)
        assert torch.equal(checkpoints[lines, 1 - half], ring[lines, 0] * (read >= 0)[:, None, None, None])
        assert torch.equal(checkpoints[:, half], before[:, half]) and torch.equal(checkpoints[6], before[6])
        # the per-position scan's state after that many tokens of the last window (entry 0: its start)
        snapshot = last[lines, snapshots.clamp(min=0)] * (read >= 0)[:, None, None, None]
        expected_snapshot = torch.where((snapshots >= 0)[:, None, None, None], snapshot, before[lines, 2])
        kinds |= {"none" if n < 0 else "start" if n == 0 else "all" if n == a else "part"
                  for n, a in zip(snapshots.tolist(), replay.tolist())}
        assert torch.equal(checkpoints[lines, 2], expected_snapshot)
        if w < len(WINDOW_COUNTS):
            replay, last = _i64(ACCEPTED[w]), ring.clone()
            last[lines[read < 0], 0] = 0  # the window's start (a fresh line's: zero)
            ring[lines, 0] = ring[lines, replay]  # the per-position form's rollback: the state after the prefix
    assert kinds == {"none", "start", "part", "all"}


def test_gated_delta_replay_scan_refuses_bad_addressing_by_name():
    q, k, v, g, beta, states = _inputs(4, torch.float32)
    kept = [torch.zeros(2, 8, HEADS, *size, device=DEVICE) for size in ((DK,), (DV,), (), ())]
    one = torch.ones(1, dtype=I64, device=DEVICE)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, checkpoints=states[:2, :2].clone(), kept_k=kept[0], kept_v=kept[1],
                kept_g=kept[2], kept_beta=kept[3], lines=one, read_entries=one * 0, replay_entries=one * 0,
                replay_counts=one * 4, write_entries=one, keep_entries=one * 4, first_tokens=one * 0,
                token_counts=one * 4, scale=0.25)
    K.gated_delta_replay_scan(**args)
    with pytest.raises(ValueError, match="checkpoints must be"):
        K.gated_delta_replay_scan(**{**args, "checkpoints": states[:2, :2, :, :, :5].clone()})
    with pytest.raises(TypeError, match="kept_k must have dtype"):
        K.gated_delta_replay_scan(**{**args, "kept_k": kept[0].half()})
    with pytest.raises(ValueError, match="snapshot_counts and snapshot_entries must be given together"):
        K.gated_delta_replay_scan(**{**args, "snapshot_counts": one})
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="must not overlap"):
            K.gated_delta_replay_scan(**{**args, "keep_entries": one * 2})
        with pytest.raises(ValueError, match="keep_entries"):
            K.gated_delta_replay_scan(**{**args, "keep_entries": one * 5})
        with pytest.raises(ValueError, match="write_entries"):
            K.gated_delta_replay_scan(**{**args, "write_entries": one * 2})
        with pytest.raises(ValueError, match="lines must lie"):
            K.gated_delta_replay_scan(**{**args, "lines": one * 2})
        for count, entry in ((5, 0), (-2, 0), (4, 2)):  # past the replay, below -1, no such slot
            with pytest.raises(ValueError, match=r"snapshot_counts\[r\] must lie in -1 .. replay_counts\[r\]"):
                K.gated_delta_replay_scan(**{**args, "snapshot_counts": one * count, "snapshot_entries": one * entry})


def test_gated_delta_scan_refuses_bad_inputs_by_name():
    q, k, v, g, beta, states = _inputs(4, torch.float32)
    one = torch.zeros(1, dtype=I64, device=DEVICE)
    lines = torch.zeros(4, dtype=I64, device=DEVICE)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, states=states, read_lines=one, read_entries=one, first_tokens=one,
                token_counts=one + 4, write_lines=lines, write_entries=lines, scale=0.25)
    with pytest.raises(ValueError, match="states must be"):
        K.gated_delta_scan(**{**args, "states": states[:, :, :, :, :5]})
    with pytest.raises(TypeError, match="g"):
        K.gated_delta_scan(**{**args, "g": g.half()})
    mamba = dict(x=v, dt=g, a=g[0], b=k[:, :1], c=k[:, :1], d=g[0], states=torch.zeros(2, 2, HEADS, DV, DK,
                                                                                      device=DEVICE))
    addressing = {name: args[name] for name in ("read_lines", "read_entries", "first_tokens", "token_counts",
                                                "write_lines", "write_entries")}
    with pytest.raises(ValueError, match="b must be"):  # 3 heads over 2 groups
        K.selective_state_scan(**{**mamba, "b": k[:, :2], "c": k[:, :2]}, **addressing)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="first_tokens"):
            K.gated_delta_scan(**{**args, "token_counts": one + 5})
    x, weight, bias, ring = _conv_inputs(4, 6, 3, 2, 4, torch.float32)
    conv = dict(x=x, weight=weight, bias=bias, states=ring, read_entries=torch.zeros(1, 2, dtype=I64, device=DEVICE),
                **{name: addressing[name] for name in ("read_lines", "first_tokens", "token_counts", "write_lines",
                                                       "write_entries")})
    with pytest.raises(ValueError, match="read_entries must have shape"):  # kernel 3: two entries per request
        K.causal_conv_window(**{**conv, "read_entries": one})
    with pytest.raises(TypeError, match="states must have dtype"):
        K.causal_conv_window(**{**conv, "states": ring.bfloat16()})
    with pytest.raises(ValueError, match="weight must be"):
        K.causal_conv_window(**{**conv, "weight": weight[:5]})



def _conv_inputs(n: int, channels: int, kernel: int, lines: int, entries: int, dtype, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, generator=gen)
    weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen)
    states = torch.randn(lines, entries, channels, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (x, weight, bias, states)]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_window_is_conv1d_over_each_tokens_inputs(backend, dtype):
    """Requests from position 0, from ring entries (one window crossing the ring's end), one with
    more tokens than the ring has entries (its last tokens overwrite entries its first ones read:
    they read the old inputs), one with no tokens, two padding tokens no request names, a write sent
    to the scratch line: ``F.conv1d`` over each token's inputs, every token's input at its entry."""
    kernel, channels, entries, n = 4, 20, 6, 16
    x, weight, bias, states = _conv_inputs(n, channels, kernel, 5, entries, dtype)
    # (line, entries read oldest first, first token, count); entries of positions start-3 .. start-1
    requests = [(1, [-1, -1, -1], 0, 3), (2, [-1, 0, 1], 3, 2), (3, [4, 5, 0], 5, 8), (0, [1, 2, 3], 13, 0),
                (0, [3, 4, 5], 13, 1)]
    lines, reads, firsts, counts = (_i64([r[i] for r in requests]) for i in range(4))
    write_lines = _i64([1, 1, 1, 2, 2, 4, 4, 3, 3, 3, 3, 3, 3, 0, 4, 4])  # 4: scratch (masked writes)
    write_entries = _i64([0, 1, 2, 2, 3, 1, 2, 3, 4, 5, 0, 1, 2, 0, 0, 0])
    before = states.clone()
    with K.use_backend(backend):
        out = K.causal_conv_window(x, weight, bias, states, lines, reads, firsts, counts, write_lines, write_entries)
    expected_states = before.clone()
    for line, read, first, count in requests:
        ring = torch.stack([before[line, e] if e >= 0 else torch.zeros_like(before[0, 0]) for e in read])
        inputs = torch.cat([ring, x[first:first + count]]).float()
        for t in range(count):
            window = inputs[t:t + kernel].T[None]  # [1, C, K]
            conv = torch.nn.functional.conv1d(window, weight.float()[:, None], bias.float(), groups=channels)
            torch.testing.assert_close(out[first + t].float(), conv[0, :, 0].to(dtype).float(), atol=1e-5,
                                       rtol=1e-5 if dtype == torch.float32 else 8e-3)
            expected_states[write_lines[first + t], write_entries[first + t]] = x[first + t]
    real = slice(0, 4)  # the scratch line holds any of the masked writes
    assert torch.equal(states[real], expected_states[real])


def _forward(pool: hybrid.StatePool, requests: list[tuple[int, int, int]], padding: int) -> hybrid.Forward:
    """A forward of two ragged groups: ``requests`` ``(line, start position, tokens)``, the first two
    in a group of their own; ``padding`` tokens of a padding request (the dummy line 0, position 0)."""
    groups, slots, positions, lo = [], [], [], 0
    for part in (requests[:2], requests[2:] + [(0, 0, padding)]):
        counts = [c for _, _, c in part]
        cu = torch.tensor([0] + counts).cumsum(0).int()
        groups.append((lo, lo + int(cu[-1]), AttentionBatch(torch.tensor([s for s, _, _ in part]).int(),
                                                            torch.tensor([p for _, p, _ in part]).int(), cu,
                                                            max(counts))))
        for line, start, count in part:
            slots += [line] * count
            positions += range(start, start + count)
        lo += int(cu[-1])
    return hybrid.Forward(pool, hybrid.Tokens.of(torch.tensor(slots), torch.tensor(positions), groups))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_causal_conv_through_the_kernel_is_its_pytorch_path(backend, prefix_caching, frozen, monkeypatch):
    """``hybrid.causal_conv`` on ``WINDOW_SCAN_DEVICES`` (``K.causal_conv_window``) against its
    PyTorch path on the CPU (``F.conv1d``), fp32: a forward of ragged groups -- requests at position
    0, across the ring's end, a prompt chunk longer than the ring, a padding request, with prefix
    caching's block-end entries or not, frozen (every write to scratch) or not -- gives the same
    outputs (to fp32 rounding) and the same rings, exactly, on every line but the scratch one."""
    kernel, channels, verify = 4, 24, 3
    layout = hybrid.StateLayout.of(verify, 4, 1) if prefix_caching else hybrid.StateLayout(verify)
    entries = verify + kernel - 1 + layout.boundaries * (kernel - 1)
    conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
    ring = torch.randn(7, entries, channels, generator=torch.Generator().manual_seed(3))
    requests = [(1, 0, 3), (2, 5, 2), (3, 13, 3), (4, 2, 14), (5, 9, 1)]
    x = torch.randn(sum(c for *_, c in requests) + 2, channels, generator=torch.Generator().manual_seed(4))
    rings = []
    for on in (set(), {"cpu"}):
        monkeypatch.setattr(hybrid, "WINDOW_SCAN_DEVICES", on)
        pool = hybrid.StatePool({0: hybrid.LayerStates(ring.clone(), kernel=kernel)}, layout)
        current = _forward(pool, requests, padding=2)
        with torch.no_grad(), K.use_backend(backend), pool.frozen_writes() if frozen else contextlib.nullcontext():
            out = hybrid.causal_conv(x, conv, pool.layers[0].conv, current)
        rings.append((out, pool.layers[0].conv))
    (expected, expected_ring), (out, got_ring) = rings
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_ring[:-1], expected_ring[:-1])
    if frozen:
        assert torch.equal(got_ring[:-1], ring[:-1])


@gpu
def test_gated_delta_scan_at_qwen35_sizes_equals_fla_per_position():
    """On CUDA, Qwen3.5-9B's sizes (32 value heads of 128 x 128, bf16 inputs): the window kernel's
    outputs and states equal flash-linear-attention's fused recurrent kernel run one position at a
    time (what the engine ran before it) over 64 requests of 8 tokens, from ring entries."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    requests, window, heads, dk, dv = 64, 8, 32, 128, 128
    n, gen = requests * window, torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, heads, d, generator=gen, device="cuda").bfloat16() for d in (dk, dk, dv))
    g = -torch.rand(n, heads, generator=gen, device="cuda")
    beta = torch.rand(n, heads, generator=gen, device="cuda").bfloat16()
    states = torch.randn(requests + 1, window + 1, heads, dk, dv, generator=gen, device="cuda") * 0.1
    before = states.clone()
    lines = torch.arange(requests, device="cuda")
    firsts = lines * window
    write_lines = lines.repeat_interleave(window)
    write_entries = torch.arange(n, device="cuda") % window + 1  # entry 0 holds the start state
    out = K.gated_delta_scan(q, k, v, g, beta, states, lines, torch.zeros_like(lines), firsts,
                             torch.full_like(lines, window), write_lines, write_entries, scale=dk ** -0.5)
    state = before[lines, 0]
    for i in range(window):
        at = firsts + i
        o, state = fused_recurrent_gated_delta_rule(q[at, None], k[at, None], v[at, None], g=g[at, None],
                                                    beta=beta[at, None], initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[at].float(), o[:, 0].float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(states[lines, i + 1], state, atol=1e-4, rtol=1e-4)


@gpu
def test_gated_delta_replay_scan_at_qwen35_sizes_equals_the_reference_and_the_per_position_scan():
    """On CUDA, Qwen3.5-9B's sizes (32 value heads of 128 x 128, bf16 inputs), 64 requests of 8 tokens
    in two windows (every 8th request's first from zero; accepted prefixes 0 .. 8 of the first): the
    Triton replay kernel's outputs, checkpoints and kept inputs equal its PyTorch reference's, and its
    second checkpoints the per-position kernel's states after the accepted prefixes."""
    requests, window, heads, dk, dv = 64, 8, 32, 128, 128
    n, gen = requests * window, torch.Generator(device="cuda").manual_seed(0)
    lines = torch.arange(requests, device="cuda")
    firsts, counts = lines * window, torch.full_like(lines, window)
    start = torch.randn(requests + 1, 2, heads, dk, dv, generator=gen, device="cuda") * 0.1  # slot 0 is read first
    kept = [torch.zeros(requests + 1, 2 * window, heads, *size, dtype=dtype, device="cuda")
            for size, dtype in (((dk,), torch.bfloat16), ((dv,), torch.bfloat16), ((), torch.float32),
                                ((), torch.bfloat16))]
    states = {"triton": (start.clone(), [t.clone() for t in kept]),
              "reference": (start.clone(), [t.clone() for t in kept])}

    def window_inputs():  # q, k, v, g, beta of one window's tokens
        q, k, v = (torch.randn(n, heads, d, generator=gen, device="cuda").bfloat16() for d in (dk, dk, dv))
        g = -torch.rand(n, heads, generator=gen, device="cuda")
        return q, k, v, g, torch.rand(n, heads, generator=gen, device="cuda").bfloat16()

    windows = [window_inputs() for _ in range(2)]
    from_zero = torch.where(lines % 8 == 0, -1, 0)
    accepted = lines % (window + 1)
    outs = {}
    for backend, (checkpoints, kept_) in states.items():
        with K.use_backend(backend):  # window w: checkpoint slot and kept half w read, the others written
            outs[backend] = [K.gated_delta_replay_scan(*inputs, checkpoints, *kept_, lines, read,
                                                       torch.full_like(lines, w * window), replay,
                                                       torch.full_like(lines, 1 - w),
                                                       torch.full_like(lines, (1 - w) * window), firsts, counts,
                                                       scale=dk ** -0.5)
                             for w, (inputs, read, replay) in enumerate(zip(
                                 windows, (from_zero, torch.ones_like(lines)), (torch.zeros_like(lines), accepted)))]
    for got, expected in zip(outs["triton"], outs["reference"]):
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(states["triton"][0], states["reference"][0], atol=1e-4, rtol=1e-4)
    for got, expected in zip(states["triton"][1], states["reference"][1]):
        assert torch.equal(got, expected)
    ring = torch.zeros(requests + 1, window + 1, heads, dk, dv, device="cuda")  # entry 0: the first window's start
    ring[lines, 0] = torch.where((from_zero >= 0)[:, None, None, None], start[lines, 0], 0.0)
    per_position = K.gated_delta_scan(*windows[0], ring, lines, from_zero, firsts, counts,
                                      lines.repeat_interleave(window), torch.arange(n, device="cuda") % window + 1,
                                      scale=dk ** -0.5)
    torch.testing.assert_close(outs["triton"][0], per_position)  # the same steps: equal but for FMA contraction
    torch.testing.assert_close(states["triton"][0][lines, 0], ring[lines, accepted], atol=1e-5, rtol=1e-5)


@gpu
def test_selective_state_scan_at_bamba_sizes_equals_transformers_step():
    """On CUDA, Bamba-9B's Mamba-2 sizes (128 heads of head_dim 64, d_state 128, one group; bf16
    inputs) over 64 requests of 8 tokens: the window kernel's outputs and states equal transformers'
    recurrent step run one position at a time in float64 (the truth), at least as closely as that
    step run in bf16 (which rounds the state to bf16 before its contraction with C)."""
    from transformers.models.bamba.modeling_bamba import mamba2_selective_state_update

    requests, window, heads, head_dim, size = 64, 8, 128, 64, 128
    n, gen = requests * window, torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, heads, head_dim, generator=gen, device="cuda").bfloat16()
    dt = (torch.rand(n, heads, generator=gen, device="cuda") * 0.1).bfloat16()
    a = -torch.rand(heads, generator=gen, device="cuda") - 0.5
    b, c = (torch.randn(n, 1, size, generator=gen, device="cuda").bfloat16() for _ in range(2))
    d = torch.randn(heads, generator=gen, device="cuda").bfloat16()
    states = torch.randn(requests + 1, window + 1, heads, head_dim, size, generator=gen, device="cuda") * 0.1
    before = states.clone()
    lines = torch.arange(requests, device="cuda")
    firsts = lines * window
    write_entries = torch.arange(n, device="cuda") % window + 1  # entry 0 holds the start state
    out = K.selective_state_scan(x, dt, a, b, c, d, states, lines, torch.zeros_like(lines), firsts,
                                 torch.full_like(lines, window), lines.repeat_interleave(window), write_entries)

    def step(state, at, dtype):
        return mamba2_selective_state_update(
            state, x[at].to(dtype), dt[at, :, None].expand(-1, -1, head_dim).to(dtype),
            a[:, None, None].expand(-1, head_dim, size).to(dtype), b[at].to(dtype), c[at].to(dtype),
            d[:, None].expand(-1, head_dim).to(dtype))

    truth, hf = before[lines, 0].double(), before[lines, 0].clone()
    for i in range(window):
        at = firsts + i
        exact, rounded = step(truth, at, torch.float64), step(hf, at, torch.bfloat16)
        ours_error = (out[at].double() - exact).abs().max().item()
        assert ours_error <= max((rounded.double() - exact).abs().max().item(), 1e-2), (i, ours_error)
        torch.testing.assert_close(out[at].double(), exact, atol=4e-2, rtol=1e-2)
        torch.testing.assert_close(states[lines, i + 1].double(), truth, atol=1e-4, rtol=1e-4)


@gpu
def test_causal_conv_window_at_qwen35_sizes_equals_the_reference():
    """On CUDA, Qwen3.5-9B's gated DeltaNet conv (8,192 channels, kernel 4, bf16) over 64 requests of
    8 tokens from ring entries (a few from position 0): the Triton kernel's outputs equal the PyTorch
    reference's (f32 sums in the same order: to bf16 rounding), the rings exactly."""
    requests, window, channels, kernel = 64, 8, 8192, 4
    entries = window + kernel - 1
    n, gen = requests * window, torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, channels, generator=gen, device="cuda").bfloat16()
    weight = torch.randn(channels, kernel, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(channels, generator=gen, device="cuda").bfloat16()
    states = torch.randn(requests + 1, entries, channels, generator=gen, device="cuda").bfloat16()
    lines = torch.arange(requests, device="cuda")
    starts = torch.where(lines % 8 == 0, 0, 5 + lines)  # every 8th request at position 0
    before_first = starts[:, None] - torch.arange(kernel - 1, 0, -1, device="cuda")
    read_entries = torch.where(before_first >= 0, before_first % entries, -1)
    positions = starts.repeat_interleave(window) + torch.arange(n, device="cuda") % window
    addressing = (lines, read_entries, lines * window, torch.full_like(lines, window),
                  lines.repeat_interleave(window), positions % entries)
    reference_states = states.clone()
    with K.use_backend("triton"):
        out = K.causal_conv_window(x, weight, bias, states, *addressing)
    with K.use_backend("reference"):
        expected = K.causal_conv_window(x, weight, bias, reference_states, *addressing)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(states, reference_states)
