"""Clients that go away, through ``dspark serve`` (CPU, demo pair, loopback HTTP).

Fault injection: many streams at once, greedy and sampled (the OpenAI default samples), some clients
leaving at random points -- while waiting, mid-prefill, before the first event, mid-stream, a
non-streamed request whose client times out -- while the others must end with exactly the tokens their request gives offline (a
request's output does not depend on its batch). A bounded soak against ``python -m dspark.cli
serve``: a few hundred short requests (``DSPARK_SOAK_REQUESTS`` for more) with random disconnects; no
request that was not abandoned fails, and the server's memory ends where it began.
"""

import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import read_prompts  # noqa: E402
from test_serve import TIMEOUT, ServerThread, pair, tokenizer  # noqa: E402,F401 (fixtures)

MAX_BATCH = 4  # 16 clients: 4 rows, the others wait and join as rows free up
NEW = 24
CLIENTS = 16
# the soak's requests are shorter: its power is in the number of aborts (a leak grows with them), and
# 12 tokens (some four events) still leave room to go before the first event, mid-stream or after the
# last; 240 requests of 12 tokens take ~30 % less time than of NEW
SOAK_NEW = 12


@pytest.fixture(scope="module")
def prompt_ids(pair, tokenizer):
    return [tokenizer(r["text"][:120])["input_ids"] for r in read_prompts(str(pair.prompts))[:CLIENTS]]


def _settings(i: int) -> dict:
    """Client i's sampling: greedy, sampled, nucleus-sampled in turn (seeded: each repeats)."""
    return [dict(temperature=0.0), dict(temperature=0.8, seed=100 + i), dict(temperature=1.0, top_p=0.9, seed=i)][i % 3]


def _sampling(settings: dict) -> SamplingParams:
    return SamplingParams(settings["temperature"], 0, settings.get("top_p", 1.0), settings.get("seed", 0))


@pytest.fixture(scope="module")
def served(pair, tokenizer, prompt_ids):
    """(server, engine, each client's tokens offline)."""
    # a step budget that leaves 8 prompt tokens beside four 8-token verifies: prompts run over several
    # steps, so a client that leaves early often leaves mid-prefill
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=MAX_BATCH, max_model_len=256,
                                                                       max_num_batched_tokens=40))
    offline = engine.generate([Request(p, NEW, _sampling(_settings(i)), ignore_eos=True)
                               for i, p in enumerate(prompt_ids)])
    with ServerThread(create_app(engine, tokenizer, "demo")) as server:
        yield server, engine, [r.token_ids for r in offline]


def _body(prompt: list[int], settings: dict, stream: bool, new: int = NEW) -> dict:
    return {"prompt": prompt, "max_tokens": new, "ignore_eos": True, "stream": stream, "return_token_ids": True,
            **settings}


def _stream_tokens(http: httpx.Client, body: dict, leave_after: int | None) -> list[int] | None:
    """The stream's token ids; None when the client leaves after ``leave_after`` events (0: before the first)."""
    import json

    tokens = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for n, line in enumerate(line for line in response.iter_lines() if line):
            if leave_after is not None and n >= leave_after:
                return None  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                break
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            tokens += event["choices"][0]["token_ids"]
    return tokens


