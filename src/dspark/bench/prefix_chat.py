"""Shared-prefix chat through ``dspark serve``, prefix caching on against off:
``python -m dspark.bench.prefix_chat --out DIR [--url URL | -- SERVE ARGS]``.

Every client holds a conversation: a system prompt shared by all (``--system-tokens``, random token
ids, seeded; ``--demo-text``: the demo pair's held-out source files, tokenized -- text its drafter
predicts as in real use), then ``--turns`` turns, each adding a user message of ``--user-tokens`` ids of its own
and asking for ``--max-tokens`` (``ignore_eos``, greedy); the next turn's prompt is the previous one
plus the answer's token ids and a new user message -- what a chat client sends. ``--clients``
conversations run at once. Without ``--url`` the server is started twice here, as ``python -m
dspark.cli serve --port 0 ARGS --enable-prefix-caching`` and ``--no-enable-prefix-caching``;
per run: time to first token p50 / p99 (all turns, and the turns after the first), output
tokens/s (output tokens / wall time), tau and the prefix cache's hit rate from /metrics, and whether
every conversation's answers are the same with and without caching. Writes ``DIR/prefix_chat.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from .serve import Record, ServerProcess, one_request, percentile, scrape, wait_healthy


async def conversation(client, system: list[int], users: list[list[int]], args) -> list[Record]:
    """One client's turns, each prompt the conversation so far (token ids)."""
    history, records = list(system), []
    for user in users:
        history += user
        body = {"prompt": list(history), "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if args.model:
            body["model"] = args.model
        record = await one_request(client, body)
        records.append(record)
        if record.error is not None or record.token_ids is None:
            break
        history += record.token_ids
    return records


async def run(url: str, args) -> dict:
    """Every conversation at once; the figures of one server."""
    import httpx

    system, users = conversation_tokens(args)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    with httpx.Client(timeout=30) as sync:
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(args.request_timeout)) as client:
            warm = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0}
            await client.post("/v1/completions", json={**warm, **({"model": args.model} if args.model else {})})
            before = scrape(sync, url)
            start = time.perf_counter()
            conversations = await asyncio.gather(*(conversation(client, system, u, args) for u in users))
            wall = time.perf_counter() - start
            after = scrape(sync, url)
    return summarize(conversations, wall, before, after)


def conversation_tokens(args) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each client's user messages (token ids)."""
    rng = random.Random(0)
    if not args.demo_text:
        return ([rng.randrange(args.vocab) for _ in range(args.system_tokens)],
                [[[rng.randrange(args.vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
                 for _ in range(args.clients)])
    from transformers import AutoTokenizer

    from dspark.training.data import demo_pair, read_prompts

    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    files = [tokenizer(r["text"])["input_ids"] for r in read_prompts(str(pair.prompts))]
    system = [t for ids in files for t in ids][:args.system_tokens]
    pieces = [ids[:args.user_tokens] for ids in files[::-1] if len(ids) >= args.user_tokens]
    return system, [[pieces[(c * args.turns + k) % len(pieces)] for k in range(args.turns)]
                    for c in range(args.clients)]


def summarize(conversations: list[list[Record]], wall: float, before: dict, after: dict) -> dict:
    records = [r for turns in conversations for r in turns]
    good = [r for r in records if r.error is None]
    later = [r.ttft for turns in conversations for r in turns[1:] if r.error is None]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rounds = delta("dspark:spec_decode_num_drafts_total")
    queries = delta("dspark:prefix_cache_queries_total")
    tokens = sum(r.completion_tokens for r in good)
    return {"requests": len(records), "failed": len(records) - len(good),
            "errors": sorted({r.error for r in records if r.error})[:5], "wall_s": wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "ttft_s": {"p50": percentile([r.ttft for r in good], 50), "p99": percentile([r.ttft for r in good], 99)},
            "ttft_later_turns_s": {"p50": percentile(later, 50), "p99": percentile(later, 99)},
            "tau": 1 + delta("dspark:spec_decode_num_accepted_tokens_total") / rounds if rounds else None,
            "prefix_cache_hit_rate": delta("dspark:prefix_cache_hits_total") / queries if queries else None,
            "answers": [[r.token_ids for r in turns] for turns in conversations]}


def serve_and_run(serve_args: list[str], caching: bool, args) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    server = ServerProcess([*serve_args, flag], args.startup_timeout)
    try:
        import httpx

        with httpx.Client(timeout=30) as sync:
            wait_healthy(sync, server.url, args.startup_timeout)
        return asyncio.run(run(server.url, args))
    finally:
        server.stop()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.prefix_chat", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory of prefix_chat.json")
    parser.add_argument("--url", default=None, help="a running server (one run, its own caching setting)")
    parser.add_argument("--model", default=None, help="the model name to send (default: none)")
    parser.add_argument("--clients", type=int, default=64, help="conversations at once")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn")
    parser.add_argument("--vocab", type=int, default=151936, help="random ids in [0, vocab): the target's vocabulary")
    parser.add_argument("--demo-text", action="store_true",
                        help="the demo pair's held-out source files as the system prompt and user messages")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the arguments of dspark serve")
    args = parser.parse_args(argv)
    args.serve_args = [a for a in args.serve_args if a != "--"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.url:
        runs = {"url": asyncio.run(run(args.url, args))}
    else:
        runs = {name: serve_and_run(args.serve_args, name == "on", args) for name in ("on", "off")}
    for name, figures in runs.items():
        print(f"{name:>4}: TTFT p50 {figures['ttft_s']['p50']:.3f} s p99 {figures['ttft_s']['p99']:.3f} s "
              f"(later turns p50 {figures['ttft_later_turns_s']['p50'] or 0:.3f} s), "
              f"{figures['output_tokens_per_s']:.1f} tok/s, tau {figures['tau'] or 0:.3f}, "
              f"cache hits {figures['prefix_cache_hit_rate'] or 0:.1%}, failed {figures['failed']}")
    if "on" in runs:
        on, off = runs["on"], runs["off"]
        runs["comparison"] = {"ttft_p50_on_over_off": on["ttft_s"]["p50"] / off["ttft_s"]["p50"],
                              "throughput_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                              "same_answers": on["answers"] == off["answers"]}
        print(json.dumps(runs["comparison"]))
    (out / "prefix_chat.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
