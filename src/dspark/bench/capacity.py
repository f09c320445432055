"""How many concurrent requests fit beside the target: paged KV blocks against per-slot lines.

``python -m dspark.bench.capacity --shape qwen3-8b --request-tokens 4096 --new 256``: a random-weight
Qwen3 target of that shape (bf16) and a random DSpark drafter, one engine built with
``gpu_memory_utilization`` (0.9, vLLM's default) and ``--max-model-len`` (default 32768, the context
a server of that model offers). Reported:

- ``fit_paged``: the requests of ``--request-tokens`` (prompt + ``--new``) the engine's KV blocks
  hold at once, verify window and draft block included; then measured: that many requests with
  distinct random prompts run together (``max_batch`` = that number), the most running at once and
  the preemptions (0 expected); then 25 % more, which must all finish too, by preemption.
- ``fit_per_slot``: what a per-slot cache (every admitted request holds a whole ``max_model_len``
  line, the engine before paging) holds in the same bytes, for each context in ``--contexts``:
  arithmetic on the same per-token bytes, as that engine allocated ``max_batch x max_model_len``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch

from .engine import SHAPES, random_drafter, random_target


def run_requests(engine, count: int, prompt_len: int, new: int, seed: int) -> dict:
    """``count`` requests of distinct random prompts added at once, stepped to the end: the most
    running together, preemptions, seconds, and whether every request produced ``new`` tokens."""
    from ..engine import Request

    generator = torch.Generator().manual_seed(seed)
    vocab = engine.target.vocab_size
    ids = [engine.add_request(Request(torch.randint(0, vocab, (prompt_len,), generator=generator).tolist(),
                                      max_new_tokens=new, ignore_eos=True)) for _ in range(count)]
    preempted, produced, most = engine.metrics.preemptions, dict.fromkeys(ids, 0), 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
        most = max(most, len(engine.scheduler.running))
    torch.cuda.synchronize()
    return {"requests": count, "most_running": most, "preemptions": engine.metrics.preemptions - preempted,
            "seconds": time.perf_counter() - start, "all_finished": all(n == new for n in produced.values())}


def blocks_per_request(engine, tokens: int) -> int:
    """KV blocks a request of ``tokens`` holds at its end: its tokens and what a round writes past them."""
    return math.ceil((tokens + engine.scheduler.lookahead) / engine.config.kv_block_size)


def requests_held(engine, tokens: int) -> int:
    return (engine.runner.num_kv_blocks - 1) // blocks_per_request(engine, tokens)


def kv_bytes_per_token(engine) -> int:
    """The target's and the draft's K/V bytes per position."""
    from ..model.layers import KVCache

    per_token = engine.target.kv_bytes_per_token
    if engine.draft_model is not None:
        cfg = engine.draft_model.config
        per_token += KVCache.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                             engine.draft_model.dtype)
    return per_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--request-tokens", type=int, default=4096, help="prompt + new tokens per request")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--contexts", default="4352,8192,32768", help="per-slot lines to compare (max_model_len)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--step-tokens", type=int, default=16384, help="max_num_batched_tokens")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (their pool is budgeted either way)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from ..engine import EngineConfig, LLMEngine

    target = random_target(SHAPES[args.shape])
    draft = random_drafter(target, SHAPES[args.shape])
    prompt_len = args.request_tokens - args.new

    def engine_for(max_batch: int, graphs: bool = True) -> LLMEngine:
        config = EngineConfig(max_batch=max_batch, max_model_len=args.max_model_len, enable_prefix_caching=False,
                              max_num_batched_tokens=args.step_tokens, cuda_graphs=graphs,
                              gpu_memory_utilization=args.gpu_memory_utilization)
        engine = LLMEngine(target, draft, config)
        engine.capture_graphs()
        return engine

    probe = engine_for(1, graphs=False)  # how many requests the blocks hold: the engine's step memory grows with max_batch
    fit = requests_held(probe, args.request_tokens)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    engine = engine_for(fit + fit // 4, graphs=not args.enforce_eager)
    fit, blocks = requests_held(engine, args.request_tokens), engine.runner.num_kv_blocks - 1
    block_size, per_token = engine.config.kv_block_size, kv_bytes_per_token(engine)
    report = {"shape": args.shape, "request_tokens": args.request_tokens, "new": args.new,
              "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
              "kv_block_size": block_size, "kv_blocks": blocks, "kv_bytes_per_token": per_token,
              "kv_gib": blocks * block_size * per_token / 2**30,
              "blocks_per_request": blocks_per_request(engine, args.request_tokens), "fit_paged": fit,
              "fit_per_slot": {int(n): blocks * block_size // int(n) for n in args.contexts.split(",")},
              "at_fit": run_requests(engine, fit, prompt_len, args.new, seed=1),
              "over_fit": run_requests(engine, fit + fit // 4, prompt_len, args.new, seed=2)}
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
