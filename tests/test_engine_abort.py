"""Aborts at every moment a request can be in: any batch row, mid-prefill, still waiting.

A request's output does not depend on its batch (request-stable randomness), so every request that
is not aborted must end with exactly the tokens it gives alone, and the aborted one with a prefix of
them; the engine must free what the victim held and nothing else, and go on serving. Each row kind
runs: greedy rows, sampled rows (their draft distributions are per-row state that moves when a row
is compacted), a mix, and tree mode; on the CPU and, with every CUDA graph captured first as
``dspark serve`` does, on a GPU.
"""

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request, SequenceStatus

NEW = 10
SHORT = [[3, 17, 42, 8], [9, 1, 5], [44, 2, 71, 7, 7], [60, 11]]
LONG = list(range(20, 50))  # 30 prompt tokens: run in chunks over several steps beside the rows
WAITING = [12, 13, 14]
GREEDY = SamplingParams()


def _hot(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=seed)


# per kind: the sampling of the four short requests, the long one and the one that waits
KINDS = {
    "greedy": ([GREEDY] * 4, GREEDY, GREEDY),
    "sampled": ([_hot(i) for i in range(4)], _hot(4), _hot(5)),
    "mixed": ([GREEDY, _hot(1), GREEDY, _hot(3)], _hot(4), GREEDY),
    "tree": ([GREEDY, _hot(1), GREEDY, _hot(3)], GREEDY, _hot(5)),
}
# the victim: the request in batch row i when it is aborted, the one whose prompt is half run, the one
# still waiting for a slot
VICTIMS = [0, 1, 2, 3, "prefilling", "waiting"]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engines(request):
    """One engine per kind, reused by every case (each case must leave it as it found it). Five
    rows: four short requests run while the long prompt takes the fifth slot in chunks of what the
    step budget leaves (30 tokens: 10 per step beside four 5-token verifies, 6 beside four 6-node
    trees), and the sixth request waits."""
    device = request.param
    target = tiny_qwen3_target().to(device)
    draft = random_draft(tiny_draft_config(target.config), 0, target).to(device)
    # prefix caching off: each case runs the same prompts again, which would skip the prefill it aborts in
    chain = LLMEngine(target, draft, EngineConfig(max_batch=5, max_num_batched_tokens=30, enable_prefix_caching=False))
    tree = LLMEngine(target, draft, EngineConfig(max_batch=5, max_num_batched_tokens=30, draft_top_k=2,
                                                 tree_budget=6, enable_prefix_caching=False))
    for engine in (chain, tree):
        engine.capture_graphs()  # none on the CPU
    return {kind: tree if kind == "tree" else chain for kind in KINDS}


def _requests(kind: str) -> list[Request]:
    short, long, waiting = KINDS[kind]
    return [Request(p, NEW, s) for p, s in zip(SHORT, short)] + [Request(LONG, NEW, long),
                                                                  Request(WAITING, NEW, waiting)]


@pytest.fixture(scope="module")
def alone(engines):
    """Each request's tokens when it runs by itself."""
    return {kind: [engines[kind].generate([r])[0].token_ids for r in _requests(kind)] for kind in KINDS}


def _pick(engine: LLMEngine, ids: list[int], victim) -> int:
    """The id of the request that is at ``victim`` now."""
    status = {"prefilling": SequenceStatus.PREFILLING, "waiting": SequenceStatus.WAITING}
    for rid in ids:
        seq = engine.sequences[rid]
        if seq.status is status.get(victim, SequenceStatus.RUNNING) and (victim in status or seq.row == victim):
            return rid
    raise AssertionError(f"no request at {victim!r}: {[(s.status, s.row) for s in engine.sequences.values()]}")


def _assert_idle(engine: LLMEngine) -> None:
    """Nothing left of any request: slots free, every batch row padding (the scratch row after them
    is written by unused seats)."""
    runner, rows = engine.runner, engine.config.max_batch
    assert not engine.sequences and not engine.has_unfinished()
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_batch))
    assert not runner.state.active[:rows].any() and (runner.state.slot_ids[:rows] == runner.dummy_slot).all()


@pytest.mark.parametrize("victim", VICTIMS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_abort_ends_its_request_alone_wherever_it_is(engines, alone, kind, victim):
    engine = engines[kind]
    ids = [engine.add_request(r) for r in _requests(kind)]
    try:
        _abort_and_finish(engine, ids, victim, alone[kind])
    except BaseException:  # a failed case leaves nothing behind for the next
        for rid in ids:
            engine.abort(rid)
            engine.sequences.pop(rid, None)
        raise
    _assert_idle(engine)


def _abort_and_finish(engine: LLMEngine, ids: list[int], victim, expected: list[list[int]]) -> None:
    done = {rid: [] for rid in ids}
    for _ in range(2):  # the short requests run, the long prompt is half run, the last one waits
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    aborted = _pick(engine, ids, victim)
    engine.abort(aborted)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != aborted, "an aborted request produced output"
            done[out.request_id] += out.new_token_ids
            if out.finished:
                engine.sequences.pop(out.request_id)
    for i, rid in enumerate(ids):
        tokens = expected[i]
        assert done[rid] == (tokens[:len(done[rid])] if rid == aborted else tokens), f"request {i}"


def test_aborts_from_outside_the_engines_step_never_meet_its_inference_tensors(engines):
    """Every per-row buffer exists from the start as an ordinary tensor: nothing the inference-mode
    step allocates on first need is later written by ``abort`` (the server's disconnect path)."""
    for engine in {id(e): e for e in engines.values()}.values():
        engine.generate([Request(SHORT[0], 4, _hot(7)), Request(SHORT[1], 4, GREEDY)])
        inference = [name for name, t in engine.runner.state.tensors() if t.is_inference()]
        assert not inference, f"inference tensors among the row state: {inference}"
    with torch.inference_mode(False):  # abort outside any inference context, as an HTTP handler does
        engine = engines["sampled"]
        ids = [engine.add_request(r) for r in _requests("sampled")[:3]]
        engine.step()
        for rid in ids:  # the first row first: the last row moves into it
            engine.abort(rid)
    _assert_idle(engine)
