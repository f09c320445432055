"""Hybrid targets (gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba-2: Bamba, Granite-4, Falcon-H1;
Mamba-1: Jamba with experts, attention-free Mamba; short convolutions: LFM2) through the engine:
the states of their stateful layers (``dspark.model.hybrid``, ``dspark.model.mamba``) are exact
however a round ends.

The peers' reported failures are the cases: acceptance decided per draft (``bench.oracle`` drafts
of the target's own continuation, each kept with probability 1/2: rejected first drafts, partial and
full acceptance), ragged verify lengths and rounds with zero drafts (the cost scheduler's plain
rounds), the context limit, an abort between rounds with the slot reused by a new request,
preemption, a failed step, a CUDA graph's warm-up run, a Mamba-2 dt limit (clamping prompt positions
only, as transformers does). In every case the output equals
transformers' ``generate()``, and after every step each running request's states -- the recurrent
state and the conv inputs before its anchor -- equal those of its committed tokens run alone in one
forward (a prompt run in chunks included): a rollback that kept a rejected draft's state, or a stale
state of a slot's earlier request, fails here even where the greedy tokens happen to agree. Tree
mode is refused naming the reason. Sampled speculative decoding follows the target's distribution
given each output's history (slow: chi-square and TV over every position's own distribution).
Prefix caching on these targets: tests/test_hybrid_prefix_cache.py.
"""

import contextlib
from copy import deepcopy
from functools import partial

import pytest
import torch
from conftest import gpu, requires_triton
from test_hf_target import HYBRID, PROMPTS, _drafter, _generate, _model

from dspark.bench.oracle import OracleEngine
from dspark.engine import llm_engine, round_plan
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.request import Request
from dspark.engine.schedulers import SPSCostTable
from dspark.model import hybrid as hybrid_model  # (``hybrid`` is the fixture)
from dspark.model.hf_target import HFTarget
from dspark.model.llama import AttentionBatch

# the per-position states (tests/test_gated_delta_checkpoints.py runs these cases again under checkpoints,
# the gated DeltaNet default)
EngineConfig = partial(llm_engine.EngineConfig, gated_delta_checkpoints=False)

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 16
CHUNKED = dict(max_batch=3, max_num_batched_tokens=3 * 5 + 4, cuda_graphs=False)  # prompts run in chunks
SCHEDULERS = {  # every draft verified; ragged verify lengths per row; plain rounds (no drafts) between drafting ones
    "every-draft": dict(scheduler="off"),
    "ragged": dict(scheduler="cost", cost_table=SPSCostTable((1, 64), (1.0, 2.0))),
    "plain-rounds": dict(scheduler="cost", cost_table=SPSCostTable((1, 2, 64), (1.0, 1.6, 60.0))),
}


@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request):
    model = _model(request.param)
    return model, _drafter(model), [_generate(model, p, NEW) for p in PROMPTS]


def _reference_states(model, tokens: list[int]) -> dict:
    """The states after ``tokens`` run alone in one forward on a fresh cache, position by position
    (the sequential scan, also for gated DeltaNet: the chunked one is what is checked; ``_states_at``)."""
    target, n = HFTarget(model), len(tokens)
    cache = target.new_cache(1, n + 1)
    i32 = dict(dtype=torch.int32)
    with _sequential_scans():
        target.forward(torch.tensor(tokens), torch.arange(n, **i32), torch.zeros(n, **i32),
                       AttentionBatch(torch.tensor([0], **i32), torch.tensor([0], **i32), torch.tensor([0, n], **i32),
                                      n), cache)
    return {layer: _states_at(cache.states, layer, 0, n) for layer in cache.states.layers}


@contextlib.contextmanager
def _sequential_scans():
    """Within: gated DeltaNet prompt chunks and rounds scanned position by position
    (``hybrid.CHUNKED_PROMPTS``, ``hybrid.WINDOW_SCAN_DEVICES``)."""
    devices = hybrid_model.WINDOW_SCAN_DEVICES
    hybrid_model.CHUNKED_PROMPTS, hybrid_model.WINDOW_SCAN_DEVICES = False, set()
    try:
        yield
    finally:
        hybrid_model.CHUNKED_PROMPTS, hybrid_model.WINDOW_SCAN_DEVICES = True, devices


