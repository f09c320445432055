"""Tree mode (DDTree) through ``LLMEngine``: lossless greedy decoding and the engine's contract.

Oracle: plain greedy decoding by full recomputation (``test_engine._greedy``). Each round verifies
a token tree per row in the ragged forward -- ancestor masks, RoPE at depth, K/V at node rows --
walks it with the target's argmax and compacts the accepted path; the output must equal plain
greedy decoding token for token, alone and batched (requests joining as others leave, prompts
chunked into running steps), for both checkpoint formats and the vanilla / gated / rnn heads,
at budgets below the block (trees as deep as their node count) and above it, up to the context
limit. On the shipped demo pair a tree accepts more per round than the chain.
"""

import pytest
import torch
from model_cases import tiny_qwen3_target, write_tiny_draft
from test_engine import _greedy

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.model import load_draft

PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
NEW = 14
LIMIT = 40


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target(max_position_embeddings=LIMIT)


@pytest.fixture(scope="module")
def greedy(target):
    return [_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("format, options, top_k, budget, scheduler", [
    ("speculators", dict(), 2, 0, "off"),  # budget 0: block size + 1
    ("deepspec", dict(), 4, 3, "threshold"),  # fewer nodes than depths: a tree can be one chain
    ("speculators", dict(markov_head_type="gated", sample_from_anchor=False), 3, 12, "sps"),
    ("deepspec", dict(markov_head_type="rnn", sample_from_anchor=False), 8, 24, "off"),
], ids=["spec-vanilla", "deepspec-narrow", "spec-gated-sps", "deepspec-rnn-wide"])
def test_tree_greedy_equals_plain_greedy(target, greedy, tmp_path, format, options, top_k, budget, scheduler):
    draft = load_draft(write_tiny_draft(target, tmp_path / "d", format=format, **options))
    size = budget or draft.config.block_size + 1
    # the smallest step budget: the rows' trees and 4 prompt tokens, so prompts run in chunks beside them
    config = EngineConfig(max_batch=3, scheduler=scheduler, threshold=0.2, draft_top_k=top_k, tree_budget=budget,
                          max_num_batched_tokens=3 * size + 4)
    engine = LLMEngine(target, draft, config)
    results = engine.generate([Request(p, NEW) for p in PROMPTS])  # 4 requests through 3 rows
    assert [r.token_ids for r in results] == greedy
    alone = engine.generate([Request(PROMPTS[2], NEW)])[0]
    assert alone.token_ids == greedy[2]
    stats = results[0].stats
    assert stats.rounds and all(1 <= a <= s + 1 and s <= size - 1 for a, s in zip(stats.accept_lengths,
                                                                                  stats.scheduled_lengths))
    assert not engine.has_unfinished() and sorted(engine.scheduler.free_slots) == [0, 1, 2]


def test_tree_runs_to_exactly_the_context_limit(target, tmp_path):
    draft = load_draft(write_tiny_draft(target, tmp_path / "d", format="speculators"))
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2, draft_top_k=4, tree_budget=16))
    prompts = [PROMPTS[2], list(range(1, LIMIT - 1))]
    results = engine.generate([Request(p, LIMIT) for p in prompts])
    assert [r.token_ids for r in results] == [_greedy(target, p, LIMIT - len(p)) for p in prompts]
    assert [r.finish_reason for r in results] == ["length", "length"]


def test_tree_mode_refuses_what_it_cannot_do(target):
    for bad, match in ((dict(draft_top_k=9), r"draft_top_k must be in \[1, 8\], got 9"),
                       (dict(tree_budget=65), r"tree_budget must be in \[0, 64\], got 65"),
                       (dict(tree_budget=1), "tree_budget must be 0 .* or in \\[2, 64\\], got 1"),
                       (dict(draft_top_k=2, scheduler="cost", cost_table="x.json"), None)):
        with pytest.raises((ValueError, OSError), match=match):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="tree mode \\(draft_top_k > 1\\) needs a draft"):
        LLMEngine(target, None, EngineConfig(draft_top_k=2))


