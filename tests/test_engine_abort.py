"""Aborts at every moment a request can be in: any batch row, mid-prefill, still waiting.

A request's output does not depend on its batch (request-stable randomness), so every request that
is not aborted must end with exactly the tokens it gives alone, and the aborted one with a prefix of
them; the engine must free what the victim held and nothing else, and go on serving. Each row kind
runs: greedy rows, sampled rows (their draft distributions are per-row state that moves when a row
is compacted), a mix, and tree mode; on the CPU and, with every CUDA graph captured first as
``dspark serve`` does, on a GPU. Requests that leave in the same step (finished together, aborted
one after another) leave the rows dense: the runner's moves of several rows at once equal moving
them one by one.
"""

import random


import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request, SequenceStatus
from dspark.engine.rows import LogitsPath

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


def _one_by_one(state: dict[str, torch.Tensor], paths: list, moves, start: int, stop: int, dummy: int) -> None:
    """``ModelRunner.move_rows(moves)`` then ``clear_rows(start, stop)``, a row and a tensor at a time."""
    for src, dst in moves:
        for t in state.values():
            t[dst] = t[src]
        paths[dst] = paths[src]
    for row in range(start, stop):
        state["slot_ids"][row] = dummy
        for name in ("active", "anchor", "anchor_pos", "ctx_pos"):
            state[name][row] = 0
        for name in ("grammar_mask", "draft_mask"):
            if name in state:
                state[name][row] = -1
        paths[row] = LogitsPath.GREEDY


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tree", [False, True])
def test_moving_rows_at_once_equals_moving_them_one_by_one(device, tree):
    """Random row state, then compactions one after another without a wait between them (on a GPU
    each batch of indices takes its own place in the pinned buffer while the last copy may run):
    every row tensor and logits path as the one-by-one reference leaves them."""
    target = tiny_qwen3_target().to(device)
    draft = random_draft(tiny_draft_config(target.config), 0, target).to(device)
    tree_mode = dict(draft_top_k=2, tree_budget=6) if tree else {}
    runner = LLMEngine(target, draft, EngineConfig(max_batch=8, **tree_mode)).runner
    names = {name for name, _ in runner.state.tensors()}
    assert {"logit_bias", "grammar_mask", "draft_mask", "capture"} <= names
    assert ("draft_probs" in names) != tree and ("tree_bits" in names) == tree
    rng = random.Random(0)
    for _, t in runner.state.tensors():
        t.copy_(torch.rand_like(t) if t.is_floating_point() else torch.randint_like(t, -9, 1000))
    runner.row_paths[:] = [rng.choice(list(LogitsPath)) for _ in runner.row_paths]
    expected = {name: t.clone() for name, t in runner.state.tensors()}
    paths = list(runner.row_paths)
    for n, k in [(8, 3), (7, 1), (6, 4), (5, 2), (8, 8), (4, 2)]:
        leaving = set(rng.sample(range(n), k))
        holes = sorted(r for r in leaving if r < n - k)
        stayers = [r for r in range(n - k, n) if r not in leaving]
        moves = list(zip(stayers, holes))
        runner.move_rows(moves)
        runner.clear_rows(n - k, n)
        _one_by_one(expected, paths, moves, n - k, n, runner.dummy_slot)
    for name, t in runner.state.tensors():
        assert torch.equal(t, expected[name]), name
    assert runner.row_paths == paths


def _assert_dense(engine: LLMEngine) -> None:
    """``running[i]`` in row i on the host and the device (its slot), the rows after them padding."""
    running, state = engine.scheduler.running, engine.runner.state
    n, rows = len(running), engine.config.max_batch
    assert [seq.row for seq in running] == list(range(n))
    assert state.slot_ids[:n].tolist() == [seq.slot for seq in running]
    assert state.active[:n].all() and not state.active[n:rows].any()
    assert (state.slot_ids[n:rows] == engine.runner.dummy_slot).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_requests_leaving_together_keep_the_rows_dense_and_their_tokens(device):
    """Eight requests of different lengths join in one step; the four of two tokens (rows 1, 3, 4,
    6) finish together in the next, the last rows' survivors moving into their rows; the waiting
    ones join as rows free up, more finish, and three are aborted between two steps, from the
    first, the last and a middle row. The rows stay dense and every request ends with its tokens
    alone (an aborted one with a prefix of them)."""
    target = tiny_qwen3_target().to(device)
    draft = random_draft(tiny_draft_config(target.config), 0, target).to(device)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=8, enable_prefix_caching=False))
    engine.capture_graphs()  # none on the CPU
    lengths = [NEW + 4, 2, 12, 2, 2, 7, 2, NEW, 5, 2, 9, NEW + 2]
    prompts = [SHORT[i % 4] + [i] for i in range(len(lengths))]
    requests = [Request(p, n, _hot(i) if i % 3 == 1 else GREEDY) for i, (p, n) in enumerate(zip(prompts, lengths))]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    moved, move_rows = [], engine.runner.move_rows
    engine.runner.move_rows = lambda moves: (moved.append(len(moves)), move_rows(moves))
    ids = [engine.add_request(r) for r in requests]
    done, aborted, steps = {rid: [] for rid in ids}, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
        steps += 1
        _assert_dense(engine)
        if steps == 1:
            assert [engine.sequences[rid].row for rid in ids[:8]] == list(range(8))
        if steps == 4:
            running = engine.scheduler.running
            aborted = [running[0].request_id, running[-1].request_id, running[len(running) // 2].request_id]
            for rid in aborted:
                engine.abort(rid)
                _assert_dense(engine)
    assert max(moved) >= 2 and len(set(aborted)) == 3  # several rows moved at once
    for rid, tokens in zip(ids, alone):
        assert done[rid] == (tokens[:len(done[rid])] if rid in aborted else tokens), f"request {rid}"


def test_releasing_a_running_request_named_twice_frees_its_row_once():
    """``Scheduler.release`` with a running request named twice (and another): each leaves once, the
    rows stay dense, and the rest go on to their own tokens."""
    target = tiny_qwen3_target()
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=4, enable_prefix_caching=False))
    requests = [Request(SHORT[i] + [i], NEW, GREEDY) for i in range(4)]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    ids = [engine.add_request(r) for r in requests]
    done = {rid: [] for rid in ids}
    for out in engine.step():
        done[out.request_id] += out.new_token_ids
    first, third = engine.sequences[ids[0]], engine.sequences[ids[2]]
    engine.scheduler.release([first, third, first])
    _assert_dense(engine)
    assert len(engine.scheduler.running) == 2 and first.row == third.row == -1
    assert first.status is third.status is SequenceStatus.FINISHED
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    assert done[ids[1]] == alone[1] and done[ids[3]] == alone[3]