def _client(url: str, body: dict, plan: str, rng: random.Random) -> list[int] | None:
    """One client following ``plan``: ``"stay"`` (reads to the end), ``"leave"`` (a stream it drops
    at a random event), ``"timeout"`` (a non-streamed request it gives up on)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        if plan == "timeout":
            try:
                http.post("/v1/completions", json={**body, "stream": False}, timeout=rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                pass
            return None
        return _stream_tokens(http, body, rng.randint(0, body["max_tokens"] // 2) if plan == "leave" else None)


def _wait_idle(engine: LLMEngine) -> None:
    deadline = time.monotonic() + TIMEOUT
    while engine.metrics.running or engine.metrics.waiting or len(engine.scheduler.free_slots) < MAX_BATCH:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clients_that_leave_at_random_points_take_nothing_from_the_others(served, prompt_ids, seed):
    server, engine, offline = served
    rng = random.Random(seed)
    plans = [rng.choice(["stay", "stay", "leave", "timeout"]) for _ in prompt_ids]
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_client, server.url, _body(p, _settings(i), True), plan, random.Random(seed * 100 + i))
                   for i, (p, plan) in enumerate(zip(prompt_ids, plans))]
        results = [f.result(TIMEOUT) for f in futures]
    for i, (plan, tokens) in enumerate(zip(plans, results)):
        if plan == "stay":
            assert tokens == offline[i], f"client {i} ({_settings(i)}) got other tokens"
    _wait_idle(engine)
    assert not engine.sequences and sorted(engine.scheduler.free_slots) == list(range(MAX_BATCH))
    # the server and its engine go on: a request after the storm gives the offline tokens
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        assert _stream_tokens(http, _body(prompt_ids[1], _settings(1), True), None) == offline[1]


# ---- soak ------------------------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children (the engine process), KiB."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total = 0
    for p in [pid, *map(int, children)]:
        status = Path(f"/proc/{p}/status").read_text()
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    return total


def _metric(http: httpx.Client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no metric {name} {labels}")


def _start_server(args: list[str]):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", "0", *args], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline, url = time.monotonic() + 4 * TIMEOUT, None  # a GPU captures its graphs first
    while url is None:  # "dspark serve: ... on http://127.0.0.1:PORT" (after "captured N CUDA graphs ..." on a GPU)
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
        found = re.search(r" on (http://\S+)", proc.stderr.readline())
        url = found and found.group(1)
    logs: list[str] = []
    threading.Thread(target=lambda: logs.extend(proc.stderr), daemon=True).start()
    return proc, url, logs


def test_soak_with_random_disconnects_leaks_nothing(pair, prompt_ids):
    total = int(os.environ.get("DSPARK_SOAK_REQUESTS", "240"))
    proc, url, logs = _start_server(["--max-batch", "8", "--max-model-len", "256"])
    rng = random.Random(7)
    plans = [rng.choice(["stay", "stay", "leave", "timeout"]) for _ in range(total)]

    def run(indices, workers=12):
        with ThreadPoolExecutor(workers) as pool:
            futures = {i: pool.submit(_client, url, _body(prompt_ids[i % CLIENTS], _settings(i), True, SOAK_NEW),
                                      plans[i], random.Random(i)) for i in indices}
            return {i: f.result(TIMEOUT * 4) for i, f in futures.items()}

    try:
        warm = total // 4  # the allocator and the engine's buffers settle first
        results = run(range(warm))
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            time.sleep(0.5)
            before, device_before = _rss_kib(proc.pid), _metric(http, "dspark:engine_device_memory_bytes")
            results |= run(range(warm, total))
            deadline = time.monotonic() + TIMEOUT
            while _metric(http, "dspark:num_requests_running") or _metric(http, "dspark:num_requests_waiting"):
                assert time.monotonic() < deadline, "the server did not go idle"
                time.sleep(0.1)
            after, device_after = _rss_kib(proc.pid), _metric(http, "dspark:engine_device_memory_bytes")
            assert http.get("/health").status_code == 200
            assert _metric(http, "dspark:request_success_total", finished_reason="error") == 0
        stayed = [i for i in results if plans[i] == "stay"]
        assert all(len(results[i]) == SOAK_NEW for i in stayed), "a request that was not abandoned did not finish"
        assert proc.poll() is None, "the server died"
        # a leak of one request's row or slot state (its tokens, logprob rows, a KV line) per abort
        # would grow with the aborts; allocator noise does not
        assert after - before < 64 * 1024, f"resident memory grew by {(after - before) // 1024} MiB"
        assert device_after == device_before, f"device memory {device_before:.0f} -> {device_after:.0f} bytes"
        assert not any("Traceback" in line for line in logs), "".join(logs)
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
