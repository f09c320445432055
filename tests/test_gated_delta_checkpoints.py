"""Gated DeltaNet checkpoints (``EngineConfig.gated_delta_checkpoints``: per slot two checkpoints
and the last window's inputs, the next window's ``K.gated_delta_replay_scan`` replaying its accepted
prefix, instead of a state per position) keep the hybrid target's cases exact: those of
tests/test_hybrid_target.py for rounds under each scheduler, the context limit, an abort, preemption,
a failed step, a CUDA graph's warm-up run and prompt log-probabilities run again here on Qwen3.5 and
Qwen3-Next with the switch on (and the prefix cache off) -- ``generate()``'s tokens, and after every
step each running request's recurrent state, the checkpoint advanced through its kept tokens, equal
to its committed tokens run alone. So do tests/test_hybrid_prefix_cache.py's cases with the switch
on (the prefix cache on): snapshots at block ends taken from the checkpoints (the replay kernel's
snapshot as it passes a block end, prompt chunks split there, a replay at save time), each the
state after its block's last position, and the per-position engine's. A frozen or failed forward
leaves what the next one reads; the Triton kernel runs in the engine (slow, under the interpreter)
and on a GPU (``gpu``); the switch is refused where it cannot apply."""

import contextlib

import pytest
import test_hybrid_prefix_cache as cached_cases
import test_hybrid_target as cases
import torch
from conftest import gpu, requires_triton
from test_hf_target import PROMPTS, _drafter, _generate, _model

import dspark.kernels as K
from dspark.bench.oracle import OracleEngine
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.model.hf_target import HFTarget
from dspark.model.hybrid import BLOCK_END

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-next"])
def hybrid(request):
    model = _model(request.param)
    return model, _drafter(model), [_generate(model, p, cases.NEW) for p in PROMPTS]


@pytest.fixture(autouse=True)
def checkpointed(monkeypatch):
    """Every engine the cases build keeps gated DeltaNet checkpoints."""
    def config(**fields):
        return EngineConfig(**{**fields, "enable_prefix_caching": False, "gated_delta_checkpoints": True})

    monkeypatch.setattr(cases, "EngineConfig", config)


@pytest.fixture
def cached_checkpointed(monkeypatch):
    """Every engine tests/test_hybrid_prefix_cache.py's cases build keeps gated DeltaNet
    checkpoints (the prefix cache as each case sets it)."""
    def config(**fields):
        return EngineConfig(**{**fields, "gated_delta_checkpoints": True})

    monkeypatch.setattr(cached_cases, "EngineConfig", config)


@pytest.mark.parametrize("case", ["test_a_chat_sharing_a_system_prompt_keeps_every_token_and_every_accepted_draft",
                                  "test_a_request_takes_the_prompt_of_one_still_running",
                                  "test_evicted_snapshots_cost_hits_not_tokens",
                                  "test_preempted_requests_resume_from_their_snapshots",
                                  "test_an_aborted_request_leaves_the_others_and_its_blocks_exact",
                                  "test_sampled_requests_are_the_same_with_the_cache_and_alone"])
def test_prefix_cache_case(hybrid, case, cached_checkpointed):
    """The prefix cache's cases with the switch on: the same tokens and drafts with the cache on and
    off, ``generate()``'s tokens, cache hits, every running request's states exact after every step."""
    model, draft, _ = hybrid
    getattr(cached_cases, case)((model, draft))
    assert cached_cases.EngineConfig().gated_delta_checkpoints


