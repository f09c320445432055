"""Tensor-parallel targets on the CPU (gloo, 2 processes): the sharded engine's greedy output is
one process's, sampled requests are request-stable (alone or in a batch, the same tokens as one
process), aborts and tree mode too; a request that fails on every rank fails alone (fault
injection), while a failure one rank saw alone, a rank that fails (before or after it joined) or
dies ends the job with an error naming it; the ranks' agreement on a failure; the acceptance-replay
engine of ``bench.frontier -tp``. Also the shards themselves (slices of the checkpoint, the padded
vocabulary), the refusals, and (slow) ``dspark serve``'s engine process as rank 0, ``dspark eval`` /
``dspark profile -tp 2`` and the tensor-parallel benchmark; on 2 GPUs (gpu) NCCL with CUDA graphs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from model_cases import tiny_qwen3_target, write_tiny_draft

from dspark.engine.config import EngineConfig
from dspark.engine.llm_engine import EngineDeadError, LLMEngine
from dspark.engine.ranks import rank_device
from dspark.engine.request import Request, SamplingParams
from dspark.model.llama import TargetLM
from dspark.model.parallel import TensorParallel

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
NEW = 12
VOCAB = 97  # odd: the second rank's vocabulary shard has a padding row


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny target and its draft as directories; the ranks' processes take one thread each (on a
    busy 2-core box more only add synchronisation) and find this directory's test modules."""
    patch = pytest.MonkeyPatch()
    patch.setenv("OMP_NUM_THREADS", "1")
    patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    root = tmp_path_factory.mktemp("tp")
    target = tiny_qwen3_target(vocab_size=VOCAB)
    target.save_pretrained(root / "target")
    _word_tokenizer(VOCAB).save_pretrained(root / "target")
    write_tiny_draft(target, root / "draft", format="speculators")
    yield target, str(root / "target"), str(root / "draft")
    patch.undo()


def _word_tokenizer(vocab: int):
    """Token i is the word "t<i>" (``dspark eval`` reads prompts as text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def _engine(pair, size: int, **fields) -> LLMEngine:
    _, target, draft = pair
    return LLMEngine(target, draft, EngineConfig(max_batch=4, device="cpu", tensor_parallel_size=size, **fields))


def _tokens(engine: LLMEngine, requests: list[Request]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(requests)]


def _with_late_arrivals(engine: LLMEngine, first: list[Request], late: list[Request]) -> list[tuple]:
    """``first`` run two steps, then ``late`` join them: each request's (tokens, finish reason, error)."""
    ids = [engine.add_request(r) for r in first]
    outs = {}

    def step() -> None:
        for out in engine.step():
            tokens, _, _ = outs.get(out.request_id, ([], None, None))
            outs[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)

    step()
    step()
    ids += [engine.add_request(r) for r in late]
    while engine.has_unfinished():
        step()
    return [outs[i] for i in ids]


def _sampled(prompt: list[int], seed: int) -> Request:
    return Request(prompt, max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=seed))


# ---------------------------------------------------------------------------------------- the engine


POISON = [66, 66, 66]  # a prompt whose forward fails on every rank: the request's own failure
LONE = [65, 65, 65]  # a prompt whose forward fails on rank 1 alone (after its collectives): one GPU's failure


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


class FaultyEngine(LLMEngine):
    """Fault injection (on every rank's engine: the ranks build this class): the target's forward
    raises for a batch holding ``POISON`` on every rank, and after its collectives on rank 1 alone
    for one holding ``LONE``."""

    def _build(self, *args):
        super()._build(*args)
        real = self.target.forward

        def forward(input_ids, *rest, **kwargs):
            ids = input_ids.tolist()
            if _holds(ids, POISON):
                raise RuntimeError("injected fault in this request")
            logits = real(input_ids, *rest, **kwargs)
            if self.tp.rank == 1 and _holds(ids, LONE):
                raise RuntimeError("injected fault on rank 1")
            return logits

        self.target.forward = forward


