"""Recurrent family: a verify window through a hybrid target's stateful layer in one pass, the state
after every position written where the engine's rollback reads it.

A hybrid target's stateful layer runs a round's tokens in order, and an exact rollback to any
accepted prefix needs the state after each of them. Run one position at a time (a fused recurrent
kernel per position), each position reads and writes every request's whole f32 state
(``[heads, dk, dv]``, 2 MiB per request and layer on Qwen3.5-9B) several times over; here one
program per (request, head, value block) keeps its slice of the state in registers for the whole
window, reads it once and writes it once per position, straight into its ring entry.

* ``gated_delta_scan(q, k, v, g, beta, states, ...)`` -- the gated delta rule (Qwen3-Next /
  Qwen3.5 / OLMo-Hybrid), flash-linear-attention's ``fused_recurrent_gated_delta_rule`` with
  ``use_qk_l2norm_in_kernel=True``, over ragged requests of flat tokens;
* ``selective_state_scan(x, dt, a, b, c, d, states, ...)`` -- Mamba-2's selective state update
  (Bamba, Granite-4, Falcon-H1, Nemotron-H, Mamba2), transformers' ``mamba2_selective_state_update``
  position by position, likewise;
* ``causal_conv_window(x, weight, bias, states, ...)`` -- the short depthwise causal conv before
  them (and LFM2's), each token's ``kernel`` inputs from this forward's tokens of its request and the
  ring of earlier inputs, each token's input written into its ring entry.

* ``gated_delta_replay_scan(q, k, v, g, beta, checkpoints, kept_k, ...)`` -- the same rule in
  *checkpoint + replay* form, the alternative to a state per position: per line only the state at
  the start of its last window (the checkpoint) and that window's per-token inputs (``k``, ``v``,
  ``g``, ``beta``: a few KB a token, where a state is 2 MiB); the next window's call replays the
  accepted prefix of the last one from the kept inputs (known only now), writes the new checkpoint,
  then runs its own tokens and keeps their inputs. Per request and layer one state read and one
  state write instead of one write per position; its own addressing (its docstring).

The first three address requests and states alike (the *addressing*): per request r (int64 ``[R]`` each),
tokens ``first_tokens[r] .. + token_counts[r] - 1`` of the flat inputs, from the state
``states[read_lines[r], read_entries[r]]`` (zero where ``read_entries[r] < 0``); ``states`` f32
``[lines, entries, heads, ...]`` is updated in place, the state after token n going to
``states[write_lines[n], write_entries[n]]`` (int64 ``[N]`` each); rows of tokens no request names
are left unwritten in the output. (``causal_conv_window`` reads ``kernel - 1`` entries per request and
writes each token's input, not a state; its docstring says how.)

Values are not checked on CUDA tensors (ids and lengths there come from the engine).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import implementation
from ._validate import HALF_DTYPES, Checker

__all__ = ["Replay", "causal_conv_window", "gated_delta_replay_scan", "gated_delta_scan", "selective_state_scan"]

_FLOAT = (torch.float32,) + HALF_DTYPES
_INDEX = torch.int64


def gated_delta_scan(q, k, v, g, beta, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                     write_entries, scale: float):
    """The gated delta rule over each request's tokens in order; returns ``out`` ``[N, HV, dv]`` in
    ``v``'s dtype.

    Addressing: module docstring. ``q``, ``k`` ``[N, HV, dk]``, ``v`` ``[N, HV, dv]`` (f32 / f16 /
    bf16), ``g`` f32 ``[N, HV]`` (log decay), ``beta`` ``[N, HV]`` (any float dtype); ``states`` f32
    ``[lines, entries, HV, dk, dv]``. Per token, in f32::

        q, k = q / sqrt(|q|^2 + 1e-6) * scale, k / sqrt(|k|^2 + 1e-6)
        S = exp(g) * S;  u = beta * (v - S^T k);  S = S + k u^T;  out = S^T q

    (flash-linear-attention's fused recurrent kernel, ``use_qk_l2norm_in_kernel=True``; ``scale`` is
    usually ``dk ** -0.5``).
    """
    c = Checker("gated_delta_scan")
    inputs = _delta_inputs(c, q, k, v, g, beta)
    n, heads, dk = q.shape
    states = _states(c, states, q.device, [heads, dk, v.shape[2]])
    addressing = _addressing(c, n, q.device, read_lines, read_entries, first_tokens, token_counts, write_lines,
                             write_entries)
    scale = c.real("scale", scale, low=0.0)
    args = (*inputs, states, *addressing, scale)
    return implementation("gated_delta_scan", q.device, *args[:6])(*args)


def gated_delta_replay_scan(q, k, v, g, beta, checkpoints, kept_k, kept_v, kept_g, kept_beta, lines, read_entries,
                            replay_entries, replay_counts, write_entries, keep_entries, first_tokens, token_counts,
                            snapshot_counts=None, snapshot_entries=None, *, scale: float):
    """The gated delta rule over each request's tokens from its line's checkpoint advanced through
    the accepted prefix of its last window; returns ``out`` ``[N, HV, dv]`` in ``v``'s dtype.

    ``q``, ``k``, ``v``, ``g``, ``beta`` and the rule per token as ``gated_delta_scan``.
    ``checkpoints`` f32 ``[lines, slots, HV, dk, dv]``: per line states at the start of a window;
    ``kept_k`` ``[lines, entries, HV, dk]`` (``k``'s dtype), ``kept_v`` ``[lines, entries, HV, dv]``
    (``v``'s), ``kept_g`` f32 and ``kept_beta`` (``beta``'s) ``[lines, entries, HV]``: per line the
    inputs of its windows' tokens, as given (``k`` not normalised). Per request r (int64 ``[R]``
    each), on line ``lines[r]``:

    1. the state starts from ``checkpoints[line, read_entries[r]]`` (zero where ``read_entries[r] <
       0``: nothing before);
    2. it is advanced through the ``replay_counts[r]`` kept tokens at entries ``replay_entries[r]
       ..`` -- the accepted prefix of the last window, without outputs, the same steps as that
       window's own -- and written to ``checkpoints[line, write_entries[r]]``: the state at this
       window's start (the read entry itself, or another: a caller that alternates two leaves the
       line's state as it was until it switches, e.g. after a forward that failed half way); where
       ``snapshot_counts[r] >= 0`` (at most ``replay_counts[r]``), the state after that many replayed
       tokens (0: the start state) is also written to ``checkpoints[line, snapshot_entries[r]]`` --
       the state at a block end the replay passes, for the prefix cache (None, None: no such writes);
    3. it runs the request's tokens ``first_tokens[r] .. + token_counts[r] - 1`` with outputs,
       their inputs kept at entries ``keep_entries[r] ..`` of the line (the next call replays them).

    So the written checkpoint equals ``gated_delta_scan``'s state after the accepted prefix, to the
    bit where both run the same backend's steps in the same order; the state after this window's
    tokens is written nowhere. The kept entries a request replays and those it keeps must not
    overlap; a line two requests name (a caller's scratch line) holds either's writes, and its reads
    are then undefined.
    """
    c = Checker("gated_delta_replay_scan")
    inputs = _delta_inputs(c, q, k, v, g, beta)
    n, heads, dk = q.shape
    dv, device = v.shape[2], q.device
    checkpoints = c.tensor("checkpoints", checkpoints, dtype=torch.float32, ndim=5, device=device, contiguous=True)
    if list(checkpoints.shape[2:]) != [heads, dk, dv]:
        c.fail(f"checkpoints must be [lines, slots, {heads}, {dk}, {dv}], got shape {list(checkpoints.shape)}")
    lines_count, slots = checkpoints.shape[:2]
    kept_k = c.tensor("kept_k", kept_k, dtype=k.dtype, ndim=4, device=device, contiguous=True)
    if kept_k.shape[0] != lines_count or list(kept_k.shape[2:]) != [heads, dk]:
        c.fail(f"kept_k must be [{lines_count}, entries, {heads}, {dk}], got shape {list(kept_k.shape)}")
    entries = kept_k.shape[1]
    kept_v = c.tensor("kept_v", kept_v, dtype=v.dtype, shape=[lines_count, entries, heads, dv], device=device,
                      contiguous=True)
    kept_g = c.tensor("kept_g", kept_g, dtype=torch.float32, shape=[lines_count, entries, heads], device=device,
                      contiguous=True)
    kept_beta = c.tensor("kept_beta", kept_beta, dtype=beta.dtype, shape=[lines_count, entries, heads],
                         device=device, contiguous=True)
    lines = c.tensor("lines", lines, dtype=_INDEX, ndim=1, device=device).contiguous()
    if (snapshot_counts is None) != (snapshot_entries is None):
        c.fail("snapshot_counts and snapshot_entries must be given together (or neither), got "
               f"{'snapshot_counts' if snapshot_entries is None else 'snapshot_entries'} alone")
    if snapshot_counts is None:  # no snapshots: the kernels' addressing always has them
        snapshot_counts = torch.full_like(lines, -1)
        snapshot_entries = torch.zeros_like(lines)
    requests = (("read_entries", read_entries), ("replay_entries", replay_entries), ("replay_counts", replay_counts),
                ("write_entries", write_entries), ("keep_entries", keep_entries), ("first_tokens", first_tokens),
                ("token_counts", token_counts), ("snapshot_counts", snapshot_counts),
                ("snapshot_entries", snapshot_entries))
    addressing = Replay(lines, *(c.tensor(name, t, dtype=_INDEX, shape=[lines.shape[0]], device=device).contiguous()
                                 for name, t in requests))
    if device.type == "cpu":
        _check_spans(c, addressing.first_tokens, addressing.token_counts, n)
        _check_replay(c, addressing, lines_count, slots, entries)
    scale = c.real("scale", scale, low=0.0)
    args = (*inputs, checkpoints, kept_k, kept_v, kept_g, kept_beta, *addressing, scale)
    return implementation("gated_delta_replay_scan", device, *args[:6])(*args)


class Replay(NamedTuple):
    """``gated_delta_replay_scan``'s per-request addressing (int64 ``[R]`` each; its docstring;
    ``snapshot_counts`` / ``snapshot_entries`` None: no snapshot writes)."""

    lines: torch.Tensor
    read_entries: torch.Tensor
    replay_entries: torch.Tensor
    replay_counts: torch.Tensor
    write_entries: torch.Tensor
    keep_entries: torch.Tensor
    first_tokens: torch.Tensor
    token_counts: torch.Tensor
    snapshot_counts: torch.Tensor | None = None
    snapshot_entries: torch.Tensor | None = None


def _delta_inputs(c: Checker, q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    """The gated delta rule's per-token inputs ``q, k, v, g, beta`` (``gated_delta_scan``), checked and contiguous."""
    q = c.tensor("q", q, dtype=_FLOAT, ndim=3)
    n, heads, dk = q.shape
    device = q.device
    k = c.tensor("k", k, dtype=q.dtype, shape=[n, heads, dk], device=device)
    v = c.tensor("v", v, dtype=_FLOAT, ndim=3, device=device)
    if list(v.shape[:2]) != [n, heads]:
        c.fail(f"v must be [N, HV, dv] = [{n}, {heads}, dv], got shape {list(v.shape)}")
    g = c.tensor("g", g, dtype=torch.float32, shape=[n, heads], device=device)
    beta = c.tensor("beta", beta, dtype=_FLOAT, shape=[n, heads], device=device)
    return tuple(t.contiguous() for t in (q, k, v, g, beta))