def _states_at(pool, layer: int, line: int, n: int):
    """Layer ``layer``'s states of ``line`` after ``n`` tokens, by position (the pools' layouts
    differ): the recurrent state after position n-1 (None: a conv-only layer; under gated DeltaNet
    checkpoints, ``_checkpointed_state``) and the conv inputs at positions n-K+1 .. n-1 (K the kernel)."""
    states = pool.layers[layer]
    last = torch.tensor(n - 1)
    recurrent = None if states.recurrent is None else _checkpointed_state(pool, states, line, n) \
        if states.kept is not None else states.recurrent[line, pool.recurrent_entries(last, states.recurrent)]
    positions = torch.arange(max(n - states.kernel + 1, 0), n)
    return recurrent, states.conv[line, pool.conv_entries(positions, states.conv, states.kernel)[0]]


def _checkpointed_state(pool, states, line: int, n: int) -> torch.Tensor:
    """The gated delta rule's state of ``line`` after ``n`` tokens under checkpoints: its current
    checkpoint advanced through the kept tokens up to position n-1 (on copies; the PyTorch reference)."""
    import dspark.kernels as K

    slot, window = int(pool.checkpoint_slots[line]), pool.window
    replayed = n - int(pool.checkpoint_positions[line])
    assert 0 <= replayed <= window, (n, int(pool.checkpoint_positions[line]))
    checkpoints, kept = states.recurrent.clone(), [t.clone() for t in states.kept]
    none = [t[0, :0] for t in kept]  # no new tokens: [0, HV, ...]
    at = torch.tensor([line])
    replay = K.Replay(at, read_entries=at * 0 + (slot if n else -1), replay_entries=at * 0 + slot * window,
                      replay_counts=at * 0 + replayed, write_entries=at * 0 + 1 - slot, keep_entries=at * 0,
                      first_tokens=at * 0, token_counts=at * 0)
    with K.use_backend("reference"):
        K.gated_delta_replay_scan(none[0], *none, checkpoints, *kept, *replay, scale=1.0)
    return checkpoints[line, 1 - slot]


def _check_running_states(engine, model) -> int:
    """Assert that every running request's states equal those of its committed tokens run alone
    (all but the anchor: what the target has run); returns how many requests were checked."""
    pool = engine.runner.cache.states
    for seq in engine.scheduler.running:
        tokens = seq.token_ids(0, seq.num_tokens - 1)
        for layer, (recurrent, conv) in _reference_states(model, tokens).items():
            got_recurrent, got_conv = _states_at(pool, layer, seq.slot, len(tokens))
            if recurrent is not None:
                torch.testing.assert_close(got_recurrent, recurrent, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got_conv, conv, rtol=1e-4, atol=1e-5)
    return len(engine.scheduler.running)


def _run(engine, model, requests) -> tuple[dict[int, list[int]], int]:
    """Step ``engine`` (requests already added: their ids) to the end, checking the running
    requests' states after every step; returns each request's output and the states checked."""
    outputs, checked = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        checked += _check_running_states(engine, model)
    return {rid: outputs.get(rid, []) for rid in requests}, checked


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_states_after_every_round_are_the_committed_tokens(hybrid, scheduler, monkeypatch):
    """Drafts of the target's continuation, each accepted with probability 1/2 (rejected first
    drafts, partial and full acceptance), under each scheduler (every draft verified; ragged verify
    lengths; plain rounds between drafting ones): ``generate()``'s tokens, and after every step each
    running request's states equal its committed tokens run alone."""
    monkeypatch.setattr(round_plan, "REDRAFT_STEPS", 3)  # the cost scheduler drafts again after 3 plain rounds
    monkeypatch.setattr(round_plan, "REDRAFT_DOUBLINGS", 0)  # every wait 3 plain rounds
    model, draft, expected = hybrid
    engine = OracleEngine(model, draft, EngineConfig(**CHUNKED, **SCHEDULERS[scheduler]), acceptance=0.5)
    ids = [engine.add_request(Request(p, NEW), e + [0] * 8) for p, e in zip(PROMPTS, expected)]
    stats = [engine.sequences[i].stats for i in ids]
    outputs, checked = _run(engine, model, ids)
    assert [outputs[i] for i in ids] == expected
    assert checked > len(PROMPTS) * 4
    p = engine.num_drafts
    rounds = [(s, a) for st in stats for s, a in zip(st.scheduled_lengths, st.accept_lengths)]
    if scheduler == "every-draft":
        assert {1, p + 1} <= {a for _, a in rounds} and any(1 < a < p + 1 for _, a in rounds)
    elif scheduler == "ragged":
        assert len({s for s, _ in rounds}) > 2
    else:  # a plain round after a drafting one, and a drafting one after plain ones
        pairs = [pair for st in stats for pair in zip(st.scheduled_lengths, st.scheduled_lengths[1:])]
        assert any(a > 0 and b == 0 for a, b in pairs) and any(a == 0 and b > 0 for a, b in pairs)