class TestTwoRanks:
    """One engine of two ranks for these tests, the last of which ends it (one tensor-parallel engine
    per process at a time: the ranks' process group is the process's default one). The sps scheduler
    on the online acceptance estimator: verify lengths from host state, which the ranks must agree
    on (or their collectives would not match)."""

    SETTINGS = dict(scheduler="sps", threshold=0.3, schedule_signal="online")

    @pytest.fixture(scope="class")
    def engines(self, pair):
        _, target, draft = pair
        one, two = (FaultyEngine(target, draft, EngineConfig(max_batch=4, device="cpu", tensor_parallel_size=size,
                                                             **self.SETTINGS)) for size in (1, 2))
        yield one, two
        two.close()

    def test_greedy_output_is_one_process_output(self, engines):
        one, two = engines
        requests = [Request(p, max_new_tokens=NEW) for p in PROMPTS]
        expected = _tokens(one, requests)
        assert _tokens(two, requests) == expected
        assert two.metrics.errors == 0 and two.tp == TensorParallel(0, 2)
        assert two.target.num_heads == 2 and two.target.lm_head.shape[0] == 49  # rank 0 holds its shard

    def test_sampled_requests_are_request_stable(self, engines):
        """A sampled request's tokens are its own: alone or beside others on two ranks, and on one."""
        one, two = engines
        batch = [_sampled(p, seed=11 + i) for i, p in enumerate(PROMPTS)]
        together = _tokens(two, batch)
        alone = [_tokens(two, [r])[0] for r in batch[:2]]
        assert alone == together[:2]
        assert _tokens(one, batch) == together
        assert len({tuple(t) for t in together}) == len(PROMPTS)

    def test_abort_and_later_requests_stay_in_step(self, engines):
        """An abort reaches every rank: the next requests' tokens are still one process's."""
        one, two = engines
        rid = two.add_request(Request(PROMPTS[2], max_new_tokens=50))
        two.step()
        two.abort(rid)
        requests = [Request(p, max_new_tokens=NEW) for p in PROMPTS[:2]]
        assert _tokens(two, requests) == _tokens(one, requests)

    def test_plain_baseline_is_refused(self, engines):
        with pytest.raises(ValueError, match="tensor_parallel_size 2"):
            engines[1].plain()

    def test_a_failing_request_fails_alone(self, engines):
        """A request arrives beside running ones, and its prompt's forward fails on every rank: the
        step is retried without the prompt chunks and each tried alone, on every rank; that request
        ends with "error", the others' tokens are one process's (which failed the same request), and
        the engine goes on."""
        one, two = engines
        first = [Request(p, max_new_tokens=NEW) for p in PROMPTS[:2]]
        late = [Request([5, *POISON, 2], max_new_tokens=NEW), Request(PROMPTS[2], max_new_tokens=NEW)]
        expected = _with_late_arrivals(one, first, late)
        got = _with_late_arrivals(two, first, late)
        assert got == expected and got[2] == ([], "error", "RuntimeError: injected fault in this request")
        assert [r[1] for r in got] == ["length", "length", "error", "length"] and two.metrics.errors == 1
        assert _tokens(two, first) == _tokens(one, first)

    def test_a_failure_on_one_rank_alone_ends_the_job(self, engines):
        """A forward fails on rank 1 alone: the ranks would differ from there, so the job ends naming it."""
        two = engines[1]
        with pytest.raises(EngineDeadError, match=r"rank 1 failed: .*a step with prompt chunks failed for "
                                                  r"request\(s\) \[[\d, ]+\] on (this rank alone|rank 1, but)"):
            two.generate([Request(p, max_new_tokens=NEW) for p in [*PROMPTS[:2], LONE]])
        assert all(p.poll() is not None for p in two.ranks.processes)


class TestTreeRanks:
    """Tree mode under the threshold scheduler on two ranks; the last test kills a rank."""

    @pytest.fixture(scope="class")
    def engines(self, pair):
        settings = dict(draft_top_k=2, scheduler="threshold", threshold=0.05)
        one, two = _engine(pair, 1, **settings), _engine(pair, 2, **settings)
        yield one, two
        two.close()

    def test_tree_mode_matches_one_process(self, engines):
        one, two = engines
        requests = [Request(p, max_new_tokens=NEW) for p in PROMPTS[:3]]
        assert _tokens(two, requests) == _tokens(one, requests)

    @pytest.mark.skipif(sys.platform != "linux", reason="signals")
    def test_a_killed_rank_ends_the_job(self, engines):
        two = engines[1]
        two.ranks.processes[0].send_signal(signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"rank 1 failed: its process exited with code -9"):
            two.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])