def _check_replay(c: Checker, a: Replay, lines_count: int, slots: int, entries: int) -> None:
    """``gated_delta_replay_scan``'s lines, checkpoint slots and kept entries (CPU values): in range,
    and each request's replayed and kept entries apart."""
    def fail_unless(ok: torch.Tensor, what: str, names: tuple[str, ...]):
        if not bool(ok.all()):
            c.fail(f"{what}, got " + " and ".join(f"{name} {getattr(a, name).tolist()}" for name in names))

    fail_unless((a.lines >= 0) & (a.lines < lines_count), f"lines must lie in 0 .. {lines_count - 1}", ("lines",))
    fail_unless((a.read_entries >= -1) & (a.read_entries < slots) & (a.write_entries >= 0) & (a.write_entries < slots),
                f"read_entries must lie in -1 .. {slots - 1} and write_entries in 0 .. {slots - 1}",
                ("read_entries", "write_entries"))
    fail_unless((a.replay_counts >= 0) & (a.replay_entries >= 0) & (a.replay_entries + a.replay_counts <= entries),
                f"replay_entries[r] .. + replay_counts[r] - 1 must lie in 0 .. {entries - 1}",
                ("replay_entries", "replay_counts"))
    fail_unless((a.keep_entries >= 0) & (a.keep_entries + a.token_counts <= entries),
                f"keep_entries[r] .. + token_counts[r] - 1 must lie in 0 .. {entries - 1}",
                ("keep_entries", "token_counts"))
    snapshot = a.snapshot_counts >= 0
    fail_unless((a.snapshot_counts >= -1) & (a.snapshot_counts <= a.replay_counts) &
                (~snapshot | ((a.snapshot_entries >= 0) & (a.snapshot_entries < slots))),
                f"snapshot_counts[r] must lie in -1 .. replay_counts[r], and snapshot_entries[r] in 0 .. {slots - 1} "
                "where snapshot_counts[r] >= 0", ("snapshot_counts", "snapshot_entries", "replay_counts"))
    apart = (a.replay_counts == 0) | (a.token_counts == 0) | (a.replay_entries >= a.keep_entries + a.token_counts) | \
        (a.keep_entries >= a.replay_entries + a.replay_counts)
    fail_unless(apart, "the entries a request replays and those it keeps must not overlap",
                ("replay_entries", "replay_counts", "keep_entries", "token_counts"))


