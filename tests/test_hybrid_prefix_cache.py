"""Prefix caching on hybrid targets (gated DeltaNet: Qwen3.5, Qwen3-Next; Mamba-2: Bamba, Granite-4,
Falcon-H1; short convolutions: LFM2): a cached block is taken only up to the last one with a
snapshot of the layers' states after it, restored into the request's rings.

Each case runs with the prefix cache on and off: every request's tokens *and* the drafts each round
verified and accepted are the same (oracle drafts accepted with probability 1/2: rejected first
drafts, partial and full acceptance), greedy outputs are transformers' ``generate()``, and after
every step each running request's states equal those of its committed tokens run alone
(``test_hybrid_target._check_running_states``: a snapshot restored at the wrong position, or stale,
fails there). The cases: a chat sharing a system prompt (the second request snapshots where its
prompt left the cached blocks, the third takes them; the next turn takes the first answer's blocks),
a hit on a request still running, snapshots evicted (one slot; few KV blocks), preemption, an abort,
and sampled requests.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_hf_target import HYBRID, _drafter, _generate, _model
from test_hybrid_target import _check_running_states

from dspark.bench.oracle import OracleEngine
from dspark.engine import SamplingParams, llm_engine
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.request import Request

# the per-position states (tests/test_gated_delta_checkpoints.py runs these cases again under checkpoints,
# the gated DeltaNet default)
EngineConfig = partial(llm_engine.EngineConfig, gated_delta_checkpoints=False)

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
BLOCK = 8
SYSTEM = [(5 * i + 2) % 90 + 3 for i in range(29)]  # three full blocks of 8 and part of a fourth
USERS = [[(7 * i + u) % 90 + 3 for i in range(5 + u)] for u in range(5)]
# prompts run in chunks of up to 10 tokens beside the running rows (3 rows of 4 verify tokens; a chunk alone:
# 22, ending mid-block); room
# for every snapshot the cases take
CONFIG = dict(max_batch=3, kv_block_size=BLOCK, max_num_batched_tokens=3 * 4 + 10, cuda_graphs=False,
              state_snapshots=16)


# a family per kind of layer state: gated DeltaNet, Mamba-2, short conv, Mamba-1
KINDS = ["qwen3.5", "bamba", "lfm2", "jamba"]


@pytest.fixture(scope="module", params=KINDS)
def hybrid(request):
    model = _model(request.param)
    return model, _drafter(model)


@pytest.fixture(scope="module", params=[name if name in KINDS else pytest.param(name, marks=pytest.mark.slow)
                                        for name in HYBRID])
def family(request):
    model = _model(request.param)
    return model, _drafter(model)


def _engines(model, draft, **fields):
    """Oracle engines with the prefix cache on and off (``fields`` over ``CONFIG``)."""
    return [OracleEngine(model, draft, EngineConfig(**{**CONFIG, **fields}, enable_prefix_caching=caching),
                         acceptance=0.5) for caching in (True, False)]


def _waves(engine, model, waves: list[list[list[int]]], check: bool = True):
    """Run each wave of greedy prompts to the end (oracle drafts of ``generate()``'s tokens),
    checking the running requests' states after every step (``check``); returns per request (in
    order) ``(tokens, verify lengths, accept lengths, cached tokens)``."""
    results = []
    for wave in waves:
        ids = [engine.add_request(Request(p, NEW), _generate(model, p, NEW) + [0] * 8) for p in wave]
        seqs = [engine.sequences[i] for i in ids]
        while engine.has_unfinished():
            engine.step()
            if check:
                _check_running_states(engine, model)
        results += [(s.output_ids, s.stats.scheduled_lengths, s.stats.accept_lengths, s.stats.cached_tokens)
                    for s in seqs]
    return results


def _blocks_free(engine) -> bool:
    blocks = engine.scheduler.blocks
    return blocks.num_free == blocks.num_blocks - 1 and set(blocks.ref_counts) == {0}


def test_a_chat_sharing_a_system_prompt_keeps_every_token_and_every_accepted_draft(family):
    """Four waves: the first request runs the system prompt (its first chunk ends mid-block: a
    snapshot after its last full block, 16 tokens); the second takes those and finds the system
    prompt's third block with no snapshot, so it runs it, its chunk ending where its prompt leaves
    the cached blocks (a snapshot there); the next two take all three; the next turn of the first
    chat (its prompt, answer and more) takes its blocks up to its answer's last full block. Cache on
    = off, round for round, and = ``generate()``. Every family."""
    model, draft = family
    first = SYSTEM + USERS[0]
    answer = _generate(model, first, NEW)
    # (the turn's tail kept short: with 9 more tokens Granite-4's generate() decodes a token its own
    # forward over the whole sequence ranks second, by 0.007 -- the engine gives the forward's)
    waves = [[first], [SYSTEM + USERS[1]], [SYSTEM + USERS[2], SYSTEM + USERS[3]], [first + answer + USERS[4][:5]]]
    on, off = _engines(model, draft)
    cached, uncached = _waves(on, model, waves), _waves(off, model, waves, check=False)
    assert [r[:3] for r in cached] == [r[:3] for r in uncached]
    assert [r[0] for r in cached] == [_generate(model, p, NEW) for wave in waves for p in wave]
    turn = (len(first) + NEW - 1) // BLOCK * BLOCK  # the first request's committed blocks as it left
    assert [r[3] for r in cached] == [0, 16, 24, 24, turn] and all(r[3] == 0 for r in uncached)
    assert on.metrics.prefix_cache_hits == 64 + turn and on.metrics.prompt_tokens < off.metrics.prompt_tokens
    assert _blocks_free(on) and _blocks_free(off)


def test_a_request_takes_the_prompt_of_one_still_running(hybrid):
    """A request whose prompt extends one still decoding takes that one's prompt blocks (its last
    chunk's snapshot) while it runs: both as ``generate()`` gives them, states exact every step."""
    model, draft = hybrid
    prompt = SYSTEM + USERS[2]
    later = prompt + USERS[3]
    engine = OracleEngine(model, draft, EngineConfig(**CONFIG), acceptance=0.5)
    first = engine.add_request(Request(prompt, NEW), _generate(model, prompt, NEW) + [0] * 8)
    while len(engine.sequences[first].output_ids) < 3:
        engine.step()
    second = engine.add_request(Request(later, NEW), _generate(model, later, NEW) + [0] * 8)
    seqs = [engine.sequences[first], engine.sequences[second]]
    while engine.has_unfinished():
        engine.step()
        _check_running_states(engine, model)
    assert [s.output_ids for s in seqs] == [_generate(model, prompt, NEW), _generate(model, later, NEW)]
    assert seqs[1].stats.cached_tokens == len(prompt) // BLOCK * BLOCK > 0


