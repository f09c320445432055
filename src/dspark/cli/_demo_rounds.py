"""The synthetic rounds of ``dspark demo`` (kept apart from the command so that parsing its
options, and ``dspark --help``, never import torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dspark.kernels as K

SEED = 0x44535041524B2026  # the runtime seed of TensorRT-Edge-LLM's DSpark decoder


@dataclass
class Synthetic:
    """One batch of draft-side and target-side tensors for a round."""

    backbone_logits: torch.Tensor  # f32 [B, P, V]
    markov_w1: torch.Tensor  # f16 [V, R]
    markov_w2: torch.Tensor  # f16 [V, R]
    draft_hidden_states: torch.Tensor  # f16 [B, P, H]
    confidence_weight: torch.Tensor  # f16 [H + R]
    confidence_bias: torch.Tensor  # f16 [1]
    last_accepted_tokens: torch.Tensor  # i32 [B]
    target_noise: float


def make_synthetic(batch: int, proposal_len: int, vocab: int, rank: int, hidden: int, noise: float, seed: int) -> Synthetic:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return Synthetic(
        backbone_logits=randn(batch, proposal_len, vocab, scale=2.0),
        markov_w1=randn(vocab, rank, scale=0.7).half(),
        markov_w2=randn(vocab, rank, scale=0.7).half(),
        draft_hidden_states=randn(batch, proposal_len, hidden).half(),
        confidence_weight=randn(hidden + rank, scale=0.4).half(),
        confidence_bias=torch.tensor([1.5]).half(),
        last_accepted_tokens=torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32),
        target_noise=noise,
    )


def corrected_logits(s: Synthetic, draft_token_ids: torch.Tensor) -> torch.Tensor:
    """Markov-corrected draft logits of every step along the drafted chain: f32 [B, P, V]."""
    steps = [
        K.build_markov_logits(s.backbone_logits, s.markov_w1, s.markov_w2, s.last_accepted_tokens, draft_token_ids, step)
        for step in range(draft_token_ids.shape[1])
    ]
    return torch.stack(steps, dim=1)


def target_logits(s: Synthetic, draft_token_ids: torch.Tensor, verify_proposal_len: int, seed: int) -> torch.Tensor:
    """Target logits [B, P_v+1, V]: row i follows verify token i, i.e. the draft's step-i logits plus noise.

    The bonus row past the draft's last step has no draft counterpart and is pure noise.
    """
    g = torch.Generator().manual_seed(seed)
    z = corrected_logits(s, draft_token_ids)
    batch, proposal_len, vocab = z.shape
    rows = torch.empty(batch, verify_proposal_len + 1, vocab)
    shared = min(verify_proposal_len + 1, proposal_len)
    rows[:, :shared] = z[:, :shared]
    rows[:, shared:] = 0.0
    return rows + s.target_noise * torch.randn(rows.shape, generator=g)


def schedule(s: Synthetic, draft_token_ids: torch.Tensor, scheduler: str, threshold: float):
    common = (s.draft_hidden_states, s.markov_w1, s.confidence_weight, s.confidence_bias, s.last_accepted_tokens, draft_token_ids)
    if scheduler == "threshold":
        return K.compute_confidence_and_proposal_lengths(*common, confidence_with_markov=True, threshold=threshold)
    return K.compute_confidence_and_sps_proposal_lengths(*common, confidence_with_markov=True, survival_floor=threshold)


def fmt_row(values) -> str:
    return " ".join(f"{v:>5}" if isinstance(v, int) else f"{v:5.2f}" for v in values)


def trace_round(s: Synthetic, mode: str, scheduler: str, threshold: float, temperature: float, round_index: int) -> None:
    batch, proposal_len, _ = s.backbone_logits.shape
    print(f"\n=== {mode} round, {scheduler} scheduler (threshold/floor {threshold}), B={batch}, P={proposal_len} ===")
    if mode == "greedy":
        draft_token_ids = K.markov_greedy_round(
            s.backbone_logits, s.markov_w1, s.markov_w2, s.last_accepted_tokens, proposal_len=proposal_len
        )
    else:
        uniforms = K.fill_uniforms(batch * proposal_len, SEED, round_index * batch * (3 * proposal_len + 1)).view(batch, proposal_len)
        draft_token_ids, draft_probabilities = K.vanilla_markov_sample(
            s.backbone_logits, s.markov_w1, s.markov_w2, s.last_accepted_tokens, uniforms, temperature
        )
    confidence, proposal_lengths = schedule(s, draft_token_ids, scheduler, threshold)
    verify_proposal_len = int(proposal_lengths.max())
    verify_tokens = K.build_verify_tokens(s.last_accepted_tokens, draft_token_ids, verify_proposal_len)
    logits = target_logits(s, draft_token_ids, verify_proposal_len, seed=round_index)
    if mode == "greedy":
        accepted, accept_length = K.greedy_accept(logits, draft_token_ids, proposal_lengths, verify_proposal_len)
    else:
        target_probabilities = K.logits_to_probabilities(logits.flatten(0, 1), temperature).view_as(logits)
        offset = round_index * batch * (3 * proposal_len + 1) + batch * proposal_len
        accept_uniforms = K.fill_uniforms(batch * (2 * proposal_len + 1), SEED, offset).view(batch, -1)
        accepted, accept_length = K.probabilistic_accept(
            target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms, verify_proposal_len
        )
    for b in range(batch):
        print(f"row {b}: anchor {int(s.last_accepted_tokens[b])}")
        print(f"  drafted      {fmt_row(draft_token_ids[b].tolist())}")
        print(f"  confidence   {fmt_row(confidence[b].tolist())}")
        print(f"  survival     {fmt_row(torch.cumprod(confidence[b], 0).tolist())}")
        print(f"  scheduled length {int(proposal_lengths[b])}  (verify window P_v = {verify_proposal_len})")
        print(f"  verify       {fmt_row(verify_tokens[b].tolist())}")
        n = int(accept_length[b])
        print(f"  accepted     {fmt_row(accepted[b, :n].tolist())}   accept_length {n} (incl. the bonus/correction token)")


def acceptance_statistics(rounds: int, proposal_len: int, vocab: int, rank: int, hidden: int, noise: float, temperature: float):
    """Per-position conditional acceptance over `rounds` independent sampled rounds (one per row)."""
    s = make_synthetic(rounds, proposal_len, vocab, rank, hidden, noise, seed=1)
    uniforms = K.fill_uniforms(rounds * proposal_len, SEED, 0).view(rounds, proposal_len)
    draft_token_ids, q = K.vanilla_markov_sample(s.backbone_logits, s.markov_w1, s.markov_w2, s.last_accepted_tokens, uniforms, temperature)
    logits = target_logits(s, draft_token_ids, proposal_len, seed=2)
    p = K.logits_to_probabilities(logits.flatten(0, 1), temperature).view_as(logits)
    proposal_lengths = K.fill_proposal_lengths(rounds, proposal_len)
    accept_uniforms = K.fill_uniforms(rounds * (2 * proposal_len + 1), SEED, rounds * proposal_len).view(rounds, -1)
    _, accept_length = K.probabilistic_accept(p, q, draft_token_ids, proposal_lengths, accept_uniforms, proposal_len)
    overlap = torch.minimum(p[:, :proposal_len], q).sum(-1)  # [rounds, P]: sum_v min(p, q) per position
    print(f"\n=== acceptance over {rounds} sampled rounds (T={temperature}, V={vocab}, P={proposal_len}, noise {noise}) ===")
    print("position  reached  empirical  closed form E[sum min(p,q)]")
    for k in range(proposal_len):
        reached = accept_length > k  # rows whose drafts 0..k-1 were all accepted
        n = int(reached.sum())
        if n == 0:
            break
        empirical = float((accept_length[reached] > k + 1).float().mean())
        closed = float(overlap[reached, k].mean())
        print(f"{k:>8}  {n:>7}  {empirical:9.4f}  {closed:9.4f}")
    print(f"mean accept length tau (bonus included): {float(accept_length.float().mean()):.3f}")