@pytest.mark.parametrize(("name", "backend"), [("qwen3.5", "reference"),
                                               pytest.param("qwen3.5", "triton", marks=requires_triton),
                                               pytest.param("bamba", "triton", marks=requires_triton),
                                               ("falcon-h1", "reference")])
def test_rounds_through_the_window_kernels_keep_every_state(name, backend, monkeypatch):
    """Gated DeltaNet and Mamba-2 rounds through ``K.gated_delta_scan`` / ``K.selective_state_scan``
    (a group's whole window in one call, as on a GPU; here their PyTorch reference and their Triton
    kernels under the interpreter), every conv through ``K.causal_conv_window``: ragged verify
    lengths, rejected and accepted drafts, plain rounds and prompt chunks give ``generate()``'s
    tokens, and after every step the states equal the committed tokens run position by position
    (the conv by ``F.conv1d``)."""
    import dspark.kernels as K

    monkeypatch.setattr(round_plan, "REDRAFT_STEPS", 3)
    monkeypatch.setattr(round_plan, "REDRAFT_DOUBLINGS", 0)  # every wait 3 plain rounds
    monkeypatch.setattr(hybrid_model, "WINDOW_SCAN_DEVICES", {"cuda", "cpu"})
    calls = {}
    for kernel in ("gated_delta_scan" if name == "qwen3.5" else "selective_state_scan", "causal_conv_window"):
        def counted(*a, run=getattr(K, kernel), kernel=kernel, **k):
            calls[kernel] = calls.get(kernel, 0) + 1
            return run(*a, **k)

        monkeypatch.setattr(K, kernel, counted)
    model = _model(name)
    draft, expected = _drafter(model), [_generate(model, p, NEW) for p in PROMPTS]
    with K.use_backend(backend):
        engine = OracleEngine(model, draft, EngineConfig(**CHUNKED, **SCHEDULERS["plain-rounds"]), acceptance=0.5)
        ids = [engine.add_request(Request(p, NEW), e + [0] * 8) for p, e in zip(PROMPTS, expected)]
        outputs, checked = _run(engine, model, ids)
    assert [outputs[i] for i in ids] == expected and checked > len(PROMPTS) * 4 and len(calls) == 2


