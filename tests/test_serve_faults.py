"""Engine faults on ``dspark serve`` (CPU, demo pair, loopback HTTP).

(a) The engine fails one request (``RequestOutput`` with ``finish_reason="error"``, its contract for
errors caused by a particular request): injected by ``FailOne``, a wrapper that turns one chosen
request's second output into such an error output (and aborts it in the engine, as the engine does
for the requests it fails). That client gets a 500 (or, streaming, an in-band error event and
``[DONE]``); streams running beside it go on to their normal end, token for token as offline.
(b) An exception escapes the engine (``finish`` raises): logged with its traceback, every request in
flight gets a 500, ``/health`` answers 503 naming the cause, later requests 503, and ``dspark
serve`` exits 1 (``exit_status``; and end to end in a subprocess).
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark.engine import EngineConfig, LLMEngine, Request  # noqa: E402
from dspark.engine.request import RequestOutput  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import demo_pair  # noqa: E402
from test_serve import TIMEOUT, ServerThread  # noqa: E402

POISON = [7, 7, 7, 7]  # the prompt (token ids) of the request that fails
FATAL = [9, 9, 9, 9]  # the prompt whose arrival makes the engine fail for good
LONG = 64  # new tokens of the streams that run beside the failure
NORMAL = [[5, 6, 7, 8], [10, 11, 12]]


class FailOne:
    """The real engine, except that the request with prompt ``POISON`` fails at its second output."""

    def __init__(self, engine: LLMEngine):
        self._engine, self._victims, self.running_at_fault = engine, {}, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request: Request) -> int:
        rid = self._engine.add_request(request)
        if request.prompt_ids == POISON:
            self._victims[rid] = 0
        return rid

    def finish(self) -> list[RequestOutput]:
        outputs = self._engine.finish()
        for i, out in enumerate(outputs):
            if out.request_id not in self._victims:
                continue
            self._victims[out.request_id] += 1
            if self._victims[out.request_id] == 2:
                self.running_at_fault.append(self._engine.metrics.running)
                if not out.finished:
                    self._engine.abort(out.request_id)
                outputs[i] = RequestOutput(out.request_id, out.new_token_ids, True, "error",
                                           error="RuntimeError: injected fault in this request")
        return outputs

    def step(self):
        self.launch()
        return self.finish()


class DiesOnFatal(LLMEngine):
    """An engine whose round fails for good (an exception out of ``finish``) once a request with
    prompt ``FATAL`` was added."""

    doomed = False

    def add_request(self, request: Request) -> int:
        self.doomed = self.doomed or request.prompt_ids == FATAL
        return super().add_request(request)

    def finish(self):
        if self.doomed:
            super().finish()  # leave the engine consistent: only the raise is injected
            raise RuntimeError("device lost (injected)")
        return super().finish()


def dies_on_fatal(config: EngineConfig) -> LLMEngine:
    """``--engine-factory`` of the subprocess test: the demo pair in a ``DiesOnFatal``."""
    pair = demo_pair()
    return DiesOnFatal(str(pair.target), str(pair.draft), config)


def _engine(cls=LLMEngine) -> LLMEngine:
    pair = demo_pair()
    return cls(str(pair.target), str(pair.draft), EngineConfig(max_batch=8, max_model_len=256))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core box runs the demo much faster on one intra-op thread
    yield
    torch.set_num_threads(threads)


def _stream(http, prompt, max_tokens=LONG):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    context = http.stream("POST", "/v1/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200
    return context, response.iter_lines()


def _events(lines):
    return [line for line in lines if line]


def _tokens(events):
    return [t for e in events if e.startswith("data: {") and "choices" in e
            for c in json.loads(e[6:])["choices"] for t in c["token_ids"]]


def test_a_request_the_engine_fails_fails_alone():
    engine = _engine()
    reference = [r.token_ids for r in engine.generate([Request(p, LONG, ignore_eos=True) for p in NORMAL])]
    faulty = FailOne(engine)
    app = create_app(faulty, None, "demo")
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        streams = [_stream(http, p) for p in NORMAL]
        firsts = [[next(lines)] for _, lines in streams]  # both run
        _, poisoned = _stream(http, POISON)
        poisoned = _events(poisoned)
        alone = http.post("/v1/completions", json={"prompt": POISON, "max_tokens": LONG, "ignore_eos": True})
        rests = [firsts[i] + _events(lines) for i, (_, lines) in enumerate(streams)]
        for context, _ in streams:
            context.__exit__(None, None, None)
        later = http.post("/v1/completions", json={"prompt": NORMAL[0], "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True})
        health = http.get("/health")
        metrics = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}

    # the streaming victim: its first tokens, then the cause in-band, then [DONE]
    assert poisoned[-1] == "data: [DONE]" and len(poisoned) >= 3
    error = json.loads(poisoned[-2][6:])["error"]
    assert error["type"] == "server_error" and "injected fault in this request" in error["message"]
    assert all("error" not in json.loads(e[6:]) for e in poisoned[:-2])
    # the non-streaming victim: a 500 in OpenAI's shape naming the cause
    assert alone.status_code == 500 and "injected fault in this request" in alone.json()["error"]["message"]
    assert set(alone.json()["error"]) == {"message", "type", "param", "code"}
    assert faulty.running_at_fault and all(n >= 3 for n in faulty.running_at_fault)  # the streams ran meanwhile
    # the streams beside it: whole, token for token as offline, normal end
    for events, ref in zip(rests, reference):
        assert events[-1] == "data: [DONE]" and all('"error"' not in e for e in events)
        assert _tokens(events) == ref and json.loads(events[-2][6:])["usage"]["completion_tokens"] == LONG
        assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert later.status_code == 200 and later.json()["choices"][0]["token_ids"] == reference[0][:4]
    assert health.status_code == 200
    errors = [s.value for s in metrics["dspark:request_success"].samples if s.labels["finished_reason"] == "error"]
    assert errors == [2]
    from dspark.cli.serve import exit_status

    assert exit_status(app) == 0  # no fatal error: a clean shutdown exits 0


def test_an_escaping_exception_fails_the_server(caplog):
    engine = _engine(DiesOnFatal)
    failures = []
    app = create_app(engine, None, "demo", on_engine_failure=failures.append)
    with caplog.at_level(logging.ERROR, logger="dspark.serve"), ServerThread(app) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http, ThreadPoolExecutor(2) as pool:
        context, lines = _stream(http, NORMAL[0], max_tokens=200)
        first = next(lines)
        waiting = pool.submit(http.post, "/v1/completions", json={"prompt": NORMAL[1], "max_tokens": 200,
                                                                  "ignore_eos": True})
        deadline = time.monotonic() + TIMEOUT
        while engine.metrics.running < 2:  # both in flight before the fatal one arrives
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.01)
        fatal = http.post("/v1/completions", json={"prompt": FATAL, "max_tokens": 4})
        in_flight = waiting.result(TIMEOUT)
        streamed = [first] + _events(lines)
        context.__exit__(None, None, None)
        health = http.get("/health")
        after = http.post("/v1/completions", json={"prompt": NORMAL[0], "max_tokens": 4})

    for r in (fatal, in_flight):
        assert r.status_code == 500 and "device lost (injected)" in r.json()["error"]["message"]
    assert streamed[-1] == "data: [DONE]" and "device lost (injected)" in json.loads(streamed[-2][6:])["error"]["message"]
    assert health.status_code == 503 and "device lost (injected)" in health.json()["error"]["message"]
    assert after.status_code == 503
    assert [str(e) for e in failures] == ["device lost (injected)"]
    records = [r for r in caplog.records if r.name == "dspark.serve" and r.levelno == logging.ERROR]
    assert records and records[0].exc_info[1] is failures[0]  # logged with its traceback
    from dspark.cli.serve import exit_status

    assert exit_status(app) == 1


def test_dspark_serve_exits_nonzero_when_the_engine_fails():
    """End to end: ``dspark serve --engine-factory`` over ``DiesOnFatal``; the fatal request gets a
    500, the traceback is on stderr, the process shuts itself down with status 1."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", "0", "--max-model-len", "256",
                             "--engine-factory", "test_serve_faults:dies_on_fatal"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.monotonic() + TIMEOUT
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            line = proc.stderr.readline()
            url = line.rsplit(" on ", 1)[1].strip() if line.startswith("dspark serve:") and " on " in line else None
        logs = []
        reader = threading.Thread(target=lambda: logs.extend(proc.stderr), daemon=True)
        reader.start()
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            assert http.post("/v1/completions", json={"prompt": NORMAL[0], "max_tokens": 2}).status_code == 200
            fatal = http.post("/v1/completions", json={"prompt": FATAL, "max_tokens": 2})
        assert fatal.status_code == 500 and "device lost (injected)" in fatal.json()["error"]["message"]
        assert proc.wait(TIMEOUT) == 1
        reader.join(TIMEOUT)
        text = "".join(logs)
        assert "Traceback" in text and "RuntimeError: device lost (injected)" in text and "shutting down" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_requests_to_the_targets_last_position_finish_and_the_server_stays_up():
    """The issue-21 crash at full size: a target of 32 positions served at its own limit (prompt +
    max_tokens = 32, and one more than fits) -- each request ends at exactly the limit with "length",
    several at once, and the server keeps answering."""
    from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

    target = tiny_qwen3_target(max_position_embeddings=32)
    engine = LLMEngine(target, random_draft(tiny_draft_config(target.config), 0, target), EngineConfig(max_batch=4))
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with ServerThread(create_app(engine, None, "tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda job: http.post("/v1/completions", json={**body, **job}), [
                {"prompt": [5], "max_tokens": 31}, {"prompt": [5, 9, 2], "max_tokens": 29},
                {"prompt": [4, 4], "max_tokens": 28}]))
        for answer, (prompt, new) in zip(answers, ((1, 31), (3, 29), (2, 28))):
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == new
        too_long = http.post("/v1/completions", json={**body, "prompt": [5], "max_tokens": 32})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        assert http.get("/health").status_code == 200
