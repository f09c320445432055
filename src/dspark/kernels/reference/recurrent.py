"""PyTorch reference of the recurrent family (contracts: ``dspark.kernels.gated_delta_scan``,
``gated_delta_replay_scan``, ``selective_state_scan``, ``causal_conv_window``)."""

from __future__ import annotations

import torch

__all__ = ["causal_conv_window", "gated_delta_replay_scan", "gated_delta_scan", "selective_state_scan"]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_scan(q, k, v, g, beta, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                     write_entries, scale):
    out = torch.empty_like(v)
    for r in range(read_lines.shape[0]):
        entry = int(read_entries[r])
        state = (states[read_lines[r], entry].clone() if entry >= 0
                 else states.new_zeros(states.shape[2:]))  # [HV, dk, dv]
        for n in range(int(first_tokens[r]), int(first_tokens[r] + token_counts[r])):
            state = _delta_step(state, k[n], v[n], g[n], beta[n])
            out[n] = _read_out(state, q[n], scale, out.dtype)
            states[write_lines[n], write_entries[n]] = state
    return out


def gated_delta_replay_scan(q, k, v, g, beta, checkpoints, kept_k, kept_v, kept_g, kept_beta, lines, read_entries,
                            replay_entries, replay_counts, write_entries, keep_entries, first_tokens, token_counts,
                            snapshot_counts, snapshot_entries, scale):
    out = torch.empty_like(v)
    for r in range(lines.shape[0]):
        line, entry, snapshot = int(lines[r]), int(read_entries[r]), int(snapshot_counts[r])
        state = checkpoints[line, entry].clone() if entry >= 0 else checkpoints.new_zeros(checkpoints.shape[2:])
        for replayed, e in enumerate(range(int(replay_entries[r]), int(replay_entries[r] + replay_counts[r]) + 1)):
            if replayed == snapshot:
                checkpoints[line, snapshot_entries[r]] = state
            if replayed < replay_counts[r]:
                state = _delta_step(state, kept_k[line, e], kept_v[line, e], kept_g[line, e], kept_beta[line, e])
        checkpoints[line, write_entries[r]] = state
        first, keep = int(first_tokens[r]), int(keep_entries[r])
        for t in range(int(token_counts[r])):
            n = first + t
            state = _delta_step(state, k[n], v[n], g[n], beta[n])
            out[n] = _read_out(state, q[n], scale, out.dtype)
            kept_k[line, keep + t], kept_v[line, keep + t] = k[n], v[n]
            kept_g[line, keep + t], kept_beta[line, keep + t] = g[n], beta[n]
    return out


def _delta_step(state, k, v, g, beta):
    """The state ``[HV, dk, dv]`` after one token's ``k`` ``[HV, dk]``, ``v`` ``[HV, dv]``, ``g``, ``beta`` ``[HV]``."""
    k = _unit(k.float())
    state = state * g.exp()[:, None, None]
    u = beta.float()[:, None] * (v.float() - (state * k[:, :, None]).sum(1))
    return state + k[:, :, None] * u[:, None, :]


def _read_out(state, q, scale, dtype):
    """``S^T q`` of the normalised, scaled ``q`` ``[HV, dk]``: ``[HV, dv]`` in ``dtype``."""
    return (state * (_unit(q.float()) * scale)[:, :, None]).sum(1).to(dtype)


def selective_state_scan(x, dt, a, b, c, d, states, read_lines, read_entries, first_tokens, token_counts,
                         write_lines, write_entries):
    out = torch.empty_like(x)
    per_group = x.shape[1] // b.shape[1]
    for r in range(read_lines.shape[0]):
        entry = int(read_entries[r])
        state = (states[read_lines[r], entry].clone() if entry >= 0
                 else states.new_zeros(states.shape[2:]))  # [heads, head_dim, d_state]
        for n in range(int(first_tokens[r]), int(first_tokens[r] + token_counts[r])):
            dt_n = dt[n].float()[:, None, None]
            b_n, c_n = (t[n].float().repeat_interleave(per_group, 0)[:, None, :] for t in (b, c))
            state = torch.exp(dt_n * a[:, None, None]) * state + dt_n * b_n * x[n].float()[:, :, None]
            out[n] = ((state * c_n).sum(-1) + d.float()[:, None] * x[n].float()).to(out.dtype)
            states[write_lines[n], write_entries[n]] = state
    return out


def causal_conv_window(x, weight, bias, states, read_lines, read_entries, first_tokens, token_counts, write_lines,
                       write_entries):
    out = torch.empty_like(x)
    taps, w = weight.shape[1] - 1, weight.float()
    for r in range(read_lines.shape[0]):
        entries = read_entries[r]
        before = states[read_lines[r], entries.clamp(min=0)] * (entries >= 0)[:, None]  # [K - 1, C], zero at < 0
        first, count = int(first_tokens[r]), int(token_counts[r])
        inputs = torch.cat([before, x[first:first + count]]).float()  # the request's inputs, oldest first
        for t in range(count):
            total = inputs[t] * w[:, 0]
            for i in range(1, taps + 1):  # summed oldest first
                total = total + inputs[t + i] * w[:, i]
            out[first + t] = (total if bias is None else total + bias.float()).to(out.dtype)
    for r in range(read_lines.shape[0]):  # after every read
        for n in range(int(first_tokens[r]), int(first_tokens[r] + token_counts[r])):
            states[write_lines[n], write_entries[n]] = x[n]
    return out