def selective_state_scan(x, dt, a, b, c, d, states, read_lines, read_entries, first_tokens, token_counts,
                         write_lines, write_entries):
    """Mamba-2's selective state update over each request's tokens in order (addressing: module
    docstring); returns ``out`` ``[N, heads, head_dim]`` in ``x``'s dtype.

    ``x`` ``[N, heads, head_dim]`` (f32 / f16 / bf16), ``dt`` ``[N, heads]`` (final: biased,
    softplus'd, clamped), ``a`` f32 ``[heads]`` (``-exp(A_log)``), ``b``, ``c`` ``[N, groups, d_state]``
    (heads split evenly over the groups), ``d`` ``[heads]``; ``states`` f32
    ``[lines, entries, heads, head_dim, d_state]``. Per token, in f32::

        S = exp(dt * a) * S + (dt * b) x^T;  out = S c + d * x

    (transformers' ``mamba2_selective_state_update``, which rounds ``dt * b``, its product with x and
    the state before the product with c to the model's dtype; here f32 throughout).
    """
    c_ = Checker("selective_state_scan")
    x = c_.tensor("x", x, dtype=_FLOAT, ndim=3)
    n, heads, head_dim = x.shape
    device = x.device
    dt = c_.tensor("dt", dt, dtype=_FLOAT, shape=[n, heads], device=device)
    a = c_.tensor("a", a, dtype=torch.float32, shape=[heads], device=device)
    b = c_.tensor("b", b, dtype=_FLOAT, ndim=3, device=device)
    groups, size = b.shape[1:]
    if b.shape[0] != n or groups < 1 or heads % groups:
        c_.fail(f"b must be [N, groups, d_state] = [{n}, groups dividing {heads}, d_state], got shape {list(b.shape)}")
    c = c_.tensor("c", c, dtype=_FLOAT, shape=[n, groups, size], device=device)
    d = c_.tensor("d", d, dtype=_FLOAT, shape=[heads], device=device)
    states = _states(c_, states, device, [heads, head_dim, size])
    addressing = _addressing(c_, n, device, read_lines, read_entries, first_tokens, token_counts, write_lines,
                             write_entries)
    args = (x.contiguous(), dt.contiguous(), a.contiguous(), b.contiguous(), c.contiguous(), d.contiguous(), states,
            *addressing)
    return implementation("selective_state_scan", device, *args[:7])(*args)


