"""The batched engine (``LLMEngine``: target runner, draft runner, continuous batching) on the CPU.

The runner's logits and captured states are checked against the Hugging Face model; the engine's
greedy output against plain greedy decoding by full recomputation, per request, whatever the batch;
sampled output against the same request decoded alone, and against the exact target distribution.
"""

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target, write_tiny_draft
from test_engine import _forward, _greedy, assert_first_tokens_follow_the_target

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.engine.rows import LogitsPath
from dspark.model import load_draft
from dspark.model.draft_runner import DraftRunner, draft_cache
from dspark.model.llama import AttentionBatch, TargetLM

PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
NEW = 14


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.fixture(scope="module")
def greedy(target):
    return [_greedy(target, p, NEW) for p in PROMPTS]


def _tiny_llama(rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, initializer_range=0.1, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, rope_parameters=rope)).eval()


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


# ---------------------------------------------------------------------------------- target runner


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen2-tied-bias"])
def test_runner_logits_and_captures_match_hugging_face(target, family):
    model = {"qwen3": lambda: target, "llama3": lambda: _tiny_llama(LLAMA3_ROPE), "qwen2-tied-bias": _tiny_qwen2}[family]()
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    lm = TargetLM.from_hf_model(model, [0, 2])
    cache = lm.new_cache(3, 32)
    # a ragged prefill of both requests (6 and 4 tokens) into slots 2 and 0, then 5 + 5 verify tokens
    lens, slots = [6, 4], [2, 0]
    flat = torch.cat([ids[0, :6], ids[1, :4]])
    positions = torch.cat([torch.arange(6), torch.arange(4)])
    token_slots = torch.tensor([2] * 6 + [0] * 4)
    batch = AttentionBatch(torch.tensor(slots), torch.zeros(2, dtype=torch.int32), torch.tensor([0, 6, 10]), 6)
    logits = lm.forward(flat, positions, token_slots, batch, cache)
    torch.testing.assert_close(logits[:6], ref.logits[0, :6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[6:], ref.logits[1, :4], rtol=1e-4, atol=1e-4)
    h = model.config.hidden_size
    capture = torch.zeros(2, 5, 2 * h)
    verify = torch.cat([ids[0, 6:], ids[1, 4:9]])
    positions = torch.cat([torch.arange(6, 11), torch.arange(4, 9)])
    batch = AttentionBatch(torch.tensor(slots), torch.tensor(lens), torch.tensor([0, 5, 10]), 5)
    logits = lm.forward(verify, positions, torch.tensor([2] * 5 + [0] * 5), batch, cache, capture_out=capture,
                        logits_rows=torch.tensor([0, 4, 9]))
    expected = torch.stack([ref.logits[0, 6], ref.logits[0, 10], ref.logits[1, 8]])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(capture[0, :, :h], ref.hidden_states[0][0, 6:])
    torch.testing.assert_close(capture[1, :, h:], ref.hidden_states[2][1, 4:9], rtol=1e-5, atol=1e-5)


def test_runner_loads_sharded_checkpoints_and_names_bad_tensors(target, tmp_path):
    from safetensors.torch import load_file, save_file

    target.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    lm = TargetLM.from_pretrained(tmp_path / "sharded", [1])
    ids = torch.tensor([3, 4, 5])
    batch = AttentionBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([0, 3]), 3)
    logits = lm.forward(ids, torch.arange(3), torch.zeros(3, dtype=torch.int32), batch, lm.new_cache(1, 8))
    torch.testing.assert_close(logits, _forward(target, [3, 4, 5])[0], rtol=1e-5, atol=1e-5)

    target.save_pretrained(tmp_path / "one")
    weights = load_file(tmp_path / "one" / "model.safetensors")
    bad = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(bad, tmp_path / "one" / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        TargetLM.from_pretrained(tmp_path / "one")
    weights["model.norm.weight"] = weights["model.norm.weight"][:5].clone()
    save_file(weights, tmp_path / "one" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape \[5\]"):
        TargetLM.from_pretrained(tmp_path / "one")
    (tmp_path / "one" / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TargetLM.from_pretrained(tmp_path / "one")
    (tmp_path / "one" / "model.safetensors").unlink()
    (tmp_path / "one" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="only pickle weights"):
        TargetLM.from_pretrained(tmp_path / "one")
    with pytest.raises(ValueError, match="no such path"):
        TargetLM.from_pretrained(tmp_path / "missing")


def test_draft_runner_matches_forward_block(target):
    """The batched draft forward over paged lines (shuffled blocks of 8) equals one line's forward_block."""
    config = tiny_draft_config(target.config)  # full + sliding (window 8) layers
    draft = random_draft(config, 0, target)
    width = config.num_capture_layers * config.hidden_size
    table = (torch.randperm(24, generator=torch.Generator().manual_seed(0)) + 1).view(3, 8).to(torch.int32)
    runner = DraftRunner(draft, draft_cache(draft, paged=(25, 8, table)))  # lines of 64 positions
    contexts = [torch.randn(13, width), torch.randn(20, width)]
    slots = [2, 0]
    for context, slot in zip(contexts, slots):
        runner.context(context, torch.arange(context.shape[0]), torch.full((context.shape[0],), slot))
    hidden = runner.block(torch.tensor([7, 9], dtype=torch.int32), torch.tensor([13, 20], dtype=torch.int32),
                          torch.tensor(slots, dtype=torch.int32))
    for b, (context, anchor) in enumerate(zip(contexts, (7, 9))):
        cache = draft.new_cache()
        draft.forward_block(cache, context[:9], torch.tensor([5]), 9)  # an earlier round first
        expected = draft.forward_block(cache, context[9:], torch.tensor([anchor]), context.shape[0])
        torch.testing.assert_close(hidden.view(2, config.block_size, -1)[b], expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("format, options, scheduler", [
    ("speculators", dict(), "off"),
    ("deepspec", dict(), "threshold"),
    ("speculators", dict(markov_head_type="gated", sample_from_anchor=False), "sps"),
    ("deepspec", dict(markov_head_type="rnn", sample_from_anchor=False), "off"),
    ("speculators", dict(draft_vocab_size=48), "sps"),
    (None, None, "off"),  # plain decoding on the same runner
], ids=["spec-vanilla", "deepspec-threshold", "spec-gated-sps", "deepspec-rnn", "spec-reduced-vocab", "plain"])
def test_batched_greedy_equals_plain_greedy_per_request(target, greedy, tmp_path, format, options, scheduler):
    draft = None if format is None else load_draft(write_tiny_draft(target, tmp_path / "d", format=format, **options))
    # 4 requests through 3 rows: the last joins when the first leaves
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler=scheduler, threshold=0.3))
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    assert all(r.finish_reason == "length" for r in results)
    if draft is not None:
        stats = results[0].stats
        assert stats.rounds and all(1 <= a <= s + 1 for a, s in zip(stats.accept_lengths, stats.scheduled_lengths))
        assert stats.generated_tokens == NEW
    assert not engine.has_unfinished() and sorted(engine.scheduler.free_slots) == [0, 1, 2]


def test_llama_target_through_the_engine(tmp_path):
    llama = _tiny_llama({"rope_type": "default", "rope_theta": 10000.0})
    draft = load_draft(write_tiny_draft(llama, tmp_path / "d", format="deepspec", markov_head_type="gated"))
    engine = LLMEngine(llama, draft, EngineConfig(max_batch=2))
    results = engine.generate([Request(p, max_new_tokens=10) for p in PROMPTS[:3]])
    assert [r.token_ids for r in results] == [_greedy(llama, p, 10) for p in PROMPTS[:3]]


@pytest.fixture(scope="module")
def engine(target):
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    return LLMEngine(target, draft, EngineConfig(max_batch=4, scheduler="threshold", threshold=0.2))


@pytest.mark.parametrize("scheduler", ["off", "cost"])
@pytest.mark.parametrize("graph_chunk_tokens", [256, 16])
def test_the_start_up_capture_covers_the_steps_where_prompts_join(target, greedy, scheduler, graph_chunk_tokens,
                                                                  monkeypatch):
    """``capture_graphs`` captures the steps with prompt chunks up front (``mixed_shapes``): every
    such step that greedy requests joining running rows meet has its shape among them, and each
    shape's capture (here its eager warm-up, its writes undone as on a GPU) leaves the decoding as it
    was. With ``GRAPH_CHUNK_TOKENS`` 16, the steps with more chunk tokens pad their verify to every
    row's full length (one graph per rows bucket), and the tokens stay the same."""
    from dspark.engine import chunks
    from dspark.engine.schedulers import SPSCostTable

    monkeypatch.setattr(chunks, "GRAPH_CHUNK_TOKENS", graph_chunk_tokens)

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler=scheduler, max_num_batched_tokens=48,
                                                   max_model_len=32, cost_table=SPSCostTable((1, 64), (1.0, 8.0))))
    runner = engine.runner
    shapes = runner.mixed_shapes(plain_rounds=scheduler == "cost")
    full = runner.verify_len
    assert (0, None, 16) in shapes and (2, 2 * full, 48) in shapes and (3, 3 * 5, 16) in shapes
    assert ((3, 3 * 2, 32) in shapes) == (graph_chunk_tokens == 256)  # else only the full verify
    assert runner.line < 48  # a capture stages its chunk tokens as several chunks of the dummy line
    assert ((3, None, 16) in shapes) == (scheduler == "cost")  # a plain round with chunks: the cost scheduler's
    runner.state.draft_probs.fill_(1 / target.config.vocab_size)  # the CPU's kernels check them
    for b, num_tokens, bucket in shapes:
        restore = runner._snapshot()
        runner._capture_mixed(b, num_tokens, bucket, LogitsPath.PENALISED if b else LogitsPath.GREEDY)
        restore()
    prompts = PROMPTS[:3] + [PROMPTS[2] + PROMPTS[0]]
    expected = greedy[:3] + [_greedy(target, prompts[3], NEW)]
    met, replay = [], runner._replay
    runner._replay = lambda key, fn: (met.append(key), replay(key, fn))
    try:
        lengths = [NEW, 3, NEW, NEW]  # the second ends early: the last (17 prompt tokens) joins running rows
        results = engine.generate([Request(p, n) for p, n in zip(prompts, lengths)])
    finally:
        del runner._replay
    assert [r.token_ids for r in results] == [g[:n] for g, n in zip(expected, lengths)]
    mixed = {key[1:4] for key in met if key[0] == "mixed"}
    assert len(mixed) > 1 and any(b > 0 for b, _, _ in mixed) and mixed <= set(shapes)
    padded = {(b, n) for b, n, bucket in mixed if b and n is not None and bucket > graph_chunk_tokens}
    assert bool(padded) == (graph_chunk_tokens == 16)
    assert all(n == b * runner.verify_len for b, n in padded)