def test_snapshots_are_the_per_position_engines(hybrid):
    """The chat sharing a system prompt (tests/test_hybrid_prefix_cache.py) on an engine with
    checkpoints and one with a state per position, both caching: the same tokens, drafts and cache
    hits, and the same snapshots in the same slots (to the chunked and replayed scans' rounding)."""
    model, draft, _ = hybrid
    system, users = cached_cases.SYSTEM, cached_cases.USERS
    first = system + users[0]
    waves = [[first], [system + users[1]], [system + users[2], system + users[3]],
             [first + _generate(model, first, cached_cases.NEW) + users[4][:5]]]
    engines = [OracleEngine(model, draft, EngineConfig(**cached_cases.CONFIG, gated_delta_checkpoints=on),
                            acceptance=0.5) for on in (True, False)]
    checkpointed, per_position = (cached_cases._waves(e, model, waves, check=False) for e in engines)
    assert checkpointed == per_position and sum(r[3] for r in checkpointed) > 0
    pools = [e.runner.cache.states for e in engines]
    slots = [e.scheduler.blocks.snapshots.slot_of for e in engines]
    assert slots[0] == slots[1] and len(slots[0]) >= 3
    used = torch.tensor(sorted(slots[0].values()))
    for layer, states in pools[0].layers.items():  # (the conv inputs: the layers before, in their rounding)
        other = pools[1].layers[layer]
        for mine, theirs in ((states.snapshot_conv, other.snapshot_conv),
                             (states.snapshot_recurrent, other.snapshot_recurrent)):
            if mine is not None:
                torch.testing.assert_close(mine[used], theirs[used], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=[pytest.mark.slow, requires_triton])])
def test_a_saved_snapshot_is_the_state_after_its_blocks_last_position(hybrid, backend):
    """Through each backend's replay kernel (Triton: under the interpreter), after every step, each running request's last full block of committed tokens saved into a
    spare snapshot slot (``StatePool.save``, as a request leaving then would) holds the states after
    that block's last position, its tokens run alone -- off by one position, it fails. Saved both
    from a replay at save time (the block's end among tokens no forward has replayed yet) and from
    the entry a replay or prompt chunk wrote as it passed the block's end."""
    model, draft, _ = hybrid
    if backend == "triton" and model.config.model_type != "qwen3_5_text":
        pytest.skip("the Triton kernel runs on Qwen3.5 only here (about 30 s under the interpreter)")
    block = 4
    config = EngineConfig(**{**cached_cases.CONFIG, "kv_block_size": block, "state_snapshots": 1},
                          gated_delta_checkpoints=True)
    engine = OracleEngine(model, draft, config, acceptance=0.5)
    prompts = [cached_cases.SYSTEM[:13], cached_cases.SYSTEM[3:10]]
    expected = [_generate(model, p, cached_cases.NEW) for p in prompts]
    for p, e in zip(prompts, expected):
        engine.add_request(Request(p, cached_cases.NEW), e + [0] * 8)
    pool, paths = engine.runner.cache.states, set()
    spare = torch.tensor([0])  # the one snapshot slot, used by no request here (no prompt shares a block)
    while engine.has_unfinished():
        with K.use_backend(backend):
            engine.step()
        for seq in engine.scheduler.running:
            index = (seq.num_tokens - 1) // block - 1
            if index < 0:
                continue
            line, ends = torch.tensor([seq.slot]), (index + 1) * block
            paths.add("replayed now" if ends >= int(pool.checkpoint_positions[seq.slot]) else "passed")
            block_ends = {i: s.recurrent[:, BLOCK_END].clone() for i, s in pool.layers.items() if s.kept is not None}
            with K.use_backend(backend):
                pool.save(line, torch.tensor([index]), spare)
            for i, entries in block_ends.items():  # as they were: what the engine's forwards wrote is checked
                pool.layers[i].recurrent[:, BLOCK_END] = entries
            for layer, (recurrent, conv) in cases._reference_states(model, seq.token_ids(0, ends)).items():
                states = pool.layers[layer]
                torch.testing.assert_close(states.snapshot_conv[0], conv, rtol=1e-4, atol=1e-5)
                if recurrent is not None:
                    torch.testing.assert_close(states.snapshot_recurrent[0], recurrent, rtol=1e-4, atol=1e-5)
    assert paths == {"replayed now", "passed"}


