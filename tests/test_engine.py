"""Speculative decoding end to end on tiny random models (CPU), one prompt at a time:
``SpeculativeDecoder`` (the ``"reference"`` ``LLMEngine``: max batch 1, no CUDA graphs) and
``LLMEngine.generate_requests``.

Greedy: the output must equal transformers' own greedy ``generate()`` token for token (the oracle),
whatever the draft (random checkpoints -> many rejections; the known continuation as drafts -> full
acceptance). Sampled: runs are reproducible per seed; ``assert_first_tokens_follow_the_target``
(used by test_llm_engine) checks the first generated tokens against the target's exact (filtered)
distribution.
"""

import pytest
import torch
from conftest import gpu
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target, write_tiny_draft
from scipy import stats as scipy_stats

import dspark.kernels as K
from dspark.engine import (Drafter, EngineConfig, GenerationInterrupted, Request, SamplingParams,
                           SpeculativeDecoder)
from dspark.model import load_draft

PROMPT = [3, 17, 42, 8, 61, 5]
NEW_TOKENS = 20


def _forward(model, ids, capture_ids=None):
    """Full forward over ``ids`` without any cache: (fp32 logits [T, V], captured hidden [T, m*H])."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hidden = None if capture_ids is None else torch.cat([out.hidden_states[i][0] for i in capture_ids], -1)
    return out.logits[0].float(), hidden


def _greedy(model, prompt, n):
    """transformers' own greedy decoding (``generate()``, ``do_sample=False``; the models here are
    float32 and have no EOS): the lossless oracle, code nobody here wrote."""
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.fixture(scope="module")
def greedy(target):
    return _greedy(target, PROMPT, NEW_TOKENS + 8)


def _decoder(target, tmp_path, *, format="speculators", scheduler="off", threshold=0.0, **draft_options):
    draft = load_draft(write_tiny_draft(target, tmp_path / "draft", format=format, **draft_options))
    return SpeculativeDecoder.from_models(target, draft, scheduler=scheduler, threshold=threshold)


# ---------------------------------------------------------------------------------- greedy, drafts


@pytest.mark.parametrize("format, draft_options, scheduler, threshold", [
    ("speculators", dict(), "off", 0.0),
    ("deepspec", dict(), "threshold", 0.3),
    ("speculators", dict(markov_head_type="gated", sample_from_anchor=False), "sps", 0.2),
    ("deepspec", dict(markov_head_type="rnn", sample_from_anchor=False), "off", 0.0),
    ("speculators", dict(markov_head_type="rnn", block_size=5), "threshold", 0.6),
    ("speculators", dict(draft_vocab_size=48), "sps", 0.0),
    ("speculators", dict(markov_rank=12, layer_types=["sliding_attention"]), "off", 0.0),  # no fused rank
], ids=["spec-vanilla-off", "deepspec-vanilla-threshold", "spec-gated-noanchor-sps", "deepspec-rnn-noanchor-off",
        "spec-rnn-threshold", "spec-reducedvocab-sps", "spec-rank12-off"])
def test_greedy_output_equals_target_greedy(target, greedy, tmp_path, format, draft_options, scheduler, threshold):
    decoder = _decoder(target, tmp_path, format=format, scheduler=scheduler, threshold=threshold, **draft_options)
    result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == greedy[:NEW_TOKENS]
    stats, p = result.stats, decoder.num_drafts
    assert p == draft_options.get("block_size", 4) - (0 if draft_options.get("sample_from_anchor", True) else 1)
    assert min(stats.accept_lengths) < p + 1  # a random draft gets rejected
    assert all(1 <= s <= p for s in stats.scheduled_lengths)
    assert all(1 <= a <= s + 1 for a, s in zip(stats.accept_lengths, stats.scheduled_lengths))
    if scheduler == "off":
        assert stats.scheduled_lengths == _full_rounds(stats, p, NEW_TOKENS)


def _full_rounds(stats, p, new_tokens) -> list[int]:
    """The drafts each round verifies when every draft is scheduled: all P, except that no round
    verifies more than the request can still keep (the last rounds near ``new_tokens``)."""
    lengths, produced = [], stats.prefill_tokens
    for accepted in stats.accept_lengths:
        lengths.append(max(1, min(p, new_tokens - produced - 1)))
        produced += accepted
    return lengths


def test_llama_style_target(tmp_path):
    """Any Hugging Face causal LM with a DynamicCache works as the target, e.g. Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    draft = load_draft(write_tiny_draft(llama, tmp_path / "draft", format="deepspec", markov_head_type="gated"))
    result = SpeculativeDecoder.from_models(llama, draft).generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == _greedy(llama, PROMPT, NEW_TOKENS)