def test_a_request_alone_equals_the_same_request_in_a_batch(engine):
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    alone = engine.generate([Request(PROMPTS[2], 12, hot)])[0].token_ids
    greedy_alone = engine.generate([Request(PROMPTS[0], 12)])[0].token_ids
    mixed = engine.generate([Request(PROMPTS[1], 12, SamplingParams(temperature=1.0, top_k=5, seed=3)),
                             Request(PROMPTS[2], 12, hot), Request(PROMPTS[0], 12), Request(PROMPTS[3], 9, hot)])
    assert mixed[1].token_ids == alone and mixed[2].token_ids == greedy_alone
    same = engine.generate([Request(PROMPTS[2], 12, hot), Request(PROMPTS[2], 12, hot)])
    assert same[0].token_ids == same[1].token_ids == alone  # one seed, one output
    other = engine.generate([Request(PROMPTS[2], 12, SamplingParams(temperature=0.9, top_p=0.9, seed=12))])
    assert other[0].token_ids != alone


def test_a_sampled_request_stays_request_stable_through_steps_where_prompts_join(engine):
    """A sampled request's tokens are the same whoever joins beside it in steps with prompt chunks."""
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    alone = engine.generate([Request(PROMPTS[2], 24, hot)])[0]
    running = engine.add_request(Request(PROMPTS[2], 24, hot))
    seq, done = engine.sequences[running], {running: []}
    for i in range(12):  # greedy requests join one by one, each a step with a prompt chunk
        if i < 3:
            done[engine.add_request(Request(PROMPTS[i % 2], 4 + 2 * i))] = []
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    # the same drafts verified round by round (a raised length would verify more), the same tokens
    assert seq.stats.scheduled_lengths == alone.stats.scheduled_lengths and done[running] == alone.token_ids