def test_a_tree_accepts_more_per_round_than_the_chain_on_the_demo_pair():
    """The shipped pair (fp32, greedy): a 16-node tree of top-4 candidates keeps more tokens per
    round than the 7-draft chain, and both outputs equal plain decoding."""
    from dspark.engine import load_tokenizer
    from dspark.training.data import demo_pair, read_prompts

    pair = demo_pair()
    tokenizer = load_tokenizer(pair.target)
    prompts = [tokenizer(r["text"])["input_ids"] for r in read_prompts(str(pair.prompts))[:3]]
    run = lambda **tree: LLMEngine(str(pair.target), str(pair.draft), EngineConfig(  # noqa: E731
        max_batch=3, dtype=torch.float32, device="cpu", **tree)).generate([Request(p, 48) for p in prompts])
    chain, tree = run(), run(draft_top_k=4, tree_budget=16)
    plain = LLMEngine(str(pair.target), None, EngineConfig(max_batch=3, dtype=torch.float32, device="cpu")).generate(
        [Request(p, 48) for p in prompts])
    assert [r.token_ids for r in tree] == [r.token_ids for r in chain] == [r.token_ids for r in plain]
    tau = lambda rs: sum(a for r in rs for a in r.stats.accept_lengths) / sum(r.stats.rounds for r in rs)  # noqa: E731
    assert tau(tree) > tau(chain)


@pytest.mark.gpu
@pytest.mark.gpu
def test_cuda_tree_greedy_equals_plain_greedy(tmp_path):
    """The Triton kernels' tree masks and node rows on the GPU (fp32), the rounds in CUDA graphs."""
    target = tiny_qwen3_target(max_position_embeddings=LIMIT).to("cuda")
    draft = load_draft(write_tiny_draft(target.cpu(), tmp_path / "d", format="speculators")).to("cuda")
    target.to("cuda")
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, draft_top_k=4, tree_budget=16))
    plain = engine.plain().generate([Request(p, NEW) for p in PROMPTS])
    assert engine.capture_graphs() and ("mixed", 2, 2 * 16, 16, False) in engine.runner.graphs
    captured = engine.runner.captures
    assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == [r.token_ids for r in plain]
    # tree rounds and the steps where prompts join replay CUDA graphs captured up front
    assert engine.runner.captures == captured and not engine.runner.uncapturable


def test_sampled_requests_in_tree_mode_are_request_stable(target, greedy, tmp_path):
    """Sampled rows walk their trees with request-stable uniforms (seed, anchor position): the same
    tokens alone and in a batch with greedy and other sampled rows, and the greedy rows beside them
    still equal plain greedy decoding. (That each emitted token follows the target is
    ``test_tree.test_sampled_tree_accept_emits_the_targets_distribution_at_every_node``.)"""
    draft = load_draft(write_tiny_draft(target, tmp_path / "d", format="speculators"))
    engine = LLMEngine(target, draft, EngineConfig(max_batch=4, draft_top_k=3, tree_budget=10))
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    alone = engine.generate([Request(PROMPTS[2], NEW, hot)])[0]
    mixed = engine.generate([Request(PROMPTS[1], NEW, SamplingParams(temperature=1.0, top_k=5, seed=3)),
                             Request(PROMPTS[2], NEW, hot), Request(PROMPTS[0], NEW)])
    assert mixed[1].token_ids == alone.token_ids and mixed[2].token_ids == greedy[0]
    assert alone.stats.rounds and len(alone.token_ids) == NEW
    other = engine.generate([Request(PROMPTS[2], NEW, SamplingParams(temperature=0.9, top_p=0.9, seed=12))])[0]
    assert other.token_ids != alone.token_ids


def test_the_tree_benchmark_runs_on_the_cpu(tmp_path):
    """``python -m dspark.bench.tree``: the demo pair's τ grid and the round-time mode (a tiny shape)."""
    import json

    from dspark.bench import tree as bench

    assert bench.main(["--out", str(tmp_path / "tau"), "--limit", "2", "--max-new-tokens", "12", "--budgets", "6",
                       "--top-k", "2"]) == 0
    report = json.loads((tmp_path / "tau" / "tree.json").read_text())
    assert [r["mode"] for r in report["rows"]] == ["chain", "tree"] and all(r["identical"] == 2 for r in report["rows"])
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, tie_word_embeddings=False, capture=[1])
    assert bench.main(["--out", str(tmp_path / "rt"), "--round-times", "--device", "cpu", "--vocab", "64",
                       "--shape", json.dumps(shape), "--batches", "2", "--budgets", "6", "--max-new-tokens", "8",
                       "--tau-from", str(tmp_path / "tau" / "tree.json"), "--round-top-k", "2"]) == 0
    rows = json.loads((tmp_path / "rt" / "round-times.json").read_text())["rows"]
    assert [(r["mode"], r["budget"]) for r in rows] == [("chain", None), ("tree", 6)]
    assert all(r["step_ms"] > 0 and "est_speed_over_chain" in r for r in rows)
