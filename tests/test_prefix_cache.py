"""Paged KV, automatic prefix caching and preemption.

The block manager's bookkeeping on its own; then the engine on the demo pair (fp32, CPU, its real
drafter): with prefix caching on, requests that share a system prompt -- or continue an earlier
request's conversation, output included -- take its blocks instead of running it again, and every
request's tokens *and* the drafts each round accepted are the ones the engine gives with caching
off; with too few blocks for the batch, requests are preempted and run again, and their tokens
(greedy and sampled) are still the ones they give with room to spare.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dspark.engine import SamplingParams
from dspark.engine.block_manager import NULL_BLOCK, BlockManager, SequenceBlocks, StateSnapshots
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.training.data import demo_pair, read_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40

# ------------------------------------------------------------------------------- block manager


def tokens(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n))


def test_blocks_are_taken_released_and_counted():
    manager = BlockManager(num_blocks=9, block_size=4)
    a, b = SequenceBlocks(), SequenceBlocks()
    assert manager.num_free == 8 and manager.reserve(a, 10) == 3 and len(a.block_ids) == 3
    assert NULL_BLOCK not in a.block_ids
    assert manager.reserve(a, 12) == 0 and len(a.block_ids) == 3  # already covered
    assert manager.reserve(b, 24) is None and b.block_ids == [] and manager.num_free == 5  # all or nothing
    manager.release(a)
    assert manager.num_free == 8 and a.block_ids == [] and set(manager.ref_counts) == {0}


def test_a_prefix_is_found_block_by_block_and_shared():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = SequenceBlocks()
    manager.reserve(first, 10)
    manager.cache_committed(first, 9, lambda lo, hi: tokens(12)[lo:hi])  # positions < 9: two full blocks
    assert len(first.keys) == 2
    second = SequenceBlocks()
    assert manager.take_cached_prefix(second, tokens(12), limit=11) == 8
    assert second.block_ids == first.block_ids[:2] and second.cached_tokens == 8
    assert [manager.ref_counts[b] for b in second.block_ids] == [2, 2]
    assert (manager.queries, manager.hits) == (11, 8)
    # the same block of tokens after another prefix is another block: the keys chain
    third = SequenceBlocks()
    assert manager.take_cached_prefix(third, [99] + tokens(11), limit=11) == 0
    assert manager.take_cached_prefix(SequenceBlocks(), tokens(12), limit=7) == 4  # only full blocks within the limit


def test_released_cached_blocks_stay_until_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks
    old, new = SequenceBlocks(), SequenceBlocks()
    for seq, first in ((old, 0), (new, 100)):
        manager.reserve(seq, 4)
        manager.cache_committed(seq, 4, lambda lo, hi, first=first: tokens(4, first)[lo:hi])
    manager.release(old)
    manager.release(new)
    assert manager.num_free == 4
    probe = SequenceBlocks()
    assert manager.take_cached_prefix(probe, tokens(5), limit=4) == 4  # still cached after its release
    manager.release(probe)
    taker = SequenceBlocks()
    manager.reserve(taker, 2)  # evicts the least recently freed block: the second block of `new`
    assert manager.take_cached_prefix(SequenceBlocks(), tokens(5, 100), limit=4) == 2
    assert manager.take_cached_prefix(SequenceBlocks(), tokens(5), limit=4) == 4


def test_prefix_caching_off_finds_nothing():
    manager = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    seq = SequenceBlocks()
    manager.reserve(seq, 4)
    manager.cache_committed(seq, 4, lambda lo, hi: tokens(4)[lo:hi])
    assert manager.take_cached_prefix(SequenceBlocks(), tokens(6), limit=5) == 0 and not manager.cached


def test_a_hybrid_targets_prefix_ends_at_its_last_block_with_a_snapshot():
    """With state snapshots (a hybrid target) a matched prefix is taken up to its last block with a
    snapshot; the blocks matched past it are named (``matched_tokens``), not held nor counted."""
    manager = BlockManager(num_blocks=16, block_size=4, snapshots=StateSnapshots(2))
    first = SequenceBlocks()
    manager.reserve(first, 16)
    manager.cache_committed(first, 16, lambda lo, hi: tokens(16)[lo:hi])
    assert manager.take_cached_prefix(SequenceBlocks(), tokens(20), limit=19) == 0  # no snapshot yet
    assert manager.snapshot_slot(first, 1) is not None and manager.snapshot_slot(first, 1) is None  # one per block
    second = SequenceBlocks()
    assert manager.take_cached_prefix(second, tokens(20), limit=19) == 8
    assert (second.block_ids, second.matched_tokens) == (first.block_ids[:2], 16)
    assert [manager.ref_counts[b] for b in first.block_ids] == [2, 2, 1, 1] and manager.hits == 8


def test_snapshots_go_least_recently_used_first_and_with_their_blocks():
    """Two snapshot slots: a third snapshot takes the least recently used one's (a hit counts as a
    use); a cached block evicted for a new block takes its snapshot with it."""
    manager = BlockManager(num_blocks=5, block_size=2, snapshots=StateSnapshots(2))  # 4 usable blocks
    seq = SequenceBlocks()
    manager.reserve(seq, 6)
    manager.cache_committed(seq, 6, lambda lo, hi: tokens(6)[lo:hi])
    slots = [manager.snapshot_slot(seq, i) for i in (0, 1)]
    assert sorted(slots) == [0, 1]
    hit = SequenceBlocks()
    assert manager.take_cached_prefix(hit, tokens(3), limit=2) == 2  # block 0's snapshot used
    assert manager.snapshot_slot(seq, 2) == slots[1]  # block 1's went
    blocks = list(seq.block_ids)
    assert set(manager.snapshots.slot_of) == {blocks[0], blocks[2]}
    manager.release(seq)
    manager.release(hit)
    manager.reserve(SequenceBlocks(), 4)  # the never-used block, then the least recently freed: blocks[2]
    assert set(manager.snapshots.slot_of) == {blocks[0]} and manager.snapshots.free == [slots[1]]


# ------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def pair():
    return demo_pair()


@pytest.fixture(scope="module")
def prompts(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    texts = [p["text"] for p in read_prompts(pair.prompts)]
    return [tokenizer(t)["input_ids"] for t in texts]


def _engine(pair, **fields) -> LLMEngine:
    return LLMEngine(pair.target, pair.draft, EngineConfig(**{"max_batch": 4, **fields}))


def _hot(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed)


def _conversation(prompts) -> tuple[list[Request], list[list[Request]]]:
    """A 90-token system prompt shared by every request (five full blocks and part of a sixth),
    the first wave greedy and sampled; the second wave then reuses it."""
    system = prompts[0][:90]
    first = [Request(system + prompts[i][:12], max_new_tokens=NEW, sampling=s)
             for i, s in ((1, SamplingParams()), (2, _hot(2)))]
    second = [Request(system + prompts[i][:20], max_new_tokens=NEW, sampling=s)
              for i, s in ((3, SamplingParams()), (4, _hot(4)), (5, SamplingParams()))]
    return first, second


def _run(engine: LLMEngine, waves: list[list[Request]]):
    return [engine.generate(wave) for wave in waves]


def _rounds(results) -> list[tuple]:
    return [(r.token_ids, r.stats.scheduled_lengths, r.stats.accept_lengths) for wave in results for r in wave]


@pytest.mark.parametrize("options", [dict(scheduler="off"), dict(scheduler="sps", threshold=0.3),
                                     dict(draft_top_k=2, tree_budget=6)], ids=["off", "sps", "tree"])
def test_prefix_caching_keeps_every_token_and_every_accepted_draft(pair, prompts, options):
    """Waves sharing a system prompt, then a second turn that continues the first wave's output:
    caching on and off give the same tokens, the same drafts verified and accepted each round."""
    first, second = _conversation(prompts)
    on, off = _engine(pair, **options), _engine(pair, enable_prefix_caching=False, **options)
    results_on = _run(on, [first, second])
    results_off = _run(off, [first, second])
    # the next turn: the first request's prompt and answer, then more text
    reply = results_on[0][0].token_ids
    turn = [Request(first[0].prompt_ids + reply + prompts[6][:10], max_new_tokens=NEW)]
    results_on.append(on.generate(turn))
    results_off.append(off.generate(turn))
    assert _rounds(results_on) == _rounds(results_off)
    assert all(r.stats.cached_tokens == 0 for wave in results_off for r in wave)
    assert [r.stats.cached_tokens for r in results_on[1]] == [80, 80, 80]  # five full blocks of the system prompt
    assert results_on[2][0].stats.cached_tokens >= (len(first[0].prompt_ids) + len(reply) - 1) // 16 * 16 - 16
    assert on.metrics.prompt_tokens < off.metrics.prompt_tokens
    assert on.metrics.prefix_cache_hits == sum(r.stats.cached_tokens for wave in results_on for r in wave)
    assert on.metrics.prefix_cache_queries >= on.metrics.prefix_cache_hits > 0
    for engine in (on, off):
        assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks - 1 and set(engine.scheduler.blocks.ref_counts) == {0}


@pytest.mark.parametrize("options", [dict(scheduler="off"), dict(draft_top_k=2, tree_budget=6), dict(draft=None)],
                         ids=["chain", "tree", "plain"])
def test_preempted_requests_end_with_the_tokens_they_give_with_room(pair, prompts, options):
    """Six requests, four rows, KV blocks for about two of them at a time: requests are preempted
    and run again (their last token kept as the anchor), yet every request -- greedy or sampled,
    with penalties or without (their state staged again from the output so far) -- ends with
    exactly the tokens it gives on an engine with blocks to spare."""
    draft = options.pop("draft", pair.draft)
    penalties = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=NEW // 2,
                     bad_words=((prompts[0][3], prompts[0][4]),))
    sampling = [SamplingParams(), _hot(1), SamplingParams(**penalties), replace(_hot(3), **penalties)]
    requests = [Request(prompts[i][:60], max_new_tokens=NEW, sampling=sampling[i % 4]) for i in range(6)]
    config = dict(max_batch=4, max_model_len=128, **options)
    roomy = LLMEngine(pair.target, draft, EngineConfig(**config))
    tight = LLMEngine(pair.target, draft, EngineConfig(**config, num_kv_blocks=20))
    expected = [r.token_ids for r in roomy.generate(requests)]
    assert roomy.metrics.preemptions == 0
    assert [r.token_ids for r in tight.generate(requests)] == expected
    assert tight.metrics.preemptions > 0
    assert tight.scheduler.blocks.num_free == tight.scheduler.blocks.num_blocks - 1 and set(tight.scheduler.blocks.ref_counts) == {0}


def test_an_abort_frees_its_blocks_and_leaves_the_shared_ones_to_the_others(pair, prompts):
    """Three requests share a cached system prompt; aborting one mid-decode leaves the others'
    tokens as they are alone, and every block free (and the prefix still cached) at the end."""
    system = prompts[0][:64]
    engine = _engine(pair)
    requests = [Request(system + prompts[i][:8], max_new_tokens=NEW) for i in (1, 2, 3)]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    ids = [engine.add_request(r) for r in requests]
    done = {i: [] for i in ids}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    engine.abort(ids[1])
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    assert [done[ids[0]], done[ids[2]]] == [alone[0], alone[2]]
    assert done[ids[1]] == alone[1][:len(done[ids[1]])]
    blocks = engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks - 1 and set(blocks.ref_counts) == {0}
    assert engine.generate([requests[1]])[0].stats.cached_tokens == 64


def test_a_preempted_request_can_be_aborted_while_it_waits_to_run_again(pair, prompts):
    """Under a tight block budget, abort a request that was preempted (waiting, with output): the
    others end with their own tokens, and every block is free at the end."""
    requests = [Request(prompts[i][:60], max_new_tokens=NEW) for i in range(6)]
    config = dict(max_batch=4, max_model_len=128)
    expected = [r.token_ids for r in LLMEngine(pair.target, pair.draft, EngineConfig(**config)).generate(requests)]
    engine = LLMEngine(pair.target, pair.draft, EngineConfig(**config, num_kv_blocks=20))
    ids = [engine.add_request(r) for r in requests]
    done = {i: [] for i in ids}
    victim = None
    while victim is None and engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
        victim = next((q.request_id for q in engine.scheduler.waiting if q.output_ids), None)
    assert victim is not None, "no request was preempted"
    engine.abort(victim)
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    for i, rid in enumerate(ids):
        assert done[rid] == (expected[i][:len(done[rid])] if rid == victim else expected[i]), f"request {i}"
    blocks = engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks - 1 and set(blocks.ref_counts) == {0}


def test_too_few_blocks_for_one_request_is_refused(pair):
    with pytest.raises(ValueError, match="num_kv_blocks is 8: a request of max_model_len 128 needs 9 blocks"):
        LLMEngine(pair.target, pair.draft, EngineConfig(max_batch=2, max_model_len=128, num_kv_blocks=8))


@pytest.mark.gpu
def test_kv_blocks_fill_the_gpu_memory_fraction(pair, memory_budget_kv):
    """On a GPU the engine takes as many blocks as ``gpu_memory_utilization`` leaves, far more than
    ``max_batch`` requests of ``max_model_len`` need, and each block holds both caches' K/V."""
    import torch

    config = dict(max_batch=2, max_model_len=256, device="cuda", gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    engine = LLMEngine(pair.target, pair.draft, EngineConfig(**config))
    lines = 2 * engine.runner.block_tables.blocks_per_line + 1
    per_block = engine.runner.cache.k[:, 0].numel() * 2 * engine.runner.cache.k.element_size()
    per_block += engine.runner.proposer.draft.cache.k[:, 0].numel() * 2 * engine.runner.proposer.draft.cache.k.element_size()
    kv_bytes = engine.runner.num_kv_blocks * per_block
    assert engine.runner.num_kv_blocks > 10 * lines
    assert kv_bytes <= 0.3 * total - (total - free)  # within the fraction, after what was in use
    assert kv_bytes >= 0.3 * total - (total - free) - (3 << 30)  # all but the step's working memory
    assert engine.generate([Request([5, 6, 7], max_new_tokens=8)])[0].finish_reason == "length"
