"""Profile the target's verify forward on this device and write the cost table of ``--scheduler cost``.

Times one target forward per total verify token count (blocks of --tokens-per-row tokens over
--context cached positions; CUDA graphs on a GPU) and writes TensorRT-LLM's cost-table JSON
(``token_counts``, ``step_time_ms``), which ``dspark generate/serve --scheduler cost --cost-table``
read; beside it a plain decoding forward per row count (``decode_rows``, ``decode_time_ms``: a
dspark addition that prices the K/V reads of many rows of few tokens). With --draft it also times
the round's draft pass at each batch size of the engine (``draft_rows``, ``draft_time_ms``: a
dspark addition the cost scheduler adds to every round).
"""

from __future__ import annotations

import argparse
import sys

from ._runtime import add_parallel_argument, add_runtime_arguments, resolve_pair, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM: a directory or a Hub name "
                                         "(default: the demo pair's target)")
    parser.add_argument("--max-tokens", type=int, default=512, help="largest total verify token count")
    parser.add_argument("--context", type=int, default=512, help="cached positions per request")
    parser.add_argument("--tokens-per-row", type=int, default=8, help="verify tokens per request (P + 1)")
    parser.add_argument("--draft", help="DSpark draft (a directory or a Hub name): also time its draft pass per "
                                        "batch size (default: none, the verify forward only)")
    parser.add_argument("--out", default="cost_table.json", help="JSON file to write")
    add_parallel_argument(parser, " (every rank runs the timed forwards; rank 0's times are written)")
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dspark.engine.profile import default_token_counts, profile_costs
    from dspark.model.llama import TargetLM

    for name in ("max_tokens", "context", "tokens_per_row"):
        if getattr(args, name) < 1:
            print(f"dspark profile: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        device, dtype = runtime(args)
        resolve_pair(args, drafts="one" if args.draft else "none")
        if args.tensor_parallel_size != 1:
            return _profile_parallel(args, device, dtype)
        target = TargetLM.from_pretrained(args.target, device=device, dtype=dtype)
        engine = None
        if args.draft:
            from dspark.engine import EngineConfig, LLMEngine

            engine = LLMEngine(target, args.draft, EngineConfig(
                max_batch=max(1, args.max_tokens // args.tokens_per_row), max_model_len=args.context + 64,
                device=device, dtype=dtype, gpu_memory_utilization=None))  # beside profile_verify's cache
    except (ValueError, OSError, TypeError) as exc:
        print(f"dspark profile: {exc}", file=sys.stderr)
        return 2
    table = profile_costs(target, default_token_counts(args.max_tokens), context=args.context,
                          tokens_per_row=args.tokens_per_row, engine=engine)
    return _write(args, table, device)


def _profile_parallel(args: argparse.Namespace, device, dtype) -> int:
    """The table of a target sharded over ``--tensor-parallel-size`` ranks: an engine of them (its
    ranks load their shards) times the forwards on every rank at once (``LLMEngine.profile_costs``)."""
    from dspark.engine import EngineConfig, LLMEngine
    from dspark.engine.profile import default_token_counts

    engine = LLMEngine(args.target, args.draft, EngineConfig(
        max_batch=max(1, args.max_tokens // args.tokens_per_row), max_model_len=args.context + 64, device=device,
        dtype=dtype, gpu_memory_utilization=None, tensor_parallel_size=args.tensor_parallel_size))
    try:
        table = engine.profile_costs(default_token_counts(args.max_tokens), context=args.context,
                                     tokens_per_row=args.tokens_per_row)
    finally:
        engine.close()
    return _write(args, table, device)


def _write(args: argparse.Namespace, table, device) -> int:
    for n, t in zip(table.draft_rows, table.draft_time_ms):
        print(f"{n:6d} rows    {t:8.3f} ms draft pass")
    for n, t in zip(table.decode_rows, table.decode_time_ms):
        print(f"{n:6d} rows    {t:8.3f} ms plain decoding forward")
    table.write_json(args.out, device=str(device), target=args.target_name, context=args.context,
                     **({"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size != 1 else {}))
    for n, t in zip(table.token_counts, table.step_time_ms):
        print(f"{n:6d} tokens  {t:8.3f} ms")
    print(f"wrote {args.out}")
    return 0
