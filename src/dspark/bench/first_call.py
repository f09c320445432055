"""A user's first ``LLM.generate`` call against a later one (issue: graphs captured lazily in the first call).

``python -m dspark.bench.first_call --shape qwen3-8b --batch 64 --prompt 512 --new 256``: a random-weight
Qwen3 target of that shape (bf16, plain decoding), ``LLM`` built once (its start-up capture timed),
then the same batch generated twice; per call the wall time per decoding step (the call's seconds
over ``--new``: every row decodes that many tokens, the prompts admitted in the first steps of each
call alike) and the engine's graph captures during the call. ``--enforce-eager`` for the eager engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .engine import SHAPES, random_target


def timed_call(llm, prompts: list[list[int]], new: int) -> dict:
    engine = llm.decoder
    captures = engine.runner.captures
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, max_new_tokens=new, ignore_eos=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results), "a request ended early"
    return {"seconds": seconds, "ms_per_step": 1000 * seconds / new, "captures": engine.runner.captures - captures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.first_call", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from .. import LLM

    target = random_target(SHAPES[args.shape])
    start = time.perf_counter()
    llm = LLM(target, no_draft=True, max_batch=args.batch, max_model_len=args.prompt + args.new + 1,
              enforce_eager=args.enforce_eager)
    built = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    # other prompts for the later call: the same ones would come from the prefix cache
    first, later = (timed_call(llm, torch.randint(0, target.config.vocab_size, (args.batch, args.prompt),
                                                  generator=generator).tolist(), args.new) for _ in range(2))
    report = {"shape": args.shape, "batch": args.batch, "prompt": args.prompt, "new": args.new,
              "enforce_eager": args.enforce_eager, "build_seconds": built, "graphs": len(llm.decoder.runner.graphs),
              "first": first, "later": later, "first_over_later": first["seconds"] / later["seconds"]}
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
