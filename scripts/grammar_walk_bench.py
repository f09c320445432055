"""Host time of a structured-output verify window walk (``engine.structured.walk_windows``) per step.

``PYTHONPATH=src python scripts/grammar_walk_bench.py [--batch 64] [--drafts 7]``: ``--batch`` requests
under ``bench.structured``'s JSON schema over its generated tokenizer of the 8B vocabulary (151,936
logits), each step drafting a grammar-valid continuation of ``--drafts`` tokens (acceptance 1: every
row of every window is walked), committing it, and a request whose JSON is complete starting again.
Prints the median and minimum milliseconds of ``walk_windows`` over 30 steps (no GPU involved).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
import xgrammar as xgr

from dspark.bench.structured import SCHEMA, generated_tokenizer
from dspark.engine.structured import Grammars, StructuredOutputs, bitmask_width, walk_windows

VOCAB, REGULAR = 151936, 151643


def valid_continuation(matcher, length: int, rng: random.Random, scratch: torch.Tensor) -> list[int]:
    """Up to ``length`` tokens the grammar takes, drawn at random from each mask; the matcher left as it was."""
    tokens = []
    while len(tokens) < length and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(scratch, 0)
        words = scratch[0].numpy().view(np.uint32)
        word = rng.choice(np.flatnonzero(words).tolist())
        token = word * 32 + rng.choice([b for b in range(32) if int(words[word]) >> b & 1])
        if not matcher.accept_token(token):
            break
        tokens.append(token)
    if tokens:
        matcher.rollback(len(tokens))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--drafts", type=int, default=7)
    args = parser.parse_args()
    grammars, spec, rng = Grammars(generated_tokenizer(REGULAR), VOCAB, [0]), StructuredOutputs(json=SCHEMA), random.Random(0)
    width, stride = bitmask_width(VOCAB), args.drafts + 1
    masks, scratch = torch.zeros(args.batch * stride, width, dtype=torch.int32), torch.zeros(1, width, dtype=torch.int32)
    batch, requests, times = xgr.BatchGrammarMatcher(), [grammars.matcher(spec) for _ in range(args.batch)], []
    for _ in range(30):
        requests = [r if not r.terminated else grammars.matcher(spec) for r in requests]
        drafts = [valid_continuation(r.matcher, args.drafts, rng, scratch) for r in requests]
        start = time.perf_counter()
        walk_windows(requests, drafts, masks, [i * stride for i in range(args.batch)], batch)
        times.append(time.perf_counter() - start)
        for request, tokens in zip(requests, drafts):
            request.advance(tokens)
    print(f"walk_windows at B = {args.batch}, {args.drafts} drafts: median {statistics.median(times) * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