def test_a_sampled_request_joining_greedy_rows_leaves_them_greedy(engine, greedy):
    """Rows drafted greedily (no draft distributions) are verified greedily in the step a sampled
    request joins; from the next round every row takes the sampled path, the greedy ones exactly."""
    first = engine.add_request(Request(PROMPTS[0], NEW))
    done: dict[int, list[int]] = {first: []}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    hot = engine.add_request(Request(PROMPTS[2], 12, SamplingParams(temperature=0.9, top_p=0.9, seed=11)))
    done[hot] = []
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    assert done[first] == greedy[0] and len(done[hot]) == 12


def test_requests_join_and_leave_between_steps(engine, greedy):
    first = engine.add_request(Request(PROMPTS[0], NEW))
    done: dict[int, list[int]] = {first: []}
    for _ in range(2):
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    late = engine.add_request(Request(PROMPTS[2], NEW))
    aborted = engine.add_request(Request(PROMPTS[1], NEW))
    done[late], done[aborted], reasons = [], [], {}
    for out in engine.step():
        done[out.request_id] += out.new_token_ids
    engine.abort(aborted)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != aborted
            done[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert done[first] == greedy[0] and reasons[first] == "length"
    assert done[aborted] == greedy[1][: len(done[aborted])] and aborted not in reasons
    assert done[late] == greedy[2] and sorted(engine.scheduler.free_slots) == [0, 1, 2, 3]


def test_launch_and_finish_make_a_step_and_guard_the_round_in_between(engine, greedy):
    """The server's split step: a request joins between launch and finish; abort must wait."""
    first = engine.add_request(Request(PROMPTS[0], NEW))
    done: dict[int, list[int]] = {first: []}
    engine.launch()
    late = engine.add_request(Request(PROMPTS[2], NEW))  # queued: joins at the next launch
    done[late] = []
    with pytest.raises(ValueError, match="between launch"):
        engine.abort(first)
    with pytest.raises(ValueError, match="called twice"):
        engine.launch()
    while True:
        for out in engine.finish():
            done[out.request_id] += out.new_token_ids
        if not engine.has_unfinished():
            break
        engine.launch()
    with pytest.raises(ValueError, match="without launch"):
        engine.finish()
    assert done == {first: greedy[0], late: greedy[2]}
    for rid in (first, late):
        engine.sequences.pop(rid)


def test_stop_ids_eos_and_max_new_tokens_end_each_request(engine, greedy):
    stop = greedy[0][4]
    results = engine.generate([Request(PROMPTS[0], NEW, stop_ids=[stop]), Request(PROMPTS[2], 3),
                               Request(PROMPTS[1], 0), Request(PROMPTS[3], NEW)])
    cut = greedy[0].index(stop) + 1
    assert results[0].token_ids == greedy[0][:cut] and results[0].finish_reason == "stop"
    assert results[1].token_ids == greedy[2][:3] and results[1].finish_reason == "length"
    assert results[2].token_ids == [] and results[2].finish_reason == "length"
    assert results[3].token_ids == greedy[3]


def test_context_limit_ends_with_length_and_long_prompts_are_refused(target, greedy):
    engine = LLMEngine(target, None, EngineConfig(max_batch=2, max_model_len=10))
    result = engine.generate([Request(PROMPTS[0], 50)])[0]
    assert result.token_ids == greedy[0][:4] and result.finish_reason == "length"
    with pytest.raises(ValueError, match=r"11 tokens; the context limit \(max_model_len\) is 10"):
        engine.add_request(Request(PROMPTS[2], 5))
    with pytest.raises(ValueError, match=r"token id 96, outside the target's vocabulary \[0, 96\)"):
        engine.add_request(Request([1, 96], 5))
    with pytest.raises(ValueError, match="max_model_len 4000 exceeds"):
        LLMEngine(target, None, EngineConfig(max_model_len=4000))
    with pytest.raises(ValueError, match=r"max_batch must be in \[1, inf\], got 0"):
        EngineConfig(max_batch=0)
    with pytest.raises(TypeError, match="prompt_ids must be a non-empty sequence"):
        Request("hello")
    with pytest.raises(ValueError, match=r"max_new_tokens must be in \[0, inf\], got -1"):
        Request([1], -1)


def test_oracle_acceptance_controls_tau(target, greedy):
    """``bench.oracle.OracleEngine``: drafts replaced by the known continuation (acceptance 1) or by
    rejected tokens (0); the output stays the target's own."""
    from dspark.bench.oracle import OracleEngine

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    for acceptance, tau in ((1.0, 5.0), (0.0, 1.0)):
        engine = OracleEngine(target, draft, EngineConfig(max_batch=2), acceptance=acceptance)
        ids = [engine.add_request(Request(p, 13), g + [0] * 8) for p, g in zip(PROMPTS[:2], greedy)]
        while engine.has_unfinished():
            engine.step()
        results = [engine.sequences[i] for i in ids]
        assert [r.output_ids for r in results] == [g[:13] for g in greedy[:2]]
        assert all(a == tau for r in results for a in r.stats.accept_lengths[:-1])
        with pytest.raises(ValueError, match="oracle_ids .* is required"):
            engine.add_request(Request(PROMPTS[0], 4))


@pytest.mark.slow
def test_batched_sampled_tokens_follow_the_target_distribution():
    """V = 4, temperature 1, top-k 2, P = 2, through the batched engine (rows of 512 requests, each
    its own seed): the first three tokens' empirical distributions over 12 000 requests match the
    exact ones at chi-square p > 1e-3 and TV < 0.01 (test_engine's sizing)."""
    runs, vocab, top_k, prompt = 12_000, 4, 2, [1, 3, 2, 0, 2]
    target = tiny_qwen3_target(vocab_size=vocab)
    draft = random_draft(tiny_draft_config(target.config, block_size=2), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=512))
    requests = [Request(prompt, 3, SamplingParams(temperature=1.0, top_k=top_k, seed=s), stop_ids=[])
                for s in range(runs)]
    out = torch.tensor([r.token_ids for r in engine.generate(requests)])
    assert_first_tokens_follow_the_target(out, target, prompt, top_k)


