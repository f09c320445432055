"""Throughput-interactivity frontier of ``dspark serve``: ``python -m dspark.bench.serve --out DIR``.

A bounded asyncio load generator (httpx, nothing else): at each concurrency C (``--concurrency``,
default 1, 2, 4, ..., 64), C clients send streaming completion requests back to back,
``--requests-per-client`` each; every request asks for ``--max-tokens`` new tokens with
``ignore_eos`` (greedy unless ``--temperature``; ``--mixed-settings``: prompt i with the i-th of
four settings, greedy and sampled, so that every batch mixes them). The server is ``--url``, or is started here as
``python -m dspark.cli serve --port 0 ARGS`` with the arguments after ``--``, e.g.::

    python -m dspark.bench.serve --out docs/serve --label dspark-sps -- --scheduler sps --max-batch 64
    python -m dspark.bench.serve --out DIR --label plain -- --no-draft --max-batch 64
    python -m dspark.bench.serve --out DIR --label 8b --random-prompts 128 --vocab 151936 \\
        -- --engine-factory my_module:make_engine --max-batch 64

Before each level, C short requests warm the server up (a server that did not capture its CUDA graphs
at start-up captures them on first use). Per level:

* total tokens/s: output tokens of the level / its wall time;
* tokens/s per request: (tokens - 1) / (last token - first token) of each request (1 / TPOT; its
  median is the plot's x axis: the mean is pulled up by requests whose tokens arrived in a burst),
  and end to end: tokens / (last token - request sent);
* time to first token (request sent -> first token received), p50 / p99;
* inter-token latency p50 / p99: each chunk's gap from the previous one spread evenly over the
  chunk's tokens (a speculative round delivers several tokens at once); the raw chunk gaps too;
* failures (not 200, an error event, fewer tokens than asked) and greedy mismatches (a prompt's
  tokens differ from the first time that prompt was served: in float32 there must be none);
* from the server's /metrics, when it is dspark: tau (tokens per round), the engine's steps, their
  mean duration and its busy fraction (time inside steps / wall time: below 1, the engine waited --
  for requests, or for the HTTP side holding the GIL).

Writes ``DIR/<label>.json`` (the levels and each prompt's first output ids) and ``DIR/frontier.png``,
drawn from every ``DIR/*.json``: total tokens/s against tokens/s per request, one line per label,
points marked with C (the paper's Fig. 7).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"


@dataclass
class Record:
    """One request as the client saw it."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    token_ids: list[int] | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first token (1 / TPOT); None for a one-chunk answer."""
        span = self.chunks[-1][0] - self.chunks[0][0]
        return (self.completion_tokens - self.chunks[0][1]) / span if span > 0 else None


