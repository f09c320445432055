"""Run DSpark rounds on synthetic tensors and print a readable trace of every stage.

A small vocabulary, a random rank-R Markov head and confidence head, and a "target" whose logits are
the draft's own Markov-corrected logits plus noise (so it agrees with the draft most of the time).
Greedy and sampled rounds are shown with the threshold and SPS schedulers; then many sampled rounds
(one per batch row) give the empirical per-position acceptance rate next to its closed form
E[sum_v min(p(v), q(v))].
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=3, help="rows in the traced rounds")
    parser.add_argument("--proposal-len", type=int, default=7, help="drafted tokens per round (P)")
    parser.add_argument("--vocab", type=int, default=48, help="vocabulary size (V)")
    parser.add_argument("--rank", type=int, default=16, help="Markov rank (R)")
    parser.add_argument("--hidden", type=int, default=32, help="draft hidden size (H)")
    parser.add_argument("--noise", type=float, default=0.6, help="std of the target's disagreement noise")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--threshold", type=float, default=0.3, help="survival threshold / SPS survival floor")
    parser.add_argument("--rounds", type=int, default=20000, help="sampled rounds for the acceptance statistics")


def run(args: argparse.Namespace) -> int:
    from ._demo_rounds import acceptance_statistics, make_synthetic, trace_round

    s = make_synthetic(args.batch, args.proposal_len, args.vocab, args.rank, args.hidden, args.noise, seed=0)
    for i, (mode, scheduler) in enumerate([("greedy", "threshold"), ("greedy", "sps"), ("sampled", "threshold"), ("sampled", "sps")]):
        trace_round(s, mode, scheduler, args.threshold, args.temperature, round_index=i)
    acceptance_statistics(args.rounds, args.proposal_len, args.vocab, args.rank, args.hidden, args.noise, args.temperature)
    return 0