def test_schedulers_trim_the_verified_prefix(target, greedy, tmp_path):
    decoder = _decoder(target, tmp_path, scheduler="threshold", threshold=0.5)
    first = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert first.token_ids == greedy[:NEW_TOKENS]
    assert min(first.stats.scheduled_lengths) < decoder.num_drafts  # the random head is far from sure
    decoder.engine.runner.drafter.threshold = 0.0  # threshold <= 0 verifies everything (kernels.md 3.6)
    stats = decoder.generate(PROMPT, max_new_tokens=8).stats
    assert stats.scheduled_lengths == _full_rounds(stats, decoder.num_drafts, 8)


def test_sts_temperatures_scale_the_confidence_logits(target, greedy):
    config = tiny_draft_config(target.config)
    draft = random_draft(config, 0, target)
    plain = Drafter(draft, scheduler="threshold", threshold=0.4)
    draft.config.sts_temperatures = [1.0]
    identity = Drafter(draft, scheduler="threshold", threshold=0.4)
    draft.config.sts_temperatures = [0.5, 2.0]
    calibrated = Drafter(draft, scheduler="threshold", threshold=0.4)
    hidden = _forward(target, PROMPT, config.capture_layer_ids)[1]
    anchor = torch.tensor([greedy[0]], dtype=torch.int32)
    proposals = []
    block = draft.forward_block(draft.new_cache(), hidden, anchor, len(PROMPT))
    for drafter in (plain, identity, calibrated):
        proposals.append(drafter.propose_rows(block, draft.backbone_logits(block), anchor, None, None))
    assert torch.equal(proposals[0].token_ids, proposals[2].token_ids)
    assert torch.equal(proposals[1].confidence, proposals[0].confidence)  # T = 1 changes nothing
    logit = torch.logit(proposals[1].confidence.double())
    expected = torch.sigmoid(logit / torch.tensor([0.5, 2.0, 2.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(proposals[2].confidence.double(), expected, rtol=0, atol=1e-5)
    decoder = SpeculativeDecoder.from_models(target, draft, scheduler="threshold", threshold=0.4)
    assert decoder.engine.runner.drafter.sts_temperatures is not None
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids == greedy[:NEW_TOKENS]


# ------------------------------------------------------------------------------------- greedy, oracle


def test_known_continuation_as_drafts_is_accepted_in_full(target, greedy):
    """``bench.oracle.OracleEngine`` at acceptance 1 drafts the target's own continuation: every
    verified draft is accepted, the statistics add up (the prefill token plus each round's)."""
    from dspark.bench.oracle import OracleEngine

    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = OracleEngine(target, draft, EngineConfig(max_batch=1, cuda_graphs=False), acceptance=1.0)
    rid = engine.add_request(Request(PROMPT, NEW_TOKENS), greedy + [0] * 8)
    seq = engine.sequences[rid]
    while engine.has_unfinished():
        engine.step()
    stats, p = seq.stats, engine.num_drafts
    assert seq.output_ids == greedy[:NEW_TOKENS]
    assert stats.scheduled_lengths == _full_rounds(stats, p, NEW_TOKENS)
    assert stats.accept_lengths == [s + 1 for s in stats.scheduled_lengths]
    assert stats.acceptance_per_position == [1.0] * p
    assert stats.generated_tokens == len(seq.output_ids) == 1 + sum(stats.committed)
    assert stats.committed[:-1] == stats.accept_lengths[:-1] and stats.committed[-1] <= stats.accept_lengths[-1]


def test_preempted_oracle_requests_keep_their_drafts(target):
    """KV blocks for about one request among three rows: ``OracleEngine``'s requests are preempted
    and admitted again, into other slots, with their known continuations drafted there too (every
    verified draft still accepted), and give the target's greedy tokens; none kept once finished."""
    from dspark.bench.oracle import OracleEngine

    prompts = [PROMPT, PROMPT[::-1], [9, 4, 27, 50, 2, 33]]
    expected = [_greedy(target, p, NEW_TOKENS) for p in prompts]
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    engine = OracleEngine(target, draft, EngineConfig(max_batch=3, max_model_len=32, kv_block_size=4, num_kv_blocks=12,
                                                      cuda_graphs=False, enable_prefix_caching=False), acceptance=1.0)
    ids = [engine.add_request(Request(p, NEW_TOKENS), e + [0] * 8) for p, e in zip(prompts, expected)]
    seqs = [engine.sequences[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_ids for seq in seqs] == expected
    assert engine.metrics.preemptions > 0
    assert engine.metrics.accepted_tokens == engine.metrics.draft_tokens > 0
    assert not engine._oracles


def test_context_limit_ends_the_output(target, greedy, tmp_path):
    """The context (max_model_len) ends the output at "length"; a prompt that fills it is refused."""
    draft = load_draft(write_tiny_draft(target, tmp_path / "draft", format="speculators"))
    decoder = SpeculativeDecoder.from_models(target, draft, max_model_len=len(PROMPT) + 10)
    result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == greedy[:10] and result.finish_reason == "length"
    plain = decoder.engine.plain().generate_requests([Request(PROMPT, NEW_TOKENS)])[0]
    assert plain.token_ids == greedy[:10] and plain.finish_reason == "length"
    with pytest.raises(ValueError, match=r"add_request: the prompt has 16 tokens; the context limit \(max_model_len\) "
                                         r"is 16"):
        decoder.generate(PROMPT + greedy[:10])


def test_generate_requests_runs_each_request_in_order(target, greedy, tmp_path):
    decoder = _decoder(target, tmp_path)
    engine = decoder.engine
    requests = [Request(PROMPT, max_new_tokens=5), Request(torch.tensor(PROMPT), max_new_tokens=9, stop_ids=(greedy[3],)),
                Request(PROMPT, 4, SamplingParams(temperature=0.8, seed=3))]
    seen = []
    results = engine.generate_requests(requests, on_tokens=lambda i, tokens: seen.append(i))
    assert [r.token_ids for r in results[:2]] == [greedy[:5], greedy[:greedy.index(greedy[3]) + 1]]
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    sampled = decoder.generate(PROMPT, max_new_tokens=4, sampling=SamplingParams(temperature=0.8, seed=3))
    assert results[2].token_ids == sampled.token_ids
    assert seen == sorted(seen) and set(seen) == {0, 1, 2}  # max batch 1: one request after another
    # every request is checked before any runs
    calls = []
    with pytest.raises(ValueError, match=r"add_request: prompt_ids holds token id 96"):
        engine.generate_requests([Request(PROMPT), Request([96])], on_tokens=lambda i, t: calls.append(i))
    assert calls == [] and not engine.has_unfinished()
    with pytest.raises(ValueError, match=r"add_request: stop_ids holds token id 500, outside the target's vocabulary"):
        engine.generate_requests([Request(PROMPT, stop_ids=(500,))])
    with pytest.raises(TypeError, match="generate_requests: on_tokens must be callable, got int"):
        engine.generate_requests([Request(PROMPT)], on_tokens=3)
    with pytest.raises(ValueError, match="Request: prompt_ids\\[\\] must be in \\[0, inf\\], got -1"):
        Request([1, -1])
    with pytest.raises(TypeError, match="Request: prompt_ids\\[\\] must be an int, got list"):
        Request([[1, 2], [3]])


def test_ctrl_c_keeps_the_partial_results(target, greedy, tmp_path):
    decoder = _decoder(target, tmp_path)

    def interrupt(i, tokens):
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(GenerationInterrupted) as info:
        decoder.engine.generate_requests([Request(PROMPT, max_new_tokens=6), Request(PROMPT, max_new_tokens=6)],
                                         on_tokens=interrupt)
    done, partial = info.value.results
    assert done.token_ids == greedy[:6] and done.finish_reason == "length"
    assert partial.token_ids == greedy[:1] and partial.finish_reason == "interrupted"
    assert isinstance(info.value, KeyboardInterrupt) and not decoder.engine.has_unfinished()
    assert decoder.generate(PROMPT, max_new_tokens=6).token_ids == greedy[:6]  # the engine goes on


@gpu
@pytest.mark.parametrize("head, scheduler", [("vanilla", "off"), ("vanilla", "sps"), ("rnn", "threshold")])
def test_greedy_on_cuda_equals_target_greedy(target, greedy, head, scheduler):
    """The CUDA path (Triton kernels by default) with a bfloat16 draft and an fp32 target."""
    config = tiny_draft_config(target.config, markov_head_type=head)
    draft = random_draft(config, 0, target).to("cuda", torch.bfloat16)
    cuda_target = tiny_qwen3_target().to("cuda")
    decoder = SpeculativeDecoder.from_models(cuda_target, draft, scheduler=scheduler, threshold=0.3)
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids == greedy[:NEW_TOKENS]
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=5)
    first = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling)
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling).token_ids == first.token_ids


def test_fp32_drafts_run_their_heads_in_fp32(target):
    """The head kernels take half-precision weights; an fp32 draft drafts with its own fp32 math
    (no bf16 copies of W1/W2 or the confidence head that could flip near-ties)."""
    config = tiny_draft_config(target.config, markov_rank=16)  # a rank the fused greedy kernel takes
    draft = random_draft(config, 0, target)
    drafter = Drafter(draft, scheduler="threshold", threshold=0.0)
    assert not drafter.kernel_markov and not drafter.kernel_confidence
    context = _forward(target, PROMPT, config.capture_layer_ids)[1]
    anchor = torch.tensor([7], dtype=torch.int32)
    hidden = draft.forward_block(draft.new_cache(), context, 7, len(PROMPT))
    proposal = drafter.propose_rows(hidden, draft.backbone_logits(hidden), anchor, None, None)
    logits, prev, state, chain = draft.backbone_logits(hidden), anchor, None, []
    for k in range(config.num_draft_tokens):
        bias, state = draft.markov_bias(hidden[k:k + 1], prev, state)
        prev = (logits[k:k + 1] + bias).argmax(-1)
        chain.append(int(prev))
    assert proposal.token_ids[0].tolist() == chain
    previous = torch.tensor([[7] + chain[:-1]])
    assert torch.equal(proposal.confidence, torch.sigmoid(draft.confidence_logits(hidden[None], previous)))


@pytest.mark.parametrize("head, scheduler", [("vanilla", "off"), ("vanilla", "sps"), ("rnn", "threshold")])
def test_bfloat16_drafts_draft_through_the_kernels(target, greedy, head, scheduler):
    config = tiny_draft_config(target.config, markov_head_type=head, markov_rank=16)
    draft = random_draft(config, 0, target).to(torch.bfloat16)
    decoder = SpeculativeDecoder.from_models(target, draft, scheduler=scheduler, threshold=0.3)
    assert decoder.engine.runner.drafter.kernel_markov == (head == "vanilla")
    assert decoder.engine.runner.drafter.kernel_confidence == (scheduler != "off")
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids == greedy[:NEW_TOKENS]
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=5)
    first = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling)
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling).token_ids == first.token_ids