def test_cost_scheduler_trims_verification_and_falls_back_to_plain_rounds(target, greedy):
    """Algorithm 1 across the batch: with a cost table where every verify token is expensive the
    engine verifies fewer drafts than with a flat one; where no draft pays for its verify and draft
    pass it decodes plainly (rounds verifying no draft, without the draft pass), drafting again
    every ``REDRAFT_STEPS`` plain rounds; greedy output stays exact every way."""
    from dspark.engine.round_plan import REDRAFT_STEPS
    from dspark.engine.schedulers import SPSCostTable

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    verified = {}
    tables = {"flat": SPSCostTable((1, 64), (1.0, 1.0)), "steep": SPSCostTable((1, 64), (1.0, 64.0)),
              "drafting never pays": SPSCostTable((1, 64), (1.0, 64.0), draft_rows=(1,), draft_time_ms=(50.0,))}
    for name, table in tables.items():
        engine = LLMEngine(target, draft, EngineConfig(max_batch=4, scheduler="cost", cost_table=table))
        results = engine.generate([Request(p, NEW) for p in PROMPTS])
        assert [r.token_ids for r in results] == greedy, name
        verified[name] = [s for r in results for s in r.stats.scheduled_lengths]
        assert all(0 <= s <= engine.num_drafts for s in verified[name])
    assert min(verified["flat"]) >= 1  # drafting pays: every round verifies drafts
    assert sum(verified["steep"]) / len(verified["steep"]) < sum(verified["flat"]) / len(verified["flat"])
    assert engine.metrics.plain_steps > 0  # the last engine's table: drafting never pays
    plain = verified["drafting never pays"].count(0)
    # every round is plain but one in REDRAFT_STEPS + 1 (and a request's first, drafted where it joined)
    assert plain >= len(verified["drafting never pays"]) * REDRAFT_STEPS / (REDRAFT_STEPS + 1) - len(PROMPTS)
    with pytest.raises(ValueError, match="scheduler 'cost' needs cost_table"):
        EngineConfig(scheduler="cost")


def test_the_wait_for_a_fresh_draft_doubles_while_drafting_does_not_pay(target, monkeypatch):
    """Plain rounds under the cost scheduler: after ``REDRAFT_STEPS`` of them the engine drafts again
    (fresh confidences); each time that finds drafting still does not pay the wait doubles, at most
    ``REDRAFT_DOUBLINGS`` times -- at high load each refresh costs a draft pass and a verify of every
    row. Greedy output exact."""
    from dspark.engine import round_plan
    from dspark.engine.schedulers import SPSCostTable

    monkeypatch.setattr(round_plan, "REDRAFT_STEPS", 2)
    monkeypatch.setattr(round_plan, "REDRAFT_DOUBLINGS", 3)
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    never = SPSCostTable((1, 64), (1.0, 64.0), draft_rows=(1,), draft_time_ms=(50.0,))
    engine = LLMEngine(target, draft, EngineConfig(max_batch=1, scheduler="cost", cost_table=never))
    engine.add_request(Request(PROMPTS[1], 90))
    drafted, out = [], []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
        drafted.append(engine.runner.drafted)
    runs = [len(run) for run in "".join("d" if d else "p" for d in drafted).split("d") if run]
    assert runs[:6] == [2, 4, 8, 16, 16, 16] and out == _greedy(target, PROMPTS[1], 90)