async def one_request(client, body: dict) -> Record:
    record = Record(time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            ids: list[int] = []
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error event")
                    return record
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    new = chunk["choices"][0].get("token_ids")
                    ids.extend(new or [])
                    record.chunks.append((time.perf_counter(), len(new) if new is not None else 1))
            record.token_ids = ids or None
    except Exception as exc:  # noqa: BLE001 -- a failed request is a result of the benchmark, not its end
        record.error = f"{type(exc).__name__}: {exc}"
    if record.error is None and (not record.chunks or record.completion_tokens != body["max_tokens"]):
        record.error = f"{record.completion_tokens} tokens of {body['max_tokens']}"
    return record


async def run_level(client, bodies: list[dict], concurrency: int) -> tuple[list[Record], float, float]:
    """Send ``bodies`` with ``concurrency`` clients back to back, each taking the next body when its
    request ends; (records in body order, wall s, seconds until the last body was sent: until then
    ``concurrency`` requests were always in flight)."""
    records: list[Record | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def client_loop():
        for i in next_index:
            records[i] = await one_request(client, bodies[i])

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    for r in records:
        r.sent -= start
        r.chunks = [(t - start, n) for t, n in r.chunks]
    return records, time.perf_counter() - start, max(r.sent for r in records)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100); None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(records: list[Record], wall: float, concurrency: int, full_until: float | None = None) -> dict:
    """One level's figures; ``full_until``: seconds (from the level's start) during which
    ``concurrency`` requests were in flight -- the steady-state rate counts the tokens received
    until then, without the drain at the end, where the last requests finish one by one."""
    good = [r for r in records if r.error is None]
    itl, gaps = [], []
    for r in good:
        for (before, _), (now, tokens) in zip(r.chunks, r.chunks[1:]):
            gaps.append(now - before)
            itl.extend([(now - before) / max(tokens, 1)] * max(tokens, 1))
    rates = [x for r in good if (x := r.decode_rate) is not None]
    e2e = [r.completion_tokens / (r.chunks[-1][0] - r.sent) for r in good]
    tokens = sum(r.completion_tokens for r in good)

    def stats(values):
        return {"mean": statistics.fmean(values) if values else None, "p50": percentile(values, 50),
                "p99": percentile(values, 99)}

    return {"concurrency": concurrency, "requests": len(records), "failed": len(records) - len(good),
            "errors": sorted({r.error for r in records if r.error})[:5], "wall_s": wall, "output_tokens": tokens,
            "total_tokens_per_s": tokens / wall if wall > 0 else None,
            "steady_tokens_per_s": _steady_rate(good, full_until),
            "per_request_tokens_per_s": stats(rates), "per_request_e2e_tokens_per_s": stats(e2e),
            "ttft_s": stats([r.ttft for r in good]),
            "itl_s": stats(itl), "chunk_gap_s": stats(gaps),
            "tokens_per_chunk": tokens / sum(len(r.chunks) for r in good) if good else None}


def _steady_rate(records: list[Record], until: float | None) -> float | None:
    if not until or until <= 0:
        return None
    return sum(n for r in records for t, n in r.chunks if t <= until) / until


# ---------------------------------------------------------------------------------------- the server


def scrape(client_sync, url: str) -> dict[str, float]:
    """Counters of a dspark server's /metrics, summed over label sets ({} for another server)."""
    try:
        text = client_sync.get(url + "/metrics").text
    except Exception:  # noqa: BLE001 -- metrics are optional
        return {}
    totals: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(dspark:[a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M):
        totals[name] = totals.get(name, 0.0) + float(value)
        phase = re.search(r'phase="([a-z]+)"', labels)
        if phase:  # the host time by phase, kept apart
            totals[f"{name}:{phase[1]}"] = float(value)
    return totals


class ServerProcess:
    """``python -m dspark.cli serve --port 0 ARGS`` as a child; its stderr is passed through."""

    def __init__(self, args: list[str], startup_timeout: float):
        import os

        src = str(Path(__file__).resolve().parents[2])  # this dspark, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", "0", *args],
                                     stderr=subprocess.PIPE, text=True, env=env)
        found = threading.Event()
        self.url: str | None = None

        def relay():
            for line in self.proc.stderr:
                sys.stderr.write(line)
                if self.url is None and line.startswith("dspark serve:") and " on http://" in line:
                    self.url = line.rsplit(" on ", 1)[1].strip()
                    found.set()
            found.set()

        threading.Thread(target=relay, daemon=True).start()
        try:
            if not found.wait(startup_timeout) or self.url is None:
                raise RuntimeError(f"the server did not start (exit status {self.proc.poll()})")
        except BaseException:  # a timeout, or a SIGTERM while it starts (stop_on_sigterm)
            self.stop()
            raise

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def stop_on_sigterm() -> None:
    """Make a SIGTERM (a time limit's ``timeout``) end this process through its ``finally`` blocks,
    which stop the server child: by default the process dies at once and the server outlives it,
    holding the GPU's memory for whatever runs next."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def wait_healthy(client_sync, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client_sync.get(url + "/health").status_code == 200:
                return
        except Exception:  # noqa: BLE001 -- not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------- prompts


# --mixed-settings: prompt i is sent with MIXED_SETTINGS[i % 4] (seed i when sampled), so every prompt
# repeats its own setting and tokens (request-stable) and every batch mixes greedy and sampled rows
MIXED_SETTINGS = ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0.95},
                  {"temperature": 1.0})


def random_prompts(count: int, length: int, vocab: int, max_length: int | None = None) -> list[list[int]]:
    """``count`` prompts of random token ids in ``[0, vocab)``, ``length`` tokens each or, with
    ``max_length``, a length drawn uniformly from ``[length, max_length]`` (seeded: always the same)."""
    import random

    rng = random.Random(0)
    lengths = [length if max_length is None else rng.randint(length, max_length) for _ in range(count)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def make_prompts(args) -> list:
    """Text prompts (the demo pair's held-out files) or random token ids (``--random-prompts``)."""
    if args.random_prompts:
        return random_prompts(args.num_prompts, args.random_prompts, args.vocab, args.random_prompts_max)
    from dspark.training.data import demo_pair, read_prompts

    records = read_prompts(str(demo_pair().prompts))
    return [records[i % len(records)]["text"][:args.prompt_chars] for i in range(args.num_prompts)]


def request_body(prompt, args, max_tokens: int, index: int = 0) -> dict:
    """The request for prompt ``index``: ``--temperature`` for all, or its ``MIXED_SETTINGS`` entry."""
    setting = MIXED_SETTINGS[index % len(MIXED_SETTINGS)] if args.mixed_settings else {"temperature": args.temperature}
    body = {"prompt": prompt, "max_tokens": max_tokens, **setting, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if args.model:
        body["model"] = args.model
    if setting["temperature"] > 0:
        body["seed"] = index  # every request of a prompt repeats: a mismatch is then a bug, not chance
    return body


# ---------------------------------------------------------------------------------------- main


async def benchmark(args, url: str, prompts: list) -> tuple[list[dict], dict[int, list[int]]]:
    """Every level in turn; returns the levels' summaries and each prompt's first output."""
    import httpx

    levels = []
    first_output: dict[int, list[int]] = {}  # prompt index -> its tokens the first time
    connections = max(args.concurrency) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(args.request_timeout)
    with httpx.Client(timeout=30) as sync:
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
            for c in args.concurrency:
                warm = [request_body(prompts[i % len(prompts)], args, args.warmup_tokens, i % len(prompts))
                        for i in range(c)]
                await run_level(client, warm, c)
                n = c * args.requests_per_client
                which = [i % len(prompts) for i in range(n)]
                before = scrape(sync, url)
                bodies = [request_body(prompts[i], args, args.max_tokens, i) for i in which]
                records, wall, full_until = await run_level(client, bodies, c)
                after = scrape(sync, url)
                level = summarize(records, wall, c, full_until)
                mismatched = 0
                for i, r in zip(which, records):
                    if r.error is None and r.token_ids is not None:
                        mismatched += first_output.setdefault(i, r.token_ids) != r.token_ids
                level["mismatched"] = mismatched
                rounds, accepted = (after.get(f"dspark:spec_decode_num_{k}_total", 0)
                                    - before.get(f"dspark:spec_decode_num_{k}_total", 0)
                                    for k in ("drafts", "accepted_tokens"))
                level["tau"] = 1 + accepted / rounds if rounds else None
                steps, busy, host, overlapped, plain, captures = (
                    after.get(f"dspark:engine_{k}_total", 0) - before.get(f"dspark:engine_{k}_total", 0)
                    for k in ("steps", "step_seconds", "host_seconds", "host_overlapped_seconds", "plain_steps",
                              "graph_captures"))
                level["engine_plain_steps"], level["engine_graph_captures"] = int(plain), int(captures)
                level["engine_steps"] = int(steps)
                level["engine_step_ms"] = 1000 * busy / steps if steps else None
                level["engine_host_ms"] = 1000 * host / steps if steps else None
                level["engine_host_overlapped_ms"] = 1000 * overlapped / steps if steps else None
                key = "dspark:engine_host_phase_seconds_total"
                level["engine_host_phase_ms"] = {
                    name[len(key) + 1:]: 1000 * (value - before.get(name, 0)) / steps
                    for name, value in after.items() if name.startswith(key + ":")} if steps else None
                level["engine_busy"] = busy / wall if steps else None
                levels.append(level)
                print(_line(level), flush=True)
    return levels, first_output


def _line(level: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.1f}"

    rate = level["per_request_tokens_per_s"]["p50"]
    tau = level["tau"]
    return (f"C={level['concurrency']:<3d} total {level['total_tokens_per_s'] or 0:9.1f} tok/s  per request "
            f"{rate or 0:7.1f} tok/s  TTFT p50 {ms(level['ttft_s']['p50'])} p99 {ms(level['ttft_s']['p99'])} ms  "
            f"ITL p50 {ms(level['itl_s']['p50'])} p99 {ms(level['itl_s']['p99'])} ms  "
            f"tau {'-' if tau is None else f'{tau:.2f}'}  failed {level['failed']}  mismatched {level['mismatched']}"
            f"  plain steps {level['engine_plain_steps']}  captures {level['engine_graph_captures']}")


def plot(out: Path) -> Path | None:
    """``out/frontier.png`` from every run in ``out`` (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for path in sorted(out.glob("*.json")):
        run = json.loads(path.read_text())
        if "label" not in run:  # not a run of this benchmark (a summary, a cost table)
            continue
        points = [(x, lv["total_tokens_per_s"], lv["concurrency"]) for lv in run.get("levels", [])
                  if (x := lv["per_request_tokens_per_s"]["p50"]) and lv["total_tokens_per_s"]]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=run["label"])
        for x, y, c in points:
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("tokens/s per request, median (interactivity)")
    ax.set_ylabel("total tokens/s (throughput)")
    ax.set_title("dspark serve: throughput-interactivity frontier (points: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=130)
    plt.close(fig)
    return out / "frontier.png"


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for <label>.json and frontier.png")
    parser.add_argument("--label", default="dspark", help="this run's name in the JSON file and the plot")
    parser.add_argument("--url", help="a running server (default: start dspark serve with the arguments after --)")
    parser.add_argument("--model", help="the model field of the requests (default: none, the server's)")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help=f"levels (default {DEFAULT_CONCURRENCY})")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each warm-up request")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=64, help="distinct prompts, used in turn")
    parser.add_argument("--prompt-chars", type=int, default=600, help="characters of each held-out file's start")
    parser.add_argument("--random-prompts", type=int, default=0, metavar="TOKENS",
                        help="random token-id prompts of this length instead (a target without a tokenizer)")
    parser.add_argument("--random-prompts-max", type=int, default=None, metavar="TOKENS",
                        help="with --random-prompts N: prompt lengths drawn from [N, TOKENS] (default: all N)")
    parser.add_argument("--mixed-settings", action="store_true",
                        help="prompt i with the i-th of greedy, T 0.7 / top-p 0.9, T 1 / top-p 0.95, T 1 (seed i); "
                             "instead of --temperature")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size for --random-prompts")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server to start")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error(f"--concurrency levels must be >= 1, got {args.concurrency}")
    for name in ("requests_per_client", "max_tokens", "warmup_tokens", "num_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.random_prompts and args.vocab < 1:
        parser.error("--random-prompts needs --vocab (the target's vocabulary size)")
    if args.random_prompts_max is not None and not 1 <= args.random_prompts <= args.random_prompts_max:
        parser.error(f"--random-prompts-max needs --random-prompts N with N <= it, got N = {args.random_prompts} "
                     f"and {args.random_prompts_max}")
    if args.mixed_settings and args.temperature:
        parser.error("--mixed-settings sets each request's temperature: leave out --temperature")
    if args.url and server_args:
        parser.error("--url drives a running server: no server arguments after --")
    return args, server_args


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    try:
        import httpx
    except ImportError:
        print("dspark bench.serve: needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args)
    if not args.url:
        stop_on_sigterm()
    server = None if args.url else ServerProcess(server_args, args.startup_timeout)
    try:
        url = args.url or server.url
        with httpx.Client(timeout=30) as sync:
            wait_healthy(sync, url, args.startup_timeout)
            models = sync.get(url + "/v1/models").json()
        levels, outputs = asyncio.run(benchmark(args, url, prompts))
    finally:
        status = server.stop() if server is not None else None
    report = {"label": args.label, "url": args.url, "server_args": server_args, "models": models,
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "temperature": args.temperature,
              "sampling": list(MIXED_SETTINGS) if args.mixed_settings else [{"temperature": args.temperature}],
              "prompts": (f"random ids x {args.random_prompts}" + (f"..{args.random_prompts_max}"
                                                                    if args.random_prompts_max else ""))
              if args.random_prompts
              else f"demo held-out files, first {args.prompt_chars} characters",
              "server_exit_status": status, "levels": levels,
              "outputs": {str(i): ids for i, ids in sorted(outputs.items())}}
    path = out / f"{args.label}.json"
    path.write_text(json.dumps(report, indent=1))
    png = plot(out)
    print(f"wrote {path}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    mismatched = sum(lv["mismatched"] for lv in levels)
    if mismatched:
        print(f"{mismatched} greedy outputs differed from the same prompt's first output: a bug in float32; "
              "in bfloat16 batched verification may round near-ties differently", file=sys.stderr)
    return 1 if sum(lv["failed"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