def test_a_rank_that_fails_before_joining_ends_the_start(pair, tmp_path, monkeypatch):
    """A builder rank 1 cannot unpickle (its module is only on this process's path): an error naming
    the rank and the cause, not a wait in the process group's join."""
    (tmp_path / "only_here.py").write_text("def build(capture, *, tp, device):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from only_here import build

    with pytest.raises(EngineDeadError, match="rank 1 failed: ModuleNotFoundError: No module named 'only_here'"):
        LLMEngine(build, pair[2], EngineConfig(max_batch=2, device="cpu", tensor_parallel_size=2))


def test_the_ranks_agree_on_a_failure_or_end_the_job(monkeypatch):
    """``agree`` over a pipe (no processes): rank 0 and a rank that failed the same requests go on;
    a rank that failed others, a rank 0 that hears nothing, a rank whose rank 0 went on: the job ends."""
    from multiprocessing import Pipe

    from dspark.engine import ranks

    monkeypatch.setattr(ranks, "AGREE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ranks, "ERROR_GRACE_S", 0.0)
    failure = ("the batched step", (3, 4))

    def rank0_and_link():
        here, there = Pipe()
        group = ranks.RankGroup(2, torch.device("cpu"))
        group.conns = [here]
        return group, ranks.RankLink(there)

    group, link = rank0_and_link()
    link.conn.send(("failed", failure))
    group.agree(failure)
    link.agree(failure)  # rank 0's answer is waiting: agreed
    group.close()
    group, link = rank0_and_link()
    link.conn.send(("failed", ("log-probabilities", (3,))))
    with pytest.raises(EngineDeadError, match=r"rank 1 failed: log-probabilities failed for request\(s\) \[3\] "
                                              r"on rank 1, but the batched step failed for request\(s\) \[3, 4\] "
                                              r"on rank 0"):
        group.agree(failure)
    group, link = rank0_and_link()
    with pytest.raises(EngineDeadError, match=r"rank 0 failed: RuntimeError: the batched step failed for request\(s\) "
                                              r"\[3, 4\] on rank 0, not on rank 1 \(nothing from it in 0 s\)"):
        group.agree(failure)
    group, link = rank0_and_link()
    group.send(ranks.Op("finish"))  # rank 0 went on
    with pytest.raises(EngineDeadError, match=r"the batched step failed for request\(s\) \[3, 4\] on this rank "
                                              r"alone \(rank 0 went on\)"):
        link.agree(failure)


# ---------------------------------------------------------------------------------------- the shards


def test_shards_are_slices_of_the_checkpoint(pair):
    model, target, _ = pair
    full = TargetLM.from_pretrained(target)
    shards = [TargetLM.from_pretrained(target, tp=TensorParallel(r, 2)) for r in range(2)]
    assert [s.cache_kv_heads for s in shards] == [1, 1] and shards[0].num_heads == 2
    qkv, gate_up = full.layers[0]["qkv"], full.layers[0]["gate_up"]  # q 32 rows, k 16, v 16; gate 64, up 64
    for r, shard in enumerate(shards):  # each rank's heads' rows and features of the merged projections
        rows = [*range(16 * r, 16 * r + 16), *range(32 + 8 * r, 40 + 8 * r), *range(48 + 8 * r, 56 + 8 * r)]
        torch.testing.assert_close(shard.layers[0]["qkv"], qkv[rows], rtol=0, atol=0)
        rows = [*range(32 * r, 32 * r + 32), *range(64 + 32 * r, 96 + 32 * r)]
        torch.testing.assert_close(shard.layers[0]["gate_up"], gate_up[rows], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.layers[1]["o"] for s in shards], 1), full.layers[1]["o"], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.layers[1]["down"] for s in shards], 1), full.layers[1]["down"],
                               rtol=0, atol=0)
    head = torch.cat([s.lm_head for s in shards])
    assert head.shape[0] == 98 and not head[VOCAB:].any()  # ceil(97 / 2) rows each, the last one padding
    torch.testing.assert_close(head[:VOCAB], full.lm_head, rtol=0, atol=0)
    assert shards[1].vocab_lo == 49 and shards[1].vocab_size == VOCAB
    hf = TargetLM.from_hf_model(model, tp=TensorParallel(1, 2))
    torch.testing.assert_close(hf.layers[2]["qkv"], shards[1].layers[2]["qkv"], rtol=0, atol=0)