def test_plain_rounds_keep_their_choice_until_the_batch_shrinks(target, greedy, monkeypatch):
    """In plain rounds the choice to go on decoding plainly is not planned again every step (the
    confidences it read are the same until a draft pass): only when a refresh is due, or when the
    drafting rows fall below ``PLAIN_CHOICE_SHRINK`` of those it was made for -- here drafting pays
    on one row only, and the engine drafts again once one request is left. Greedy output exact."""
    from dspark.engine import round_plan
    from dspark.engine.schedulers import SPSCostTable

    calls = []

    def pays_on_one_row(signal, *args):
        calls.append(len(signal))
        return len(signal) <= 1

    monkeypatch.setattr(round_plan, "drafting_pays", pays_on_one_row)
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=4, scheduler="cost",
                                                   cost_table=SPSCostTable((1, 64), (1.0, 64.0))))
    new = (20, 30, 40, 60)
    ids = [engine.add_request(Request(p, n)) for p, n in zip(PROMPTS, new)]
    outs, drafted = {i: [] for i in ids}, []
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        drafted.append((len(engine.scheduler.running), engine.runner.drafted))
    assert [outs[i] for i in ids] == [_greedy(target, p, n) for p, n in zip(PROMPTS, new)]
    plain_on_rows = sum(rows >= 2 and not d for rows, d in drafted)
    planned_on_rows = sum(n >= 2 for n in calls)  # at 4 rows, then 3 (< 7/8 of 4), then 2; one refresh
    assert plain_on_rows >= 30 and planned_on_rows <= 5, (plain_on_rows, calls)
    assert 1 in calls and any(d for rows, d in drafted if rows == 1)  # one request left: drafting again


def _draft_context(engine, seq, n: int) -> torch.Tensor:
    """The draft model's context K of ``seq``'s first ``n`` positions ``[n, layers, heads, dim]``."""
    cache = engine.runner.proposer.draft.cache
    table, size = cache.block_table[seq.slot], cache.block_size
    return torch.stack([cache.k[:, table[p // size], p % size] for p in range(n)])


def _contexts(engine, requests: list) -> tuple[dict, list[bool]]:
    """Run ``requests``; per request its draft context over its committed positions but the last
    (final once written), as the latest step left it, and whether each step with a prompt drafted."""
    contexts, mixed_drafted = {}, []
    runner = engine.runner
    mixed = runner._mixed_step

    def recording(*args, **kwargs):
        mixed(*args, **kwargs)
        mixed_drafted.append(runner.drafted)

    runner._mixed_step = recording
    ids = [engine.add_request(r) for r in requests]
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.prompt_len + len(seq.output_ids) - 1
            contexts[seq.request_id] = _draft_context(engine, seq, n)
    return {i: contexts[i] for i in ids}, mixed_drafted


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_that_do_not_draft_keep_every_rows_draft_context(target, device):
    """Under the cost scheduler's plain rounds a step with prompt chunks does not draft either (at
    high load most steps carry chunks: drafting each would cost a draft pass of every row): it writes
    the draft context of every row -- running rows and the requests it seats -- as the draft pass
    would. Each request's context then equals its context in an engine that drafts every step (on
    CUDA: from the graphs the start-up captured, none captured later)."""
    from dspark.engine.schedulers import SPSCostTable

    target = target if device == "cpu" else tiny_qwen3_target().cuda()
    draft = random_draft(tiny_draft_config(target.config), 0, target).to(device)
    never = SPSCostTable((1, 64), (1.0, 64.0), draft_rows=(1,), draft_time_ms=(50.0,))
    requests = [Request(p, n) for p, n in zip(PROMPTS, (6, 24, 8, 12))]  # the later ones join running rows
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2, scheduler="cost", cost_table=never))
    engine.capture_graphs()  # the server's start-up capture (none on the CPU)
    captured = engine.runner.captures
    plain, mixed_drafted = _contexts(engine, requests)
    assert False in mixed_drafted and engine.runner.captures == captured  # joined in steps that did not draft
    drafting, _ = _contexts(LLMEngine(target, draft, EngineConfig(max_batch=2, scheduler="off")), requests)
    for rid, context in plain.items():
        n = min(len(context), len(drafting[rid]))
        assert n > len(PROMPTS[rid]) and torch.allclose(context[:n], drafting[rid][:n], atol=1e-5), rid


def test_a_step_that_captures_a_graph_is_left_out_of_the_host_time_average(target):
    """The cost scheduler prices a round's host time from the steps' average (on a GPU); a step
    that captured a CUDA graph (a one-off of tens of ms) must not move it, or drafting would look
    unprofitable for many steps after."""
    from dspark.engine.schedulers import SPSCostTable

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2, scheduler="cost",
                                                   cost_table=SPSCostTable((1, 64), (1.0, 1.0))))
    engine.runner.device = torch.device("cuda")  # the average is kept on a GPU only; nothing runs here
    engine._count_round(True, 0.002)
    engine._count_round(True, 0.080, captured=True)
    engine._count_round(False, 0.001)
    assert engine._host_ms == pytest.approx([2.0, 1.0])
    engine._count_round(True, 0.012)
    assert engine._host_ms[0] == pytest.approx(3.0)  # 0.9 x 2 + 0.1 x 12


def test_a_plain_round_is_not_priced_at_a_drafting_rounds_host_time(target, greedy):
    """Until a plain round ran, the cost scheduler prices its host time at none, not at the drafting
    rounds' (measured on a GPU): where drafting rounds take the host long (at high load) but the
    table says plain rounds pay, a plain round then runs -- priced as a drafting round, plain rounds
    looked as slow, none ran, and their host time was never measured."""
    from dspark.engine.schedulers import SPSCostTable

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    compute_bound = SPSCostTable((1, 64), (1.0, 64.0))  # 1 ms a verified token: drafting never pays on the table
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler="cost", cost_table=compute_bound))
    count = engine._count_round

    def slow_drafting_host(drafted, host_s, captured=False):  # as a GPU measures it (the CPU keeps none)
        count(drafted, host_s, captured)
        engine._host_ms[0] = 50.0

    engine._count_round = slow_drafting_host
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    assert engine.metrics.plain_steps >= engine.metrics.steps // 2