@pytest.mark.parametrize("scheduler", cases.SCHEDULERS)
def test_states_after_every_round_are_the_committed_tokens(hybrid, scheduler, monkeypatch):
    cases.test_states_after_every_round_are_the_committed_tokens(hybrid, scheduler, monkeypatch)
    assert cases.EngineConfig().gated_delta_checkpoints


@pytest.mark.parametrize("case", ["test_the_context_limit_ends_the_output",
                                  "test_an_aborted_requests_slot_gives_the_next_request_no_state",
                                  "test_preempted_requests_run_again_from_zero_states",
                                  "test_a_failed_step_with_prompt_chunks_runs_them_again_from_zero_states",
                                  "test_prompt_log_probabilities_leave_the_states_to_the_chunks"])
def test_hybrid_target_case(hybrid, case):
    getattr(cases, case)(hybrid)


def test_a_graphs_warm_up_run_leaves_the_states_as_they_were(hybrid, monkeypatch):
    cases.test_a_graphs_warm_up_run_leaves_the_states_as_they_were(hybrid, monkeypatch)


def test_a_frozen_or_failed_forward_leaves_the_checkpoints_as_they_were(hybrid, monkeypatch):
    """What a line's next forward reads -- where its checkpoints stand, its current checkpoint slot and
    kept half -- is left as it was by a forward with frozen writes (prompt log-probabilities, a CUDA
    graph's warm-up run) and by one that failed after its first layers ran; a forward that runs
    through moves it on."""
    model, draft, _ = hybrid
    engine = LLMEngine(model, draft, cases.EngineConfig(max_batch=1, cuda_graphs=False))
    rid = engine.add_request(Request(PROMPTS[2], cases.NEW))
    for _ in range(3):
        engine.step()
    pool, seq = engine.runner.cache.states, engine.sequences[rid]

    def read_next():
        line, half, window = seq.slot, int(pool.checkpoint_slots[seq.slot]), pool.window
        return [pool.checkpoint_positions[line].clone(), pool.checkpoint_slots[line].clone()] + [
            t.clone() for s in pool.layers.values() if s.kept is not None
            for t in (s.recurrent[line, half], *(kept[line, half * window:(half + 1) * window] for kept in s.kept))]

    def run_anchor():  # two tokens from the anchor, through the engine's eager forward
        engine.runner.prompt_logits(seq.slot, [5, 6], seq.num_tokens - 1)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    before = read_next()
    run_anchor()
    assert same(read_next(), before)
    monkeypatch.setattr(pool, "frozen_writes", contextlib.nullcontext)

    def fail(module, args, kwargs):
        raise RuntimeError("a failure inside the forward")

    hook = HFTarget(model).layers[2].register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="a failure inside the forward"):
            run_anchor()
    finally:
        hook.remove()
    assert same(read_next(), before)
    run_anchor()
    assert not same(read_next(), before)


@pytest.mark.slow  # about 30 s: the interpreter runs every program of every layer's kernel
@requires_triton
def test_rounds_through_the_triton_kernel():
    """The Triton replay kernel (under the interpreter) in the engine: Qwen3.5's rounds with ragged
    verify lengths, drafts accepted at 1/2 -- ``generate()``'s tokens, every state exact."""
    model, new = _model("qwen3.5"), 6
    prompts = PROMPTS[:2]
    expected = [_generate(model, p, new) for p in prompts]
    with K.use_backend("triton"):
        engine = OracleEngine(model, _drafter(model), cases.EngineConfig(**cases.CHUNKED, **cases.SCHEDULERS["ragged"]),
                              acceptance=0.5)
        ids = [engine.add_request(Request(p, new), e + [0] * 8) for p, e in zip(prompts, expected)]
        outputs, checked = cases._run(engine, model, ids)
    assert [outputs[i] for i in ids] == expected and checked > 4