def test_negative_top_k_means_no_filter(target, tmp_path):
    """vLLM's ``top_k=-1``: no top-k filter, as ``top_k=0``."""
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(temperature=1.0, top_k=-5).top_k == 0
    decoder = _decoder(target, tmp_path)
    runs = [decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(1.0, top_k=k, seed=2)).token_ids
            for k in (0, -1)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------- stopping, streaming


def test_eos_and_max_new_tokens_stop_generation(target, greedy, tmp_path):
    decoder = _decoder(target, tmp_path)
    k = next(i for i in range(5, NEW_TOKENS) if greedy[i] not in greedy[:i])
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=greedy[k]).token_ids == greedy[:k + 1]
    unused = next(t for t in range(target.config.vocab_size) if t not in greedy[:k + 1])
    result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=[unused, greedy[k]])
    assert result.token_ids == greedy[:k + 1] and result.finish_reason == "stop"
    for n in (0, 1, 2, 7):
        result = decoder.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == greedy[:n] and result.stats.generated_tokens == n
        assert result.finish_reason == "length"
    assert decoder.generate(PROMPT, max_new_tokens=1).stats.rounds == 0
    # a callback returning True ends the output after the tokens it was given
    chunks = []
    result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, on_tokens=lambda t: chunks.append(t) or len(chunks) == 2)
    assert result.token_ids == chunks[0] + chunks[1] == greedy[:len(result.token_ids)]
    assert result.finish_reason == "stop"