@pytest.mark.parametrize("scheduler", ["off", "threshold"])
def test_a_step_waits_for_its_draft_pass_only_where_the_scheduler_reads_the_proposals(target, greedy, scheduler):
    """A step's tokens are committed from the target pass's readout; the draft pass's (proposal
    lengths, confidences) is waited for only by schedulers that pick verify lengths from it -- under
    ``off`` the next step is launched behind the running draft pass -- and greedy output stays exact."""
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler=scheduler, threshold=0.3))
    real, reads = engine.runner.read_proposals, []
    engine.runner.read_proposals = lambda rows: reads.append(rows) or real(rows)
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    assert (reads == []) == (scheduler == "off")
    # each step's proposals are read by the next plan (the last step's by none)
    assert scheduler == "off" or engine.metrics.steps - 3 <= len(reads) < engine.metrics.steps and max(reads) == 3


@pytest.mark.parametrize("flat", [True, False])
def test_the_cost_scheduler_reads_the_confidences_behind_the_queued_verify_where_it_verifies_every_draft(
        target, greedy, flat, monkeypatch):
    """Where the cost table is flat enough that Algorithm 1 verifies every draft whatever the
    confidences (``full_verify_wins``), a step queues its target pass first and reads the last draft
    pass's confidences only to choose whether it drafts, before its draft pass; elsewhere the plan
    reads them before anything is launched. Greedy output exact either way."""
    from dspark.engine import round_plan
    from dspark.engine.schedulers import SPSCostTable

    monkeypatch.setattr(round_plan, "FULL_CHOICE_STEPS", 0)  # every round plans (the next test holds a plan)
    engine, events = _passes_and_reads(target, greedy, SPSCostTable((1, 64), (1.0, 1.0) if flat else (1.0, 8.0)))
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert engine.metrics.steps - 3 <= len(reads) < engine.metrics.steps
    # the target pass before the read (flat) or after it (the plan needs the confidences)
    assert all((events[i - 1] == "verify") == flat for i in reads)
    assert all(events[i + 1] in ("verify", "draft", "context") for i in reads)


@pytest.mark.parametrize("near", [True, False])
def test_a_plan_that_verifies_every_draft_holds_for_the_next_rounds(target, greedy, monkeypatch, near):
    """Once Algorithm 1 verifies every draft of every row, where that round is within
    ``FULL_CHOICE_MARGIN`` of the fastest (``near``), the next ``FULL_CHOICE_STEPS`` rounds do so
    without planning: their target pass is queued before the last draft pass's confidences are read
    (only the drafting choice reads them). Further up the curve every round plans. Greedy output exact."""
    from dspark.engine import round_plan
    from dspark.engine.schedulers import SPSCostTable

    plans = []

    def every_draft(signal, *args):
        plans.append(len(signal))
        return [signal.shape[1]] * len(signal)

    monkeypatch.setattr(round_plan, "batch_schedule", every_draft)
    # Algorithm 1 runs (the plan waits); the full round is within the hold's margin (near) or not
    monkeypatch.setattr(round_plan, "full_verify_wins",
                        lambda table, rows, p, margin, *args: near and margin >= round_plan.FULL_CHOICE_MARGIN)
    engine, events = _passes_and_reads(target, greedy, SPSCostTable((1, 64), (1.0, 1.0)))
    reads = [i for i, e in enumerate(events) if e == "read"]
    held = sum(events[i - 1] == "verify" for i in reads)  # read behind the queued target pass
    assert engine.metrics.held_rounds == held
    assert len(plans) + held == len(reads) and len(reads) >= 2 * round_plan.FULL_CHOICE_STEPS
    if near:
        assert len(plans) <= -(-len(reads) // (round_plan.FULL_CHOICE_STEPS + 1)) + 1, (len(plans), len(reads))
    else:
        assert held == 0


def _passes_and_reads(target, greedy, table):
    """A cost-scheduled engine on ``table`` run over ``PROMPTS`` (greedy output checked), and the
    order of its passes (the graph keys' kinds) and proposal reads (``"read"``)."""
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler="cost", cost_table=table))
    events, replay, read = [], engine.runner._replay, engine.runner.read_proposals
    engine.runner._replay = lambda key, fn: (events.append(key[0]), replay(key, fn))
    engine.runner.read_proposals = lambda rows: events.append("read") or read(rows)
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    return engine, events


@pytest.mark.parametrize("busy", [False, True])
def test_host_work_done_while_a_draft_pass_runs_is_counted_as_overlapped(target, busy):
    """The scheduling of a step launched while the last draft pass still runs, and the commit of a
    step whose draft pass outlasts it, are host work off the critical path (on a GPU the runner asks
    its last readout event; a CPU runs as called, so never)."""
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=2))
    engine.runner.device_busy = lambda: busy
    engine.generate([Request(p, max_new_tokens=6) for p in PROMPTS[:3]])
    m = engine.metrics
    if not busy:
        assert m.host_overlapped_time == 0
    else:
        assert m.host_phases["plan"] <= m.host_overlapped_time <= m.host_phases["plan"] + m.host_phases["commit"]
        assert m.host_overlapped_time > m.host_phases["plan"]