@gpu
def test_on_a_gpu_plain_and_dspark_greedy_are_generates_tokens(monkeypatch):
    """On CUDA in fp32 with the GPU's kernels (the Triton replay kernel, fla's chunked delta rule
    from the checkpoints) and CUDA graphs (their warm-up runs frozen): plain decoding and DSpark
    rounds give ``generate()``'s tokens on the same GPU."""
    monkeypatch.setattr(cases.round_plan, "REDRAFT_STEPS", 3)
    monkeypatch.setattr(cases.round_plan, "REDRAFT_DOUBLINGS", 0)  # every wait 3 plain rounds
    expected, plain, dspark = cases._on_device_outputs("qwen3.5", "cuda")
    assert plain == expected and dspark == expected


def test_the_switch_is_refused_where_it_cannot_apply(hybrid):
    """On a target without gated DeltaNet layers: refused, naming why. The bytes counted for the
    states are those allocated: checkpoints and kept inputs included (and, with the prefix cache,
    the block-end entry and snapshots)."""
    model, draft, _ = hybrid
    with pytest.raises(ValueError, match="gated_delta_checkpoints applies to a hybrid target's gated DeltaNet "
                                         r"layers, and this target has none \(stateful layers: \[0, 2\]\); "
                                         "leave it False"):
        LLMEngine(_model("bamba"), None, cases.EngineConfig(cuda_graphs=False))
    with pytest.raises(TypeError, match="gated_delta_checkpoints must be a bool"):
        EngineConfig(gated_delta_checkpoints=1)
    engine = LLMEngine(model, draft, cases.EngineConfig(max_batch=2, cuda_graphs=False))
    pool = engine.runner.cache.states
    allocated = sum(t.numel() * t.element_size() for s in pool.layers.values()
                    for t in (s.conv, s.recurrent, *(s.kept or ())) if t is not None)
    assert pool.layout.checkpoints and engine.target.state_bytes(2 + 1, pool.layout) == allocated
    per_position = LLMEngine(model, draft, EngineConfig(max_batch=2, cuda_graphs=False, enable_prefix_caching=False,
                                                        gated_delta_checkpoints=False))
    ring = per_position.runner.cache.states
    assert all(s.recurrent.shape[1] == 2 and ring.layers[i].recurrent.shape[1] == ring.window + 1
               for i, s in pool.layers.items() if s.kept is not None)
    assert torch.equal(pool.checkpoint_slots, torch.zeros_like(pool.checkpoint_slots))
    caching = LLMEngine(model, draft, EngineConfig(max_batch=2, cuda_graphs=False, gated_delta_checkpoints=True))
    pool = caching.runner.cache.states
    allocated = sum(t.numel() * t.element_size() for s in pool.layers.values()
                    for t in (s.conv, s.recurrent, s.snapshot_conv, s.snapshot_recurrent, *(s.kept or ()))
                    if t is not None)
    assert pool.layout.snapshots and caching.target.state_bytes(2 + 1, pool.layout) == allocated
    assert all(s.recurrent.shape[1] == 3 for s in pool.layers.values() if s.kept is not None)


def test_the_default_is_checkpoints_where_the_target_has_gated_deltanet_layers(hybrid):
    """``gated_delta_checkpoints=None`` (the default) resolves to True on a target with gated
    DeltaNet layers and to False on one without (Bamba's Mamba-2): what the engine then runs."""
    model, draft, _ = hybrid
    engine = LLMEngine(model, draft, EngineConfig(max_batch=1, cuda_graphs=False))
    assert engine.config.gated_delta_checkpoints and engine.runner.cache.states.layout.checkpoints
    mamba = LLMEngine(_model("bamba"), None, EngineConfig(max_batch=1, cuda_graphs=False))
    assert mamba.config.gated_delta_checkpoints is False and not mamba.runner.cache.states.layout.checkpoints
    assert EngineConfig().gated_delta_checkpoints is None
