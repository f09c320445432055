"""``WorkingMemory``: the GPU memory an engine leaves beside its KV blocks, a formula of the shapes
(``block_manager.working_memory``) -- the runner's own buffers as it allocates them, the largest
step's blocks in the CUDA graphs' pool and again for an eager warm-up -- and the start-up capture's
order (largest first), which keeps the graphs' shared pool at the largest step's blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

from dspark.engine.block_manager import GRAPH_POOL_SLACK, step_blocks, working_memory
from dspark.engine.chunks import MAX_CHUNKS
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.penalties import BYTES_PER_TOKEN
from dspark.engine.rows import LogitsPath

VOCAB = 151936  # Qwen3's
HIDDEN = 4096  # the 8B shape's


def qwen3_8b(vocab: int = VOCAB, block: int = 7, dtype=torch.bfloat16):
    """Stand-ins of the 8B-shaped target and its DSpark drafter (drafting every slot of its block, 5
    captured layers): what ``working_memory`` reads of them."""
    target = SimpleNamespace(vocab_size=vocab, dtype=dtype, shape=SimpleNamespace(hidden_size=HIDDEN))
    draft = SimpleNamespace(dtype=dtype, config=SimpleNamespace(num_draft_tokens=block, num_capture_layers=5,
                                                                hidden_size=HIDDEN))
    return target, draft


def estimate(max_batch: int, vocab: int = VOCAB, block: int = 7, **config):
    """The estimate of a chain engine (verify length: the block's drafts and the anchor, 2048 tokens a step)."""
    target, draft = qwen3_8b(vocab, block)
    return working_memory(target, draft, EngineConfig(max_batch=max_batch, **config), block + 1, 2048, block)


def test_the_largest_step_is_a_penalised_verify_with_prompt_chunks():
    """At 256 rows of 8 verify tokens over Qwen3's vocabulary: the logits of the verify rows and the
    seats in bf16 and f32, the activations of the verify and a full chunk bucket, the acceptance's
    probabilities and the penalty pass's [B, V] temporaries -- in the graphs' pool (with the slack) and again for a warm-up beside it."""
    wm = estimate(256)
    rows = 256 * 8
    step = (2 + 4) * (rows + MAX_CHUNKS) * VOCAB + (rows + 2048) * HIDDEN * 64 + 4 * rows * VOCAB + 20 * 256 * VOCAB
    snapshot = 2 * 4 * 257 * VOCAB + 4 * 257 * (8 + 7) * (VOCAB // 32)  # the warm-up's copies: bias, counts, masks
    assert wm.graph_pool == step + GRAPH_POOL_SLACK and wm.warm_up == step + snapshot
    assert 4.6 * 2**30 < step < 4.7 * 2**30
    assert estimate(256, cuda_graphs=False).graph_pool == 0  # eager: no pool


def test_the_estimate_grows_with_max_batch_block_and_vocabulary_as_the_accounting_says():
    """Every vocabulary-wide part is linear in the rows (the same step for each 64 rows more), in the
    vocabulary (twice the vocabulary: twice each part but the activations and captured states) and in
    the draft block (its distributions; the longer verify window's logits and probabilities)."""
    steps = [estimate(b).graph_pool for b in (64, 128, 192)]
    assert steps[0] < steps[1] < steps[2] and steps[2] - steps[1] == steps[1] - steps[0]
    small, large = estimate(64, vocab=VOCAB // 2), estimate(64)
    activations = (64 * 8 + 2048) * HIDDEN * 64
    assert large.graph_pool - activations - GRAPH_POOL_SLACK == 2 * (small.graph_pool - activations - GRAPH_POOL_SLACK)
    for part in ("logit_rows", "draft_probs", "penalties"):
        assert getattr(large, part) == 2 * getattr(small, part), part
    assert large.penalties == 65 * VOCAB * BYTES_PER_TOKEN  # every slot's penalty state, the padding line's too
    longer = estimate(64, block=15)
    assert (longer.draft_probs, large.draft_probs) == (4 * 64 * 15 * VOCAB, 4 * 64 * 7 * VOCAB)
    window = 64 * 8 * VOCAB  # 8 verify positions more per row
    assert longer.graph_pool - large.graph_pool == (2 + 4 + 4) * window + 64 * 8 * HIDDEN * 64
    assert longer.logit_rows - large.logit_rows == 4 * window


def test_the_penalty_pass_and_a_larger_draft_block_count_in_the_step():
    """The penalty pass adds 20 B V to a step (the rows' state, the repetition factors, one
    position's temporaries); a draft pass whose block logits and distributions outgrow the target
    step's (a tree of few nodes, a long block) is the step counted."""
    shape = dict(rows=64 * 8, seats=MAX_CHUNKS, vocab=VOCAB, logits_bytes=2, activations=0)
    assert step_blocks(batch=65, **shape) - step_blocks(batch=64, **shape) == 20 * VOCAB
    tree = dict(rows=64 * 4, seats=MAX_CHUNKS, vocab=VOCAB, logits_bytes=2, activations=0, batch=64)
    drafted = step_blocks(draft_rows=64 * 16, draft_bytes=2, drafts=16, **tree)
    assert drafted == (2 + 4) * 64 * 16 * VOCAB + 4 * 64 * 16 * VOCAB + 20 * 64 * VOCAB > step_blocks(**tree)


@pytest.mark.parametrize("tree", [False, True])
def test_the_runner_buffers_are_the_estimate(tree):
    """The parts allocated beside the step (the verify's logit rows, the drafts' distributions or a
    tree's depth rows, the rows' bias, masks and captured states, the penalty state) are the bytes the
    runner's tensors hold."""
    target = tiny_qwen3_target(vocab_size=640)  # bitmasks of 20 words: no other row buffer is as wide
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, draft_top_k=2 if tree else 1))
    runner, wm = engine.runner, engine.working_memory
    s, nbytes = runner.state, (lambda *ts: sum(t.numel() * t.element_size() for t in ts))
    assert wm.logit_rows == nbytes(runner.verifier.logit_rows)
    assert wm.draft_probs == nbytes(runner.proposer.stacked if tree else s.draft_probs)
    assert wm.row_state == nbytes(s.logit_bias, s.grammar_mask, s.draft_mask, runner.verifier.capture_rows)
    assert wm.penalties == nbytes(runner.penalties.counts, runner.penalties.flags)
    # a warm-up's copies of what a step writes (CudaGraphs._snapshot): the vocabulary-wide ones
    copied = [t for name, t in s.tensors() if name not in ("capture", "draft_probs")] + runner.penalties.buffers()
    wide = [t for t in copied if t.shape[-1] in (640, 640 // 32)]
    assert wm.warm_up - (wm.graph_pool - GRAPH_POOL_SLACK) == nbytes(*wide)
    assert {id(t) for t in wide} == {id(t) for t in (s.logit_bias, s.grammar_mask, s.draft_mask,
                                                     runner.penalties.counts)}


def test_the_start_up_capture_runs_the_largest_step_first(monkeypatch):
    """``capture_graphs`` captures in one shared pool, largest first: the mixed steps from the largest
    (every row's full verify beside the largest chunk bucket, penalised), then each batch bucket from
    the largest, its paths from the penalised one, its verify lengths from the longest."""
    target = tiny_qwen3_target()
    engine = LLMEngine(target, random_draft(tiny_draft_config(target.config), 0, target), EngineConfig(max_batch=4))
    runner, keys = engine.runner, []
    monkeypatch.setattr(runner, "use_graphs", True)
    monkeypatch.setattr(runner, "_replay", lambda key, fn: keys.append(key))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner.capture_graphs()
    t, capacity = runner.verify_len, runner.chunks.capacity
    assert keys[0] == ("mixed", 4, 4 * t, capacity, LogitsPath.PENALISED)
    rounds = [k for k in keys if k[0] != "mixed"]
    assert [k[1] for k in rounds] == sorted((k[1] for k in rounds), reverse=True)
    assert rounds[:t + 1] == [("verify", 4, 4 * n, LogitsPath.PENALISED) for n in range(t, 0, -1)] \
        + [("draft", 4, 0, LogitsPath.PENALISED)]
    mixed = [k for k in keys if k[0] == "mixed"]
    sizes = [(b, n or b, c) for _, b, n, c, _ in mixed]
    assert sizes == sorted(sizes, reverse=True) and len(set(mixed)) == len(mixed)