def test_evicted_snapshots_cost_hits_not_tokens(hybrid):
    """One snapshot slot: each new snapshot evicts the last, so fewer tokens come from the cache,
    and every request's tokens and drafts are still those without the cache."""
    model, draft = hybrid
    waves = [[SYSTEM + USERS[0]], [SYSTEM + USERS[1]], [SYSTEM + USERS[2], SYSTEM + USERS[3]], [SYSTEM + USERS[4]]]
    tight, off = _engines(model, draft, state_snapshots=1)
    results = _waves(tight, model, waves)
    assert [r[:3] for r in results] == [r[:3] for r in _waves(off, model, waves, check=False)]
    assert tight.metrics.prefix_cache_hits < 16 + 24 * 3  # with room: as test_a_chat_sharing_a_system_prompt_...
    snapshots = tight.scheduler.blocks.snapshots
    assert len(snapshots.slot_of) == 1 and not snapshots.free and _blocks_free(tight)


def test_preempted_requests_resume_from_their_snapshots(hybrid):
    """KV blocks for about one request of three at a time: requests are preempted and run again
    from their last snapshot (the cache's hits), with the tokens they give alone (the real drafter:
    the oracle's drafts are staged once per request)."""
    model, draft = hybrid
    prompts = [SYSTEM + u for u in USERS[:3]]
    config = EngineConfig(**{**CONFIG, "kv_block_size": 4}, max_model_len=48, num_kv_blocks=20)
    engine = LLMEngine(model, draft, config)
    ids = [engine.add_request(Request(p, NEW)) for p in prompts]
    seqs = [engine.sequences[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
        _check_running_states(engine, model)
    assert [s.output_ids for s in seqs] == [_generate(model, p, NEW) for p in prompts]
    assert engine.metrics.preemptions > 0 and engine.metrics.prefix_cache_hits > 0 and _blocks_free(engine)


def test_an_aborted_request_leaves_the_others_and_its_blocks_exact(hybrid):
    """Three requests share the system prompt's snapshot; one is aborted mid-decode: the others give
    their tokens alone, and the aborted one, sent again, takes its own blocks (snapshot at its last
    full block as it left) and gives ``generate()``'s tokens."""
    model, draft = hybrid
    prompts = [SYSTEM + u for u in USERS[1:4]]
    engine = OracleEngine(model, draft, EngineConfig(**CONFIG), acceptance=0.5)
    _waves(engine, model, [[SYSTEM + USERS[0]], [SYSTEM + USERS[4]]])  # the system prompt's snapshot
    ids = [engine.add_request(Request(p, NEW), _generate(model, p, NEW) + [0] * 8) for p in prompts]
    seqs = [engine.sequences[i] for i in ids]
    while len(seqs[1].output_ids) < 5:
        engine.step()
    engine.abort(ids[1])
    while engine.has_unfinished():
        engine.step()
        _check_running_states(engine, model)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [_generate(model, prompts[0], NEW),
                                                        _generate(model, prompts[2], NEW)]
    assert seqs[1].stats.cached_tokens == 24
    again = prompts[1] + seqs[1].output_ids
    result = _waves(engine, model, [[again]])[0]
    assert result[0] == _generate(model, again, NEW) and result[3] == (len(again) - 1) // BLOCK * BLOCK
    assert _blocks_free(engine)


def test_sampled_requests_are_the_same_with_the_cache_and_alone(hybrid):
    """Sampled requests (seeded) sharing a system prompt, with a greedy one: each gives the same
    tokens with the cache on and off, and alone."""
    model, draft = hybrid
    hot = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in (5, 6, 7)]
    requests = [Request(SYSTEM + USERS[0], NEW, hot[0]), Request(SYSTEM + USERS[1], NEW, hot[1]),
                Request(SYSTEM + USERS[2], NEW), Request(SYSTEM + USERS[3], NEW, hot[2])]
    outputs = []
    for caching in (True, False):
        engine = LLMEngine(model, draft, EngineConfig(**CONFIG, enable_prefix_caching=caching))
        outputs.append([[r.token_ids for r in engine.generate(requests[:2])],
                        [r.token_ids for r in engine.generate(requests[2:])]])
        if caching:
            assert engine.metrics.prefix_cache_hits > 0
    alone = LLMEngine(model, draft, EngineConfig(**CONFIG, enable_prefix_caching=False))
    assert outputs[0] == outputs[1]
    assert outputs[0][1][1] == alone.generate([requests[3]])[0].token_ids


def test_blocks_shorter_than_a_convs_inputs_are_refused_naming_the_setting():
    """A snapshot holds the conv inputs of its block's last ``kernel - 1`` positions: blocks must
    be at least that long for prefix caching on a hybrid target (or the cache off)."""
    model = _model("qwen3.5")  # kernel 4
    with pytest.raises(ValueError, match=r"prefix caching on this hybrid target needs kv_block_size >= 3 \(its "
                                         r"convolutions read 3 inputs before each position, kept per block end\), "
                                         r"got 2; or set enable_prefix_caching=False"):
        LLMEngine(model, None, EngineConfig(max_batch=1, kv_block_size=2, cuda_graphs=False))
    engine = LLMEngine(model, None, EngineConfig(max_batch=1, kv_block_size=2, cuda_graphs=False,
                                                 enable_prefix_caching=False))
    assert engine.generate([Request(SYSTEM, 4)])[0].token_ids == _generate(model, SYSTEM, 4)