def test_a_graph_warm_up_leaves_the_row_state_as_it_was(target):
    """``ModelRunner._snapshot`` (what a CUDA graph's warm-up run restores): every named row buffer
    but the captures and draft distributions it rewrites, and the benchmark drafts' per-slot buffers."""
    from dspark.bench.oracle import OracleEngine

    engine = OracleEngine(target, random_draft(tiny_draft_config(target.config), 0, target),
                          EngineConfig(max_batch=3), acceptance=0.5)
    runner = engine.runner
    names = [name for name, _ in runner.state.tensors()]
    assert {"anchor", "seeds", "verify_lens", "confidence", "capture"} <= set(names) and "tree_tokens" not in names
    before = {name: t.clone() for name, t in runner.state.tensors()}
    oracle = runner.draft_override.ids.clone()
    restore = runner._snapshot()
    for _, t in runner.state.tensors():
        t.add_(1)
    runner.draft_override.ids.add_(1)
    restore()
    for name, t in runner.state.tensors():
        assert torch.equal(t, before[name] + (name in ("capture", "draft_probs"))), name
    assert torch.equal(runner.draft_override.ids, oracle)


def test_profile_writes_a_cost_table_the_engine_reads(target, greedy, tmp_path):
    from dspark.engine.profile import default_token_counts, profile_costs
    from dspark.engine.schedulers import SPSCostTable

    assert default_token_counts(130) == [1, 2, 4, 8, 16, 32, 64, 128, 130]
    drafting = LLMEngine(target, random_draft(tiny_draft_config(target.config), 0, target), EngineConfig(max_batch=3))
    table = profile_costs(TargetLM.from_hf_model(target), [1, 8, 24], context=16, tokens_per_row=8, engine=drafting,
                          reps=2)
    assert table.token_counts == (1, 8, 24) and all(t > 0 for t in table.step_time_ms)
    # the decode curve: up to the verify curve's rows (24 tokens of 8 a row), one token a row
    assert table.decode_rows == (1, 2, 3) and all(t > 0 for t in table.decode_time_ms) and table.tokens_per_row == 8
    assert table.draft_rows == tuple(drafting.runner.buckets) and all(t > 0 for t in table.draft_time_ms)
    path = tmp_path / "cost.json"
    table.write_json(path)
    assert SPSCostTable.from_json(str(path)) == table
    path.write_text('{"token_counts": [1, 64], "step_time_ms": [1.0, 64.0]}')
    engine = LLMEngine(target, random_draft(tiny_draft_config(target.config), 0, target),
                       EngineConfig(max_batch=2, scheduler="cost", cost_table=str(path)))
    assert isinstance(engine.cost_table, SPSCostTable)
    assert engine.generate([Request(PROMPTS[0], NEW)])[0].token_ids == greedy[0]


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["off", "sps", "cost"])
def test_cuda_graph_engine_equals_plain_greedy_and_is_batch_invariant(target, greedy, scheduler):
    """On CUDA (Triton kernels, CUDA graphs per bucket), fp32: greedy output per request equals plain
    greedy decoding through joins and leaves; a sampled request alone equals it inside a batch; after
    the server's start-up capture no step captures a graph (prompt chunks joining running rows included)."""
    from dspark.engine.schedulers import SPSCostTable

    cuda_target = tiny_qwen3_target().cuda()
    draft = random_draft(tiny_draft_config(target.config), 0, target).cuda()
    table = SPSCostTable((1, 64), (1.0, 8.0))
    for d in (draft, None):
        engine = LLMEngine(cuda_target, d, EngineConfig(max_batch=3, scheduler=scheduler if d is not None else "off",
                                                        threshold=0.2, cost_table=table))
        engine.capture_graphs()  # the server's start-up capture
        captured = engine.runner.captures
        assert ("mixed", 0, None, 16, LogitsPath.GREEDY) in engine.runner.graphs
        if d is not None and scheduler == "cost":  # plain rounds included
            assert ("plain", 3, LogitsPath.GREEDY) in engine.runner.graphs
            # a plain round's draft context (one position a row), and a verify round's that does not draft
            assert {("context", 3, 1), ("context", 3, engine.runner.verify_len)} <= set(engine.runner.graphs)
            assert ("mixed", 2, None, 16, LogitsPath.PENALISED) in engine.runner.graphs
        results = engine.generate([Request(p, NEW) for p in PROMPTS])
        assert [r.token_ids for r in results] == greedy
        assert engine.runner.graphs, "the CUDA path must replay graphs"
        assert engine.metrics.graph_captures >= len(engine.runner.graphs)
        hot = SamplingParams(temperature=0.8, top_k=20, seed=5)
        alone = engine.generate([Request(PROMPTS[2], 12, hot)])[0].token_ids
        batch = engine.generate([Request(PROMPTS[0], 12, hot), Request(PROMPTS[2], 12, hot), Request(PROMPTS[1], 12, hot)])
        # any mix of settings replays the graphs (per-row settings); greedy rows among sampled ones stay greedy
        mixed = engine.generate([Request(PROMPTS[0], 12, SamplingParams(temperature=0.7, top_p=0.9, seed=1)),
                                 Request(PROMPTS[2], 12, hot), Request(PROMPTS[1], NEW)])
        assert mixed[2].token_ids == greedy[1]
        assert not engine.runner.uncapturable and any(key[-1] == LogitsPath.SAMPLED for key in engine.runner.graphs)
        # a prompt longer than GRAPH_CHUNK_TOKENS joins running rows: a graph of chunk bucket 512, the
        # running rows' verify padded to full rows
        long = [(7 * i) % 90 + 1 for i in range(300)]
        lengths = [NEW, 3, NEW, 6]
        met, replay = [], engine.runner._replay
        engine.runner._replay = lambda key, fn: (met.append(key), replay(key, fn))
        try:
            joined = engine.generate([Request(p, n) for p, n in zip(PROMPTS[:3] + [long], lengths)])
        finally:
            del engine.runner._replay
        assert [r.token_ids for r in joined] == [g[:n] for g, n in zip(greedy[:3], lengths)] + [_greedy(target, long, 6)]
        assert engine.runner.captures == captured, "a step met a graph shape capture_graphs left out"
        assert any(key[0] == "mixed" and key[1] > 0 and key[3] == 512 for key in met)
        if scheduler != "cost":  # Algorithm 1 couples rows: lossless, but a sample may depend on the batch
            assert batch[1].token_ids == alone == mixed[1].token_ids