def causal_conv_window(x, weight, bias, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                       write_entries):
    """A depthwise causal conv (kernel ``K``) over each request's tokens; returns ``out`` ``[N, C]``
    in ``x``'s dtype.

    ``x`` ``[N, C]`` (f32 / f16 / bf16), ``weight`` ``[C, K]`` (a depthwise ``Conv1d``'s ``[C, 1,
    K]`` weight viewed so), ``bias`` ``[C]`` or None; ``states`` ``[lines, entries, C]`` in ``x``'s
    dtype, the ring of each line's earlier inputs. Per request r (int64 ``[R]`` each, as the module
    docstring's addressing) its tokens ``first_tokens[r] .. + token_counts[r] - 1``; the inputs
    before its first token are ``states[read_lines[r], read_entries[r, i]]`` (int64 ``[R, K - 1]``,
    oldest first: the input ``K - 1 - i`` positions before it; zero where ``read_entries[r, i] <
    0``, before position 0). Token n at index t among its request's tokens sees the ``K`` inputs
    ending at its own, ``u_0 .. u_{K-1}`` (oldest first: the ring's inputs before the request's
    first token, then ``x`` rows of its tokens), and gives, summed in f32 in that order::

        out[n] = u_0 * weight[:, 0] + ... + u_{K-1} * weight[:, K-1] + bias

    (``F.conv1d`` over those ``K`` inputs, oldest first; the Triton kernel fuses each product into
    the sum, and cuDNN's sums may differ from either in the last bit). Then each request's token n
    writes ``x[n]`` to ``states[write_lines[n], write_entries[n]]`` (int64 ``[N]``; tokens no
    request names write nothing): every read sees the ring as it was before the call. A line a
    request reads is written by no other request; an entry written by two tokens holds either (the
    caller writes each entry it keeps once and sends the other writes to a line nobody reads).
    """
    c = Checker("causal_conv_window")
    x = c.tensor("x", x, dtype=_FLOAT, ndim=2)
    n, channels = x.shape
    device = x.device
    weight = c.tensor("weight", weight, dtype=_FLOAT, ndim=2, device=device)
    if weight.shape[0] != channels or weight.shape[1] < 1:
        c.fail(f"weight must be [C, K] = [{channels}, K >= 1], got shape {list(weight.shape)}")
    kernel = weight.shape[1]
    if bias is not None:
        bias = c.tensor("bias", bias, dtype=_FLOAT, shape=[channels], device=device).contiguous()
    states = c.tensor("states", states, dtype=x.dtype, ndim=3, device=device, contiguous=True)
    if states.shape[2] != channels:
        c.fail(f"states must be [lines, entries, C] = [lines, entries, {channels}], got shape {list(states.shape)}")
    addressing = _addressing(c, n, device, read_lines, read_entries, first_tokens, token_counts, write_lines,
                             write_entries, taps=kernel - 1)
    args = (x.contiguous(), weight.contiguous(), bias, states, *addressing)
    return implementation("causal_conv_window", device, x, weight, states)(*args)


