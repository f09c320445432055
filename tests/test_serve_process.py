"""The engine in its own process (``dspark.serve.engine_process.EngineClient``, as ``dspark serve``
runs it): the same tokens as the engine in this process, the refusals and limits of ``EngineLoop``,
a start-up failure as one clear error, and a child that dies failing the requests in flight."""

import pytest

pytest.importorskip("fastapi")

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402
from dspark.engine.request import RequestOutput  # noqa: E402
from dspark.serve.engine_loop import ACCEPTED, EngineDead, QueueFull, ServerClosing  # noqa: E402
from dspark.serve.engine_process import EngineClient, EngineStartError  # noqa: E402
from test_serve import Sink as ServeSink  # noqa: E402

TIMEOUT = 60


def tiny_engine(max_batch: int = 4) -> LLMEngine:
    """The child's engine (this module is importable there: spawn passes ``sys.path``)."""
    from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

    target = tiny_qwen3_target()
    return LLMEngine(target, random_draft(tiny_draft_config(target.config), 0, target),
                     EngineConfig(max_batch=max_batch, max_model_len=256))


def one_row_engine() -> LLMEngine:
    return tiny_engine(max_batch=1)


def broken_engine() -> LLMEngine:
    raise ValueError("draft 'nowhere/config.json': no such file")


class Sink(ServeSink):
    """``test_serve.Sink`` that also waits for a request's end and collects its tokens."""

    def wait_end(self):
        def ended():
            return self and (isinstance(self[-1], BaseException)
                             or (isinstance(self[-1], RequestOutput) and self[-1].finished))

        with self.event:
            assert self.event.wait_for(ended, TIMEOUT)
        return self

    def tokens(self):
        return [t for item in self if isinstance(item, RequestOutput) for t in item.new_token_ids]


REQUESTS = [Request([1, 2, 3], 12), Request([7, 8], 9, ignore_eos=True),
            Request([4, 5, 6, 7], 10, SamplingParams(0.8, top_p=0.9, seed=3))]


def test_the_engine_process_gives_the_tokens_of_the_engine_here():
    expected = [r.token_ids for r in tiny_engine().generate(REQUESTS)]
    client = EngineClient(tiny_engine)
    client.start()
    try:
        assert client.max_model_len == 256 and client.info["max_batch"] == 4 and client.info["drafter"]
        sinks = [Sink() for _ in REQUESTS]
        for request, sink in zip(REQUESTS, sinks):
            client.submit(request, sink)
        for sink, tokens in zip(sinks, expected):
            assert sink.wait_end()[0] is ACCEPTED  # identity: the app compares with `is`
            assert sink.tokens() == tokens
        # the metrics copy came with the last outputs
        assert client.metrics.generated_tokens == sum(map(len, expected)) and client.pending == 0
    finally:
        client.stop(TIMEOUT)
    assert not client.alive and client._process.exitcode == 0
    with pytest.raises(ServerClosing):
        client.submit(REQUESTS[0], Sink())


def test_refusals_queue_limit_abort_and_stop():
    client = EngineClient(one_row_engine, max_waiting=1)
    client.start()
    try:
        refused = Sink()
        client.submit(Request([1] * 300, 4), refused)  # past the context: the engine's refusal
        assert isinstance(refused.wait_end()[0], ValueError) and "context limit" in str(refused[0])
        long = Request([1, 2, 3], 200, ignore_eos=True)
        running, waiting = Sink(), Sink()
        handle = client.submit(long, running)
        client.submit(long, waiting)
        with pytest.raises(QueueFull, match="capacity"):  # 1 running + 1 waiting
            client.submit(long, Sink())
        client.abort(handle)
        assert running.wait_end()[-1].finish_reason == "abort" and len(running.tokens()) < 200
    finally:
        client.stop(TIMEOUT)  # the waiting one has no client any more: aborted
    assert waiting.wait_end()[-1].finish_reason == "abort"


def test_a_failed_start_is_one_clear_error():
    with pytest.raises(EngineStartError, match="nowhere/config.json"):
        EngineClient(broken_engine)


def test_a_dead_engine_process_fails_the_requests_in_flight():
    failures = []
    client = EngineClient(one_row_engine, on_failure=failures.append)
    client.start()
    sink = Sink()
    client.submit(Request([1, 2, 3], 200, ignore_eos=True), sink)
    sink.wait(2)  # accepted and running
    client._process.kill()
    assert isinstance(sink.wait_end()[-1], EngineDead) and "exited" in str(sink[-1])
    assert failures and not client.alive
    with pytest.raises(EngineDead):
        client.submit(Request([1, 2], 4), Sink())
    client.stop(TIMEOUT)