def test_streaming_callback_and_sampled_reproducibility(target, tmp_path):
    decoder = _decoder(target, tmp_path)
    chunks = []
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling, on_tokens=chunks.append)
    assert [t for chunk in chunks for t in chunk] == first.token_ids and len(first.token_ids) == NEW_TOKENS
    assert len(chunks) == first.stats.rounds + 1
    assert decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling).token_ids == first.token_ids
    seeds = {tuple(decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(1.0, seed=s)).token_ids)
             for s in range(4)}
    assert len(seeds) > 1


def test_bad_requests_raise_clear_errors(target, tmp_path):
    decoder = _decoder(target, tmp_path)
    with pytest.raises(ValueError, match=r"add_request: prompt_ids holds token id 96, outside the target's vocabulary "
                                         r"\[0, 96\)"):
        decoder.generate([1, 96])
    with pytest.raises(TypeError, match="Request: prompt_ids must be a non-empty"):
        decoder.generate([])
    with pytest.raises(ValueError, match=r"Request: max_new_tokens must be in \[0, inf\], got -1"):
        decoder.generate(PROMPT, max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"generate: eos_token_id must be in \[0, 95\], got 96"):
        decoder.generate(PROMPT, eos_token_id=96)
    with pytest.raises(TypeError, match="generate: eos_token_id\\[\\] must be an int, got str"):
        decoder.generate(PROMPT, eos_token_id=["2"])
    with pytest.raises(TypeError, match="generate: on_tokens must be callable, got list"):
        decoder.generate(PROMPT, on_tokens=[])
    with pytest.raises(TypeError, match="Request: prompt_ids must be a non-empty sequence of token ids .*, got str"):
        decoder.generate("hello")
    with pytest.raises(ValueError, match="SamplingParams: top_p must be in"):
        SamplingParams(temperature=1.0, top_p=0.0)
    no_head = load_draft(write_tiny_draft(target, tmp_path / "nohead", format="speculators", confidence=False))
    with pytest.raises(ValueError, match="Drafter: scheduler 'sps' needs a confidence head"):
        SpeculativeDecoder.from_models(target, no_head, scheduler="sps")
    with pytest.raises(ValueError, match="EngineConfig: scheduler must be one of"):
        SpeculativeDecoder.from_models(target, no_head, scheduler="fast")
    other = tiny_qwen3_target(vocab_size=64)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder.from_models(other, no_head)