def _on_device_outputs(name: str, device: str) -> tuple[list, list, list]:
    """transformers' ``generate()`` on ``device`` (fp32), dspark's plain decoding and DSpark rounds
    (drafts of that continuation each accepted with probability 1/2, plain rounds between drafting
    ones, prompts in chunks; CUDA graphs where ``device`` is a GPU) of ``name``'s random model."""
    model = _model(name).to(device)
    draft = _drafter(model).to(device)
    with torch.random.fork_rng(devices=[]):
        expected = [_generate(model, p, NEW) for p in PROMPTS]
    config = dict(max_batch=3, max_num_batched_tokens=3 * 5 + 4, device=device, dtype=torch.float32)
    plain = LLMEngine(model, None, EngineConfig(**config))
    plain_out = [r.token_ids for r in plain.generate([Request(p, NEW) for p in PROMPTS])]
    engine = OracleEngine(model, draft, EngineConfig(**config, **SCHEDULERS["plain-rounds"]), acceptance=0.5)
    ids = [engine.add_request(Request(p, NEW), e + [0] * 8) for p, e in zip(PROMPTS, expected)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return expected, plain_out, [outputs.get(i, []) for i in ids]


@gpu
@pytest.mark.parametrize("name", ["qwen3.5", "bamba", "lfm2", "jamba"])
def test_on_a_gpu_plain_and_dspark_greedy_are_generates_tokens(name, monkeypatch):
    """On CUDA in fp32, with the GPU's kernels (fla's chunked delta rule, the window scans, the conv
    kernel) and CUDA graphs: dspark's plain decoding and its DSpark rounds (rejected and accepted
    drafts, plain rounds, prompt chunks) give transformers' ``generate()`` tokens on the same GPU."""
    monkeypatch.setattr(round_plan, "REDRAFT_STEPS", 3)
    monkeypatch.setattr(round_plan, "REDRAFT_DOUBLINGS", 0)  # every wait 3 plain rounds
    expected, plain, dspark = _on_device_outputs(name, "cuda")
    assert plain == expected and dspark == expected


def test_the_context_limit_ends_the_output(hybrid):
    """At the context limit (``max_model_len``) the verify windows shrink to the room left and the
    output ends at "length" with ``generate()``'s tokens; states exact throughout."""
    model, draft, expected = hybrid
    prompt = PROMPTS[2]
    engine = LLMEngine(model, draft, EngineConfig(max_batch=1, max_model_len=len(prompt) + 10, cuda_graphs=False))
    rid = engine.add_request(Request(prompt, NEW))
    seq = engine.sequences[rid]
    outputs, checked = _run(engine, model, [rid])
    assert outputs[rid] == expected[2][:10] and seq.finish_reason == "length" and checked > 2


def test_an_aborted_requests_slot_gives_the_next_request_no_state(hybrid):
    """One row: a request aborted between two rounds (its drafts verified, its next round drafted),
    then a new request in the same slot -- from zero states: ``generate()``'s tokens."""
    model, draft, expected = hybrid
    engine = LLMEngine(model, draft, EngineConfig(max_batch=1, cuda_graphs=False))
    first = engine.add_request(Request(PROMPTS[2], NEW))
    while len(engine.sequences[first].output_ids) < 4:
        engine.step()
    slot = engine.sequences[first].slot
    engine.abort(first)
    second = engine.add_request(Request(PROMPTS[0], NEW))
    engine.step()
    assert engine.sequences[second].slot == slot
    _run(engine, model, [second])
    assert engine.sequences[second].output_ids == expected[0]


def test_preempted_requests_run_again_from_zero_states(hybrid):
    """KV blocks for about one request at a time among three rows: requests are preempted and run
    their tokens again from position 0 (no prefix cache; with it: test_hybrid_prefix_cache), with
    the tokens they give alone."""
    model, draft, expected = hybrid
    engine = LLMEngine(model, draft, EngineConfig(max_batch=3, max_model_len=32, kv_block_size=4, num_kv_blocks=16,
                                                  cuda_graphs=False, enable_prefix_caching=False))
    ids = [engine.add_request(Request(p, NEW)) for p in PROMPTS]
    outputs, _ = _run(engine, model, ids)
    assert [outputs[i] for i in ids] == expected
    assert engine.metrics.preemptions > 0


def test_tree_mode_is_refused_and_the_states_take_the_bytes_counted(hybrid):
    """A tree round would need a state per node: tree mode is refused naming why. The states'
    bytes (which the GPU's KV block count leaves room for) are those allocated, with the prefix
    cache's block ends and snapshots and without."""
    model, draft, _ = hybrid
    with pytest.raises(ValueError, match=r"tree mode \(draft_top_k > 1\) is not supported on a hybrid target "
                                         r"\(layers \[[0-9, ]+\] carry a recurrent or convolution state\): verifying "
                                         r"a tree would need a state per tree node"):
        LLMEngine(model, draft, EngineConfig(draft_top_k=2, cuda_graphs=False))
    for caching in (True, False):
        engine = LLMEngine(model, draft, EngineConfig(max_batch=2, cuda_graphs=False, enable_prefix_caching=caching))
        pool = engine.runner.cache.states
        assert (pool.layout.snapshots, engine.scheduler.blocks.prefix_caching) == (4 if caching else 0, caching)
        allocated = sum(t.numel() * t.element_size() for s in pool.layers.values()
                        for t in (s.conv, s.recurrent, s.snapshot_conv, s.snapshot_recurrent) if t is not None)
        assert engine.target.state_bytes(2 + 1, pool.layout) == allocated


def test_gated_deltanet_on_a_gpu_names_the_missing_kernel(monkeypatch):
    """On the CPU the gated delta rule is the modeling file's PyTorch reference; on a GPU it is
    flash-linear-attention's kernel, and an engine without ``fla-core`` is refused naming it."""
    import sys

    mixer = _model("qwen3.5").model.layers[0].linear_attn
    reference = sys.modules[type(mixer).__module__].torch_recurrent_gated_delta_rule
    assert hybrid_model.delta_rule(mixer, torch.device("cpu")) is reference
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    with pytest.raises(RuntimeError, match=r"Qwen3_5GatedDeltaNet layers on a GPU run flash-linear-attention's gated "
                                           r"delta rule kernel, which is not installed: pip install fla-core"):
        hybrid_model.new_pool({0: mixer}, 2, hybrid_model.StateLayout(4), "cuda", torch.float32)


def test_a_graphs_warm_up_run_leaves_the_states_as_they_were(hybrid, monkeypatch):
    """A CUDA graph is captured after a warm-up run of its step, which must leave no trace: its
    state writes would overwrite the state a prompt chunk longer than the rings starts from. On
    the CPU: a capture that runs its step (as the graph's first replay would) after the warm-up
    run -- ``generate()``'s tokens for prompts run in chunks of many tokens."""
    model, draft, expected = hybrid

    class Graph:
        def pool(self):
            return None

        def replay(self):  # the capture ran the step (its first replay)
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    for name, fake in (("synchronize", lambda device=None: None), ("current_stream", lambda device=None: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    prompt = [(7 * i + 3) % 90 for i in range(40)]
    for d in (draft, None):
        engine = LLMEngine(model, d, EngineConfig(max_batch=2, max_num_batched_tokens=24, cuda_graphs=False))
        runner = engine.runner
        runner.use_graphs, first_use = True, runner._replay

        def replay(key, fn):  # a captured step's later replays run it; its first use warms up, then captures
            (fn if key in runner.graphs else lambda: first_use(key, fn))()

        monkeypatch.setattr(runner, "_replay", replay)
        result = engine.generate([Request(prompt, 8)])[0]
        assert result.token_ids == _generate(model, prompt, 8)
        assert runner.graphs


def test_a_failed_step_with_prompt_chunks_runs_them_again_from_zero_states(hybrid):
    """A mixed forward that fails after the first stateful layers wrote (a long prompt chunk's
    writes reach the state it started from) is retried without its chunks, whose prompts then run
    again from position 0: ``generate()``'s tokens."""
    model, draft, _ = hybrid
    prompt = [(7 * i + 3) % 90 for i in range(40)]
    mixed = []  # forwards with a prompt chunk: the second (a chunk after the first) fails

    def fail_once(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 16:
            mixed.append(hidden.shape[1])
            if len(mixed) == 2:
                raise RuntimeError("a failure inside the forward")

    hook = HFTarget(model).layers[2].register_forward_pre_hook(fail_once, with_kwargs=True)
    try:
        engine = LLMEngine(model, draft, EngineConfig(max_batch=2, max_num_batched_tokens=24, cuda_graphs=False))
        first = engine.add_request(Request(PROMPTS[0], NEW))
        engine.step()
        late = engine.add_request(Request(prompt, 8))
        outputs, _ = _run(engine, model, [first, late])
    finally:
        hook.remove()
    assert len(mixed) > 2 and outputs[late] == _generate(model, prompt, 8)


# Mamba-2 alone, with Falcon-H1's multipliers, without attention (Mamba2); Mamba-1 with its norms, with experts
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next", "bamba", "falcon-h1", "mamba2", "falcon-mamba", "jamba"])
def test_prompt_chunks_scanned_whole_are_the_sequential_scan(name):
    """Prompt chunks scanned whole -- gated DeltaNet by the chunked delta rule, Mamba-2 by the
    chunked SSD scan, Mamba-1 by the chunked selective scan -- split at the chunk's last block end
    with the prefix cache on: the states after every step equal the position-by-position
    scan's (fp32, to reassociation: ``_check_running_states``), and the tokens are the sequential
    engine's and the greedy ones of transformers' forward over the whole sequence, with the prefix
    cache on and off. (Not ``generate()``'s: at these lengths it departs from that forward's argmax
    on these random models, by logit margins of 0.02.)"""
    model = _model(name)
    draft = _drafter(model)
    prompts = [[(7 * i + 3) % 90 for i in range(70)], [(5 * i + 1) % 90 for i in range(37)]]
    expected = [_forward_greedy(model, p, 8) for p in prompts]
    for caching in (True, False):
        config = EngineConfig(max_batch=2, max_num_batched_tokens=2 * 5 + 24, kv_block_size=8, cuda_graphs=False,
                              enable_prefix_caching=caching)
        engine = LLMEngine(model, draft, config)
        ids = [engine.add_request(Request(p, 8)) for p in prompts]
        outputs, checked = _run(engine, model, ids)
        assert [outputs[i] for i in ids] == expected and checked > 4
        with _sequential_scans():
            sequential = LLMEngine(model, draft, config).generate([Request(p, 8) for p in prompts])
        assert [r.token_ids for r in sequential] == expected


def _forward_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, each the argmax of transformers' forward over the whole sequence so far."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_a_mamba2_dt_limit_clamps_the_prompt_positions_only(monkeypatch):
    """transformers clamps Mamba-2's dt to ``time_step_limit`` in a prompt's chunked scan and not in
    its recurrent decoding step: Nemotron-H under a limit that changes its tokens decodes as
    ``generate()`` (prompts in chunks, batched, with a draft and without), and would not if the
    engine clamped every position or none."""
    model = _model("nemotron-h")
    free = [_generate(model, p, NEW) for p in PROMPTS]
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.9, 1.3)
    expected = [_generate(model, p, NEW) for p in PROMPTS]
    assert expected != free

    def decode(draft):
        engine = LLMEngine(model, draft, EngineConfig(**CHUNKED))
        return [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])]

    assert decode(_drafter(model)) == decode(None) == expected
    # a cached block's states would hold the prompt length of the request that wrote them: no prefix cache
    assert not LLMEngine(model, None, EngineConfig(**CHUNKED)).scheduler.blocks.prefix_caching
    set_prompt_len = hybrid_model.StatePool.set_prompt_len
    for clamped in (10 ** 9, 0):  # every position, none
        monkeypatch.setattr(hybrid_model.StatePool, "set_prompt_len",
                            lambda pool, slot, n: set_prompt_len(pool, slot, clamped))
        assert decode(None) != expected


def test_prompt_log_probabilities_leave_the_states_to_the_chunks(hybrid):
    """Prompt log-probabilities come from an eager forward of each chunk before the step runs it:
    its state writes must not reach the state the chunk then starts from: ``generate()``'s tokens
    for a prompt scored in long chunks."""
    model, draft, _ = hybrid
    prompt = [(7 * i + 3) % 90 for i in range(40)]
    engine = LLMEngine(model, draft, EngineConfig(max_batch=2, max_num_batched_tokens=24, cuda_graphs=False))
    scored = engine.generate([Request(prompt, 8, prompt_logprobs=0)])[0]
    assert scored.token_ids == _generate(model, prompt, 8)


def test_a_deep_copy_of_a_wrapped_model_runs_its_own_mixers(hybrid):
    """The routing of a model's mixers through the engine travels with a deep copy of the model
    (as a model moved to another device is): the copy decodes with its own weights, not the
    original's."""
    model, _, expected = hybrid
    HFTarget(model)  # routes the mixers
    copy = deepcopy(model)
    for module in model.modules():
        if hasattr(module, "_dspark_original_forward"):
            torch.nn.init.zeros_(module.out_proj.weight)
    try:
        engine = LLMEngine(copy, None, EngineConfig(max_batch=1, cuda_graphs=False))
        assert engine.generate([Request(PROMPTS[0], NEW)])[0].token_ids == expected[0]
    finally:
        model.load_state_dict(copy.state_dict())


SAMPLED_VOCAB, SAMPLED_TOP_K = 4, 3
SAMPLED_ROWS, SAMPLED_TOKENS = 128, 128  # 16 384 draws: an exact sampler's expected TV ~ 0.4 * sqrt(3 / N) = 0.005


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3.5", "bamba", "lfm2"])
def test_sampled_outputs_follow_the_targets_distribution(name):
    """Sampled speculative decoding (temperature 1, top-k 3) on a tiny hybrid target of 4 tokens:
    every emitted token -- accepted drafts, residual draws, bonus tokens -- follows the target's
    distribution given the whole output before it (each position's own distribution, from
    transformers' forward over the output: chi-square and TV of the draws per token id,
    ``statistics_cases.check_conditionals``), so a state the rollback left wrong shows; and the
    check has teeth: the same draws against the distributions off by 5 % fail it."""
    from statistics_cases import check_conditionals
    from test_hf_target import COMMON
    from test_lossless_sampling import nudged

    import dspark.kernels as K
    from dspark.engine import SamplingParams

    model = _model(name, {**COMMON, "vocab_size": SAMPLED_VOCAB, "initializer_range": 0.3})
    engine = LLMEngine(model, _drafter(model), EngineConfig(max_batch=SAMPLED_ROWS, cuda_graphs=False))
    prompts = [[s % SAMPLED_VOCAB, (s // SAMPLED_VOCAB) % SAMPLED_VOCAB] for s in range(SAMPLED_ROWS)]
    results = engine.generate([Request(p, SAMPLED_TOKENS, SamplingParams(temperature=1.0, top_k=SAMPLED_TOP_K, seed=s),
                                       stop_ids=[], ignore_eos=True) for s, p in enumerate(prompts)])
    assert sum(len(r.stats.accept_lengths) for r in results) < SAMPLED_ROWS * SAMPLED_TOKENS  # drafts were kept
    sequences = torch.tensor([p + r.token_ids for p, r in zip(prompts, results)])
    with torch.no_grad():
        logits = model(sequences).logits[:, 1:-1].float()  # the distribution of each output token
    probs = K.logits_to_probabilities(logits.reshape(-1, SAMPLED_VOCAB), 1.0, top_k=SAMPLED_TOP_K)
    tokens, bins = sequences[:, 2:].flatten(), torch.arange(SAMPLED_VOCAB).expand(probs.shape[0], -1)
    problem = check_conditionals(tokens, probs, bins)
    assert problem is None, f"{name}: {problem}"
    assert check_conditionals(tokens, nudged(probs), bins) is not None


def test_the_chunked_selective_scan_is_the_step_by_step_scan():
    """Mamba-1's chunked selective scan from a nonzero state over 45 positions (runs of 16 and a
    part run), decays from ~1 to far below the negligible ones (dt up to 6, A down to -16): its
    outputs and last state equal transformers' recurrent step applied position by position (fp32)."""
    import sys

    from dspark.model import mamba

    update = sys.modules[type(_model("jamba").model.layers[0].mamba).__module__].mamba_selective_state_update
    g = torch.Generator().manual_seed(0)
    rows, length, channels, size = 3, 45, 12, 8
    x, gate = torch.randn(rows, length, channels, generator=g), torch.randn(rows, length, channels, generator=g)
    dt = torch.rand(rows, length, channels, generator=g) ** 4 * 6
    b, c = torch.randn(rows, length, size, generator=g), torch.randn(rows, length, size, generator=g)
    a = -torch.linspace(0.01, 16, channels * size).reshape(channels, size)
    d, state = torch.randn(channels, generator=g), torch.randn(rows, channels, size, generator=g)
    y, last = mamba.selective_chunk_scan(state, x, dt, a, b, c, d, gate)
    expected, h = [], state.clone()
    for t in range(length):
        expected.append(update(h, x[:, t], dt[:, t], a, b[:, t], c[:, t], d, z=gate[:, t]))
    torch.testing.assert_close(y, torch.stack(expected, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, h, rtol=1e-5, atol=1e-6)
    assert (torch.exp(dt[..., None] * a) <= mamba.NEGLIGIBLE_DECAY).any() and length % mamba.SCAN_RUN
