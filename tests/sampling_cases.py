"""Random-input builders and literal oracles for the sampled path (shared by the sampling test files).

Builders take a ``seed`` (their own ``torch.Generator``, so results do not depend on test order) and a
``device``; tensors are built on the CPU and moved, so a case is identical on every device.

The oracles are plain-Python/numpy transcriptions of kernels.md 2.2-2.4 and 3.23 (one row, one loop,
float32 arithmetic), independent of the vectorised reference they check.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.kernels.reference import sampling as R

RUNTIME_SEED = 0x44535041524B2026  # the seed NVIDIA's runtime passes to dsparkFillUniforms
UNIFORM_MAX = np.float32(0.99999994)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ builders


def random_distributions(shape, vocab: int, *, zero_fraction: float = 0.3, seed: int = 0, device="cpu") -> torch.Tensor:
    """f32 ``[*shape, vocab]`` probability rows with about ``zero_fraction`` exact zeros (never all zero)."""
    g = generator(seed)
    weights = torch.rand(*shape, vocab, generator=g) ** 2
    zeros = torch.rand(*shape, vocab, generator=g) < zero_fraction
    keep = torch.randint(0, vocab, (*shape, 1), generator=g)
    zeros.scatter_(-1, keep, False)
    weights = torch.where(zeros, 0.0, weights)
    return (weights / weights.sum(-1, keepdim=True)).to(device)


def random_logits(rows: int, vocab: int, *, scale: float = 3.0, neg_inf_fraction: float = 0.0, seed: int = 0,
                  device="cpu") -> torch.Tensor:
    """f32 ``[rows, vocab]`` logits ~ N(0, scale^2), a fraction set to -inf (never a whole row)."""
    g = generator(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    masked = torch.rand(rows, vocab, generator=g) < neg_inf_fraction
    masked[:, 0] = False
    return torch.where(masked, float("-inf"), logits).to(device)


def markov_sample_inputs(batch: int, width: int, vocab: int, rank: int, *, dtype=torch.float16, logits_stride: int = 0,
                         logits_offset: int = 0, weight_scale: float = 0.5, seed: int = 0, device="cpu") -> dict:
    """Keyword arguments of ``vanilla_markov_sample`` (``temperature`` etc. left to the caller).

    ``backbone_logits`` is ``[B, L, V]`` with ``L = logits_stride or width``; weights ``[V, R]`` in
    ``dtype``; ``proposal_uniforms`` f32 ``[B, width]`` uniform in [0, 1).
    """
    g = generator(seed)
    rows = logits_stride or width
    return {
        "backbone_logits": (torch.randn(batch, rows, vocab, generator=g) * 2).to(device),
        "markov_w1": (torch.randn(vocab, rank, generator=g) * weight_scale).to(dtype).to(device),
        "markov_w2": (torch.randn(vocab, rank, generator=g) * weight_scale).to(dtype).to(device),
        "first_prev_tokens": torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32).to(device),
        "proposal_uniforms": torch.rand(batch, width, generator=g).to(device),
        "logits_stride": logits_stride,
        "logits_offset": logits_offset,
    }


def top_k_step_inputs(batch: int, width: int, k: int, vocab: int, *, seed: int = 0, device="cpu") -> dict:
    """One sparse draft step: ``top_k_values`` f32 ``[B, K]`` (descending), distinct ``top_k_indices``
    int32 ``[B, K]`` in ``[0, vocab)``, ``proposal_uniforms`` f32 ``[B, width]``, and zeroed buffers."""
    g = generator(seed)
    values = (torch.randn(batch, k, generator=g) * 2).sort(-1, descending=True).values
    indices = torch.rand(batch, vocab, generator=g).argsort(-1)[:, :k].to(torch.int32)
    return {
        "top_k_values": values.to(device),
        "top_k_indices": indices.to(device),
        "proposal_uniforms": torch.rand(batch, width, generator=g).to(device),
        "draft_token_ids": torch.zeros(batch, width, dtype=torch.int32, device=device),
        "draft_top_k_probabilities": torch.zeros(batch, width, k, device=device),
        "draft_top_k_indices": torch.zeros(batch, width, k, dtype=torch.int32, device=device),
    }


def accept_inputs(batch: int, stride: int, verify_proposal_len: int, vocab: int, *, zero_fraction: float = 0.3,
                  proposal_lengths=None, seed: int = 0, device="cpu") -> dict:
    """Keyword arguments of ``probabilistic_accept``: random target ``[B, P_v+1, V]`` and draft
    ``[B, S, V]`` distributions with zeros, drafts drawn from the draft rows, random uniforms.

    ``proposal_lengths`` defaults to random values in ``[0, S+1]`` (exercising the clamp).
    """
    g = generator(seed)
    target = random_distributions((batch, verify_proposal_len + 1), vocab, zero_fraction=zero_fraction, seed=seed + 1)
    draft = random_distributions((batch, stride), vocab, zero_fraction=zero_fraction, seed=seed + 2)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, stride).to(torch.int32)
    if proposal_lengths is None:
        proposal_lengths = torch.randint(0, stride + 2, (batch,), generator=g, dtype=torch.int32)
    return {
        "target_probabilities": target.to(device),
        "draft_probabilities": draft.to(device),
        "draft_token_ids": tokens.to(device),
        "proposal_lengths": torch.as_tensor(proposal_lengths, dtype=torch.int32).to(device),
        "accept_uniforms": torch.rand(batch, 2 * stride + 1, generator=g).to(device),
        "verify_proposal_len": verify_proposal_len,
    }


# ------------------------------------------------------------------------------ backend agreement of draws

# A Triton draw is checked against NVIDIA's walk (the reference's, bit-exact) ON THE SAME probabilities.
# The kernels' inverse-CDF walk is a parallel (pairwise) prefix sum, NVIDIA's a sequential fp32 sum, so
# the tokens may differ exactly where the two cannot agree: the threshold lies within ``BOUNDARY`` of a
# running sum, or the exact (float64) and the sequential fp32 running sums fall on different sides of
# it (at V = 151936 the sequential sum strays by ~1e-5). The fused sampler computes its chunk masses
# from softmax partials (GPU ``exp`` is approximate): ``FUSED_BOUNDARY`` there. A differing token must
# still have positive mass.
BOUNDARY, FUSED_BOUNDARY = 1e-6, 3e-6


def legit_mismatch(weights, u, scaled, window):
    """bool ``[N]``: rows where an accurate walk may pick another token than NVIDIA's sequential fp32
    walk over ``weights`` ``[N, V]`` at ``u`` ``[N]`` (``scaled`` ``[N]``: threshold ``u * total``, the
    residual draw): a running sum within ``window`` (relative to the total when scaled) of the
    threshold, or exact and sequential running sums on different sides of it."""
    w = R._positive(weights.float().cpu())
    sequential = R._sequential_prefix(w).double()
    exact = w.double().cumsum(-1)
    u, scaled = R.clamp_uniform(u.float().cpu()), scaled.cpu()
    t_exact = torch.where(scaled, u.double() * exact[:, -1], u.double())[:, None]
    t_sequential = torch.where(scaled, u * sequential[:, -1].float(), u).double()[:, None]  # fl32(t * S)
    unit = torch.where(scaled, exact[:, -1], torch.ones_like(exact[:, -1]))[:, None] * window
    near = ((exact - t_exact).abs() <= unit) | ((sequential - t_sequential).abs() <= unit)
    return (near | ((exact > t_exact) != (sequential > t_sequential))).any(-1)


def assert_tokens_agree(expected, actual, weights, u, scaled=None, window=BOUNDARY):
    """Tokens drawn from ``weights`` [N, V] at ``u`` [N]: equal to NVIDIA's walk (``expected``) except on
    rows where ``legit_mismatch`` allows it, and then still a token with positive weight."""
    differ = (expected != actual).cpu()
    if not bool(differ.any()):
        return
    scaled = torch.zeros_like(differ) if scaled is None else scaled.cpu()
    rows = weights.cpu()[differ]
    allowed = legit_mismatch(rows, u.cpu()[differ], scaled[differ], window)
    assert bool(allowed.all()), f"tokens differ where NVIDIA's walk is unambiguous: rows {differ.nonzero().tolist()}"
    mass = rows.gather(1, actual.cpu()[differ].long().clamp(0, weights.shape[1] - 1)[:, None])
    assert bool((mass > 0).all()), "a token without mass was drawn"


# ------------------------------------------------------------------------------ literal oracles


def walk(weights, t, ids=None) -> int:
    """kernels.md 2.2/2.4 for one row: float32 running sum of the positive entries, first ``t < c``."""
    c = np.float32(0.0)
    fallback = 0 if ids is None else int(ids[0])
    for i, w in enumerate(np.asarray(weights, dtype=np.float32)):
        if not w > 0:
            continue
        fallback = i if ids is None else int(ids[i])
        c = np.float32(c + w)
        if np.float32(t) < c:
            return fallback
    return fallback


def clamp_uniform(u) -> np.float32:
    u = np.float32(u)
    return np.float32(0.0) if np.isnan(u) else min(max(u, np.float32(0.0)), UNIFORM_MAX)


def sample_from_probs(probs, u) -> int:
    return walk(probs, clamp_uniform(u))


def sample_from_residual(p, q, u) -> int:
    """kernels.md 2.3 for one row."""
    r = np.maximum(np.asarray(p, np.float32) - np.asarray(q, np.float32), np.float32(0))
    total = np.float32(0.0)
    for x in r:
        if x > 0:
            total = np.float32(total + x)
    if total <= np.float32(1e-20):
        return sample_from_probs(p, u)
    return walk(r, np.float32(clamp_uniform(u) * total))


def probabilistic_accept(target, draft, tokens, proposal_lengths, uniforms, verify_proposal_len):
    """kernels.md 3.23, one row at a time; numpy inputs; returns (accepted [B, P_v+1], lengths [B])."""
    batch, stride = tokens.shape
    accepted = np.zeros((batch, verify_proposal_len + 1), dtype=np.int64)
    lengths = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        row_p = max(1, min(verify_proposal_len, int(proposal_lengths[b])))
        n = 0
        for s in range(row_p):
            t = int(tokens[b, s])
            p, q = np.float32(target[b, s, t]), np.float32(draft[b, s, t])
            a = np.float32(1.0) if q <= np.float32(1e-20) else min(np.float32(1.0), np.float32(p / q))
            if p > 0 and np.float32(uniforms[b, s]) <= a:
                accepted[b, n] = t
                n += 1
                continue
            accepted[b, n] = sample_from_residual(target[b, s], draft[b, s], uniforms[b, stride + s])
            lengths[b] = n + 1
            break
        else:
            accepted[b, n] = sample_from_probs(target[b, row_p], uniforms[b, 2 * stride])
            lengths[b] = n + 1
    return accepted, lengths


def logits_to_probabilities(logits, temperature, top_k, top_p):
    """kernels.md 3.9 Cases A-C for one row, as written there (float64, loops; finite logits only)."""
    x = np.asarray(logits, np.float64)
    vocab = x.size
    greedy = temperature < 1e-3
    k = 1 if greedy else top_k
    mass = 1.0 if greedy else top_p
    k = vocab if k < 0 or k > vocab else k
    use_k, use_p = 0 < k < vocab, mass < 1 - 1e-6
    x = x * (1.0 if greedy else float(np.float32(1) / np.float32(temperature)))
    probs = np.zeros(vocab)
    if not use_k and not use_p:  # Case A
        e = np.exp(x - x.max())
        return e / e.sum()
    if use_k and k <= 128:  # Case B: selection on x
        taken = np.zeros(vocab, bool)
        order = []
        for _ in range(k):
            best = max((i for i in range(vocab) if not taken[i]), key=lambda i: (x[i], -i))
            taken[best] = True
            order.append(best)
        weights = np.exp(x[order] - x[order[0]])
    else:  # Case C: softmax first, then selection on probabilities
        e = np.exp(x - x.max())
        soft = e / e.sum()
        order = [i for i in sorted(range(vocab), key=lambda i: (-soft[i], i)) if soft[i] > 0]
        order = order[:k] if use_k else order
        weights = soft[order]
    selected = weights.sum()
    denom = max(mass * selected, 1e-20) if use_p else max(selected, 1e-20)
    remaining = denom
    for i, a in zip(order, weights):
        if use_p:
            a = min(a, remaining)
            remaining -= a
        if a > 0:
            probs[i] = a / denom
        if use_p and remaining <= 1e-20:
            break
    return probs