def test_generate_api_and_cli_run_the_batched_engine(tmp_path, capsys):
    """``dspark.generate(..., engine="batched")`` and ``dspark generate --engine batched`` decode a
    list of prompts together; each request's output equals its own run alone (the reference engine).
    The command runs in this process (``dspark.cli.main``: the same parsing and printing; the
    ``python -m dspark`` entry point is test_cli_generate's and test_docs')."""
    import json

    import dspark
    from dspark.cli import main
    from dspark.training.data import demo_pair

    pair = demo_pair()
    # a directory loads in float32 on a CPU, as the CLI's --dtype auto (the checkpoint is bf16, whose
    # rounding would let a batch of three and a batch of one part at a near-tie)
    assert dspark.LLM(pair.target, pair.draft).decoder.target.dtype == torch.float32
    prompts = ["def add(a, b):", [5, 6, 7, 8], "import os\n"]
    batched = dspark.generate(pair.target, pair.draft, prompts, max_new_tokens=16, engine="batched")
    reference = dspark.generate(pair.target, pair.draft, prompts, max_new_tokens=16, engine="reference")
    assert [r.token_ids for r in batched] == [r.token_ids for r in reference]
    assert [r.text for r in batched] == [r.text for r in reference] and batched[0].text
    lines = tmp_path / "requests.jsonl"
    lines.write_text('{"prompt": "def add(a, b):", "max_new_tokens": 16}\n{"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 16}\n')
    capsys.readouterr()
    code = main(["generate", "--engine", "batched", "--prompt-file", str(lines), "--json", "--device", "cpu", "-q"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [r["generated_ids"] for r in rows] == [r.token_ids for r in reference[:2]]
    # on the CPU a round's draft and verify parts are timed apart, a batch's as one reference's
    assert rows[0]["stats"]["draft_time_s"] > 0 and rows[0]["stats"]["total_time_s"] > 0
    assert reference[0].stats.as_dict()["draft_time_s"] > 0


def test_evaluate_runs_on_the_batched_engine(target):
    from dspark.evaluation import evaluate

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    report = evaluate(target, {"d": draft}, PROMPTS[:2], max_new_tokens=8, engine="batched")
    row = report["drafts"][0]
    assert row["identical"] == 2 and row["rounds"] > 0 and report["plain"]["tokens"] == 16
    with pytest.raises(ValueError, match="evaluate: engine must be 'auto', 'batched' or 'reference', got 'fast'"):
        evaluate(target, {"d": draft}, PROMPTS[:1], engine="fast")


def test_graphs_are_captured_in_inference_mode(monkeypatch):
    """``capture_graphs`` runs in inference mode, as every step: a transformers model passed in has
    parameters that require gradients, and with gradients on a kernel given such a tensor resolves to
    the reference, which cannot be captured."""
    engine = LLMEngine(tiny_qwen3_target(), None, EngineConfig(max_batch=1))
    modes = []
    monkeypatch.setattr(engine.runner, "capture_graphs",
                        lambda **_: modes.append(torch.is_inference_mode_enabled()) or 0)
    assert engine.capture_graphs() == 0 and modes == [True]


def test_graphs_that_run_out_of_memory_say_which_settings_to_change(monkeypatch):
    """A capture that runs out of GPU memory (the KV blocks sized before it took too much) fails the
    engine's start with an error naming max_batch, gpu_memory_utilization and the way out, not a
    bare allocator message."""
    engine = LLMEngine(tiny_qwen3_target(), None, EngineConfig(max_batch=2))

    def out_of_memory(**_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.02 GiB")

    monkeypatch.setattr(engine.runner, "capture_graphs", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match=r"capturing the CUDA graphs of max_batch 2 ran out of GPU "
                       r"memory: .* gpu_memory_utilization 0.9 .* lower gpu_memory_utilization or max_batch"):
        engine.capture_graphs()


@pytest.mark.gpu
def test_the_reference_kernels_forced_run_eagerly_on_cuda():
    """Forced onto the PyTorch reference (``use_backend`` / ``DSPARK_BACKEND``), whose kernels read
    device values on the host, the engine captures no graph: it decodes eagerly, the same tokens."""
    import dspark.kernels as K

    target = tiny_qwen3_target().cuda()
    prompts = [Request([1, 2, 3, 4, 5], 6, ignore_eos=True)]
    with K.use_backend("reference"):
        engine = LLMEngine(target, None, EngineConfig(max_batch=2, device="cuda"))
        assert not engine.runner.use_graphs and engine.capture_graphs() == 0
        eager = engine.generate(prompts)[0].token_ids
    assert LLMEngine(target, None, EngineConfig(max_batch=2, device="cuda")).generate(prompts)[0].token_ids == eager