def test_heads_that_do_not_split_are_refused(pair):
    with pytest.raises(ValueError, match=r"key/value heads \(2\) do not split into 4 equal parts"):
        TargetLM.from_pretrained(pair[1], tp=TensorParallel(0, 4))


def test_refusals_before_any_rank_starts(pair, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="a 'gpt2' target runs its own modeling code"):
        LLMEngine(str(tmp_path / "gpt2"), None, EngineConfig(device="cpu", tensor_parallel_size=2))
    with pytest.raises(TypeError, match="needs the target as a checkpoint directory"):
        LLMEngine(TargetLM.from_pretrained(pair[1]), None, EngineConfig(device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="rank r runs on cuda:r"):
        rank_device("cuda:1", 0, 2)
    assert rank_device("cpu", 1, 2) == torch.device("cpu")


def test_cli_and_llm_take_the_size(pair, capsys):
    """``-tp`` / ``tensor_parallel_size`` reach the engine's check."""
    from dspark.cli import main
    from dspark.engine.api import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, inf\], got 0"):
        LLM(pair[1], pair[2], tensor_parallel_size=0)
    assert main(["generate", "--target", pair[1], "--draft", pair[2], "--prompt-ids", "1,2", "--device", "cpu",
                 "-tp", "0"]) == 2
    assert "tensor_parallel_size must be in [1, inf], got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_and_profile_take_the_size(pair, tmp_path, capsys):
    """``dspark eval -tp 2``: plain decoding, then the draft, each an engine of two ranks -- the
    report's outputs and tau are one process's; ``dspark profile -tp 2`` times the forwards on both
    ranks and writes the table."""
    import json

    from dspark.cli import main

    _, target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in p)}) + "\n" for p in PROMPTS[:2]))
    reports = []
    for size in (1, 2):
        out = tmp_path / f"eval{size}.json"
        assert main(["eval", "--target", target, "--draft", draft, "--prompts", str(prompts), "--max-new-tokens",
                     str(NEW), "--device", "cpu", "--dtype", "float32", "--json", str(out), "-tp", str(size)]) == 0
        reports.append(json.loads(out.read_text())["drafts"][0])
    assert reports[1]["identical"] == 2 and reports[1]["tau"] == reports[0]["tau"]
    assert reports[1]["acceptance_per_position"] == reports[0]["acceptance_per_position"]
    table = tmp_path / "cost.json"
    assert main(["profile", "--target", target, "--draft", draft, "--max-tokens", "16", "--context", "16",
                 "--device", "cpu", "--dtype", "float32", "--out", str(table), "-tp", "2"]) == 0
    written = json.loads(table.read_text())
    assert written["token_counts"] == [1, 2, 4, 8, 16] and written["tensor_parallel_size"] == 2
    assert len(written["draft_rows"]) == len(written["draft_time_ms"]) > 0
    assert written["decode_rows"] == [1, 2] and len(written["decode_time_ms"]) == 2  # 16 tokens: 2 rows of 8


def _serve_engine(target: str, draft: str, size: int) -> LLMEngine:
    """``dspark serve``'s engine process builds this (a module function: spawn pickles it by name)."""
    return LLMEngine(target, draft, EngineConfig(max_batch=4, device="cpu", tensor_parallel_size=size))