def _states(c: Checker, states, device, per_line: list[int]) -> torch.Tensor:
    states = c.tensor("states", states, dtype=torch.float32, ndim=5, device=device)
    if list(states.shape[2:]) != per_line:
        c.fail(f"states must be [lines, entries, {', '.join(map(str, per_line))}], got shape {list(states.shape)}")
    if not states.is_contiguous():
        c.fail("states must be contiguous (it is written in place)")
    return states


def _addressing(c: Checker, n: int, device, read_lines, read_entries, first_tokens, token_counts, write_lines,
                write_entries, taps: int | None = None) -> tuple[torch.Tensor, ...]:
    """The requests' and tokens' int64 addressing (module docstring), checked and contiguous;
    ``taps``: the entries each request reads (``read_entries`` ``[R, taps]``; None: one, ``[R]``)."""
    read_lines = c.tensor("read_lines", read_lines, dtype=_INDEX, ndim=1, device=device)
    requests = read_lines.shape[0]
    read_entries = c.tensor("read_entries", read_entries, dtype=_INDEX,
                            shape=[requests] if taps is None else [requests, taps], device=device)
    per_request = [read_entries] + [c.tensor(name, t, dtype=_INDEX, shape=[requests], device=device)
                                    for name, t in (("first_tokens", first_tokens), ("token_counts", token_counts))]
    per_token = [c.tensor(name, t, dtype=_INDEX, shape=[n], device=device)
                 for name, t in (("write_lines", write_lines), ("write_entries", write_entries))]
    if device.type == "cpu":
        _check_spans(c, per_request[1], per_request[2], n)
    return tuple(t.contiguous() for t in (read_lines, *per_request, *per_token))


def _check_spans(c: Checker, first_tokens: torch.Tensor, token_counts: torch.Tensor, n: int) -> None:
    if bool((token_counts < 0).any()) or bool((first_tokens < 0).any()) or \
            bool((first_tokens + token_counts > n).any()):
        c.fail(f"each request's tokens first_tokens[r] .. first_tokens[r] + token_counts[r] - 1 must lie in "
               f"0 .. {n - 1}, got first_tokens {first_tokens.tolist()} and token_counts {token_counts.tolist()}")
