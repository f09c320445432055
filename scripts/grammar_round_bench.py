"""Host time of a constrained DSpark round's grammar work, without a model: ``PYTHONPATH=src python
scripts/grammar_round_bench.py [--batch 64] [--drafts 7] [--acceptance 1] [--rounds 60] [--profile FILE]``.

``--batch`` requests under ``bench.structured``'s JSON schema over its generated tokenizer of the 8B
vocabulary (151,936 logits, 4,748-word bitmask rows; the grammar side of ``--shape qwen3-8b``), on a
``GrammarStager`` over CPU buffers of the engine's shapes. Each round, as the engine's: the drafts --
a grammar-valid continuation of ``--drafts`` tokens drawn from the masks, each kept with probability
``--acceptance`` (else a random token of the vocabulary, which the grammar mostly refuses; 0: random
drafts) -- are staged (``stage_round``: the windows' walk, the forced drafts, the masks), the round
commits each row's valid drafts and a token of the mask after them (the target's), the drafter's
masks are staged after them (``stage_drafts``) and the requests take them (``commit``, as the
engine's ``_commit``); a request whose JSON is complete starts again. Prints the median ms per round
(this thread's CPU time: steady on a shared machine) of each part and of their sum over ``--rounds``
rounds after 5 warm-up rounds, the masks' two copies to the runner's buffers apart (on a GPU they are
asynchronous copies from pinned memory, device time rather than the host's; here CPU memcpys);
``--profile FILE`` writes cProfile's table of the timed rounds (copies included)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from dspark.bench.structured import SCHEMA, generated_tokenizer
from dspark.engine.structured import FREE_MASK, GrammarRow, GrammarStager, Grammars, StructuredOutputs, bitmask_width

VOCAB, REGULAR = 151936, 151643
# this thread's CPU time: what the host spends, unmoved by other processes sharing the cores (the
# xgrammar calls here run on the calling thread; MaskFiller's threaded fills, which it uses only
# past 2 ms a call, would not be counted)
clock = time.thread_time


def allowed_token(words: np.ndarray, rng: random.Random) -> int:
    """A random token of a bitmask row (uint32 words)."""
    word = rng.choice(np.flatnonzero(words).tolist())
    return word * 32 + rng.choice([b for b in range(32) if int(words[word]) >> b & 1])


def valid_continuation(matcher, length: int, rng: random.Random, scratch: torch.Tensor) -> list[int]:
    """Up to ``length`` tokens the grammar takes, drawn at random from each mask; the matcher left as it was."""
    tokens = []
    while len(tokens) < length and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(scratch, 0)
        token = allowed_token(scratch[0].numpy().view(np.uint32), rng)
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
    parser.add_argument("--acceptance", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    # one thread: torch's int32 copy_ on two threads took ~4 ms for 150 KB on this project's shared
    # 2-core machine (a GPU's copies are DMA; one thread times the memcpy itself)
    torch.set_num_threads(1)
    b, p, rng = args.batch, args.drafts, random.Random(0)
    grammars, spec = Grammars(generated_tokenizer(REGULAR), VOCAB, [0]), StructuredOutputs(json=SCHEMA)
    width, t = bitmask_width(VOCAB), p + 1
    state = SimpleNamespace(grammar_mask=torch.full((b + 1, t, width), FREE_MASK, dtype=torch.int32),
                            draft_mask=torch.full((b + 1, t, width), FREE_MASK, dtype=torch.int32),
                            draft_tokens=torch.zeros(b + 1, p, dtype=torch.int64), draft_probs=None)
    stager = GrammarStager(state, t, width, slice(1, t))
    copies: list[float] = []  # the masks' copies to the "device": asynchronous on a GPU, so timed apart
    for sender in (stager.windows, stager.drafts):
        def send(rows, run=sender.send):
            start = clock()
            run(rows)
            copies.append(clock() - start)
        sender.send = send
    requests = [grammars.matcher(spec) for _ in range(b)]
    stager.stage_seats([GrammarRow(i, r) for i, r in enumerate(requests)])
    scratch = torch.zeros(1, width, dtype=torch.int32)
    parts = {"stage_round": [], "stage_drafts": [], "commit": []}
    sent: list[float] = []
    profiler = cProfile.Profile(clock) if args.profile else None
    for round_ in range(5 + args.rounds):
        timed = round_ >= 5
        drafts = torch.zeros(b, p, dtype=torch.int64)
        for i, r in enumerate(requests):
            valid = valid_continuation(r.matcher, p, rng, scratch)
            valid += [rng.randrange(REGULAR) for _ in range(p - len(valid))]
            drafts[i] = torch.tensor([d if rng.random() < args.acceptance else rng.randrange(REGULAR) for d in valid])
        state.draft_tokens[:b] = drafts
        rows = [GrammarRow(i, r) for i, r in enumerate(requests)]
        if profiler is not None and timed:
            profiler.enable()
        start = clock()
        lens = stager.stage_round(rows, [t] * b, state.draft_tokens[:b].clone())
        staged = clock()
        if profiler is not None and timed:
            profiler.disable()
        # the target's round (not timed): each row's drafts up to its cut's refused one, then a token
        # of the mask after them (its masked target token)
        tokens = []
        for i, r in enumerate(requests):
            kept = state.draft_tokens[i, :lens[i] - 1].tolist()
            n = 0
            while n < len(kept) and not r.matcher.is_terminated() and r.matcher.accept_token(kept[n]):
                n += 1
            if r.matcher.is_terminated():  # its stop token was drafted: the output ends there
                r.matcher.rollback(n)
                tokens.append(kept[:n])
                continue
            r.matcher.rollback(n)
            words = stager.verify_masks[i, n].numpy().view(np.uint32)
            tokens.append(kept[:n] + [allowed_token(words, rng)])
        if profiler is not None and timed:
            profiler.enable()
        drafted = clock()
        stager.stage_drafts(rows, tokens)
        committed = clock()
        for r, kept in zip(requests, tokens):
            r.advance(kept)
        end = clock()
        if profiler is not None and timed:
            profiler.disable()
        if timed:  # the copies' times out of the parts they ran in
            parts["stage_round"].append(staged - start - copies[-2])
            parts["stage_drafts"].append(committed - drafted - copies[-1])
            parts["commit"].append(end - committed)
            sent.append(copies[-2] + copies[-1])
        ended = [i for i, r in enumerate(requests) if r.terminated]
        for i in ended:
            requests[i] = grammars.matcher(spec)
        stager.stage_seats([GrammarRow(i, requests[i]) for i in ended])
    total = [sum(x) for x in zip(*parts.values())]
    print(f"B = {b}, {p} drafts, acceptance {args.acceptance:g}, vocabulary {VOCAB}: host ms per round, median of "
          f"{args.rounds}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in parts.items())
          + f", total {statistics.median(total) * 1e3:.3f} (min {min(total) * 1e3:.3f}); the masks' copies "
          f"{statistics.median(sent) * 1e3:.3f} besides")
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