@pytest.mark.slow
def test_serve_engine_process_drives_its_ranks(pair):
    """The serve engine process (daemonic, spawned) is rank 0 of two: the tokens are one process's."""
    pytest.importorskip("fastapi")
    from functools import partial

    from test_serve_process import TIMEOUT, Sink

    from dspark.serve.engine_process import EngineClient

    requests = [Request(PROMPTS[0], NEW), _sampled(PROMPTS[2], seed=5)]
    expected = _tokens(_engine(pair, 1), requests)
    client = EngineClient(partial(_serve_engine, pair[1], pair[2], 2))
    client.start()
    try:
        sinks = [Sink() for _ in requests]
        for request, sink in zip(requests, sinks):
            client.submit(request, sink)
        assert [sink.wait_end().tokens() for sink in sinks] == expected
    finally:
        client.stop(TIMEOUT)
    assert client._process.exitcode == 0


@pytest.mark.slow
def test_tensor_parallel_benchmark_runs_on_the_cpu(tmp_path):
    """``python -m dspark.bench.tensor_parallel`` with the tiny shape: every rank builds its shard of one
    random model (the same greedy tokens at both sizes)."""
    import json

    from dspark.bench.tensor_parallel import main

    assert main(["--shape", "tiny", "--device", "cpu", "--sizes", "1,2", "--batch", "2", "--prompt", "8", "--new",
                 "12", "--out", str(tmp_path)]) == 0
    sizes = json.loads((tmp_path / "tensor_parallel.json").read_text())["sizes"]
    heads = {name: [sizes[k][name]["b1_outputs_head"] for k in ("1", "2")] for name in ("plain", "dspark")}
    assert heads["plain"][0] == heads["plain"][1] == heads["dspark"][0] == heads["dspark"][1]
    assert sizes["2"]["plain_b1_step_vs_tp1"] > 0


@pytest.mark.usefixtures("pair")  # the ranks' one thread each
def test_replay_frontier_engine_on_two_ranks(monkeypatch):
    """``bench.frontier --tensor-parallel-size``'s engines on the tiny shape: the acceptance-replay
    engine learns its prompts' continuations on every rank (its own constructor arguments reach
    them) and serves them with the same tokens as at size 1, drafts accepted; the cost table is
    profiled on every rank at once."""
    import json

    from dspark.bench.replay import TRACES, _prompts, replay_engine

    spec = dict(shape="tiny", vocab=1024, device="cpu", dtype="float32", draft_rank=16, traces=str(TRACES),
                num_prompts=2, prompt_tokens=6, max_tokens=10)
    outputs = []
    for size in (1, 2):
        monkeypatch.setenv("DSPARK_REPLAY", json.dumps({**spec, "tensor_parallel_size": size}))
        engine = replay_engine(EngineConfig(max_batch=2, device="cpu", dtype=torch.float32, max_model_len=64,
                                            tensor_parallel_size=size))
        try:
            results = engine.generate([Request(p, spec["max_tokens"]) for p in _prompts(spec)])
            outputs.append([r.token_ids for r in results])
            assert [r.token_ids for r in results] == [engine.known[tuple(p)][0][:10] for p in _prompts(spec)]
            assert engine.metrics.errors == 0 and max(max(r.stats.accept_lengths) for r in results) > 1
            if size == 2:
                table = engine.profile_costs([1, 8], context=8, tokens_per_row=8)
                assert len(table.step_time_ms) == 2 and table.draft_rows == tuple(engine.runner.buckets)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_with_cuda_graphs(pair):
    """On 2 GPUs (NCCL, each rank's CUDA graphs captured up front): float32 greedy and sampled tokens
    are one GPU's."""
    _, target, draft = pair
    requests = [Request(p, max_new_tokens=NEW) for p in PROMPTS] + [_sampled(p, seed=3) for p in PROMPTS]
    results = []
    for size in (1, 2):
        engine = LLMEngine(target, draft, EngineConfig(max_batch=8, device="cuda", dtype=torch.float32,
                                                       tensor_parallel_size=size))
        try:
            assert engine.capture_graphs() > 0
            results.append(_tokens(engine, requests))
        finally:
            engine.close()
    assert results[0] == results[1]