# --------------------------------------------------------------------------- sampled distribution (helpers)


def _fit(samples, probabilities):
    """(chi-square p-value over bins expecting >= 5, total-variation distance)."""
    counts = torch.bincount(samples, minlength=probabilities.numel()).double()
    expected = probabilities.double() * samples.numel()
    keep = expected >= 5
    scaled = expected[keep] * counts[keep].sum() / expected[keep].sum()
    p_value = scipy_stats.chisquare(counts[keep].numpy(), scaled.numpy()).pvalue
    return p_value, 0.5 * float((counts / samples.numel() - probabilities.double()).abs().sum())


def assert_first_tokens_follow_the_target(out, target, prompt, top_k):
    """Generated tokens ``out`` ``[runs, >=3]`` (temperature 1, ``top_k``): each of the first three
    positions follows the exact filtered target distribution, enumerated over the earlier tokens
    (chi-square p > 1e-3, TV < 0.01)."""
    vocab = target.config.vocab_size

    def probs(sequences):  # the filtered target distribution after each sequence
        logits = torch.stack([_forward(target, s)[0][-1] for s in sequences])
        return K.logits_to_probabilities(logits, 1.0, top_k)

    first = probs([prompt])[0]
    second = probs([prompt + [a] for a in range(vocab)])
    third = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    joint = first[:, None, None] * second[:, :, None] * third
    for position, exact in ((0, first), (1, joint.sum((0, 2))), (2, joint.sum((0, 1)))):
        p_value, tv = _fit(out[:, position], exact)
        assert p_value > 1e-3 and tv < 0.01, (position, p_value, tv)
