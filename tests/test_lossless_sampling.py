"""Statistical losslessness of the sampled path (testing.md §5), on the reference and the Triton backend.

Every check draws N independent rows in one batched call, with uniforms from ``fill_uniforms`` and
fixed seeds, and asserts for each emitted position a chi-square goodness-of-fit p-value > 1e-3 (bins
with expected count >= 5, the rest pooled) and a total-variation distance < 0.01, with N sized so
that an exact sampler's expected TV, about 0.4*sqrt(V/N), is <= 0.005. A token outside the target's
support is an immediate failure. A deliberately broken verifier must fail the same checks.

Through the whole engine, every scheduler and tree mode: 128 tokens per request over dozens of
rounds from a target whose exact distribution is known (a chain: the next token depends on the last
one only), the transitions checked the same way; a verifier off by 5 % must fail there too. With a
request's every filter (logit_bias, temperature, min_p, top-k, top-p), the chain is transformers'
warpers applied to the target's logits, and the kernels' mass-clipped top-p must fail the check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, INTERPRETER_WARNINGS, gpu, requires_triton
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from statistics_cases import (assert_distribution, assert_rate, check_distribution, check_transitions, draws_for,
                              forced_prefix_case, uniforms)
from test_request_sampling import transformers_probabilities

import dspark.kernels as K
import sampling_cases as cases
from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.engine.schedulers import SPSCostTable

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reference_backend"), INTERPRETER_WARNINGS]
I32 = torch.int32


# ------------------------------------------------------------------------------ one verification round


CHUNK = 1 << 17  # rows per call, bounding memory (V = 64 needs 2^19 draws)


def verify_rounds(target, draft, rows: int, seed: int, draft_shift: int = 0):
    """``rows`` independent rounds (in chunks): drafts drawn from ``draft``, verified against
    ``target`` with ``draft_probabilities`` rolled by ``draft_shift`` positions (0 = correct).
    Returns (accepted [rows, P+1], accept_length [rows])."""
    width = draft.shape[0]
    results = []
    for chunk in range(0, rows, CHUNK):
        n = min(CHUNK, rows - chunk)
        tokens = torch.multinomial(draft, n, replacement=True, generator=cases.generator(seed + chunk)).t()
        results.append(K.probabilistic_accept(
            target.expand(n, -1, -1), draft.roll(-draft_shift, 0).expand(n, -1, -1),
            tokens.to(torch.int32).contiguous(), torch.full((n,), width, dtype=torch.int32),
            uniforms(n, 2 * width + 1, offset=(seed + chunk) * (2 * width + 1)), width))
    return torch.cat([a for a, _ in results]), torch.cat([n for _, n in results])


@pytest.mark.parametrize("width, vocab", [(1, 64), (3, 16), (7, 8)])
def test_every_emitted_position_follows_the_target(width, vocab):
    rows = draws_for(vocab)
    for position in range(width + 1):
        seed = 1000 * width + position
        target, draft = forced_prefix_case(width, position, vocab, seed)
        accepted, lengths = verify_rounds(target, draft, rows, seed * rows)
        assert bool((lengths > position).all()), "an always-acceptable draft was rejected"
        assert_distribution(accepted[:, position], target[position], f"P={width}, emitted position {position}")
        if position < width:
            closed_form = float(torch.minimum(target[position], draft[position]).double().sum())
            assert_rate(lengths > position + 1, closed_form, f"P={width}, acceptance at {position}")


def test_a_verifier_using_the_wrong_draft_row_fails_the_checks():
    """The checks have teeth: an off-by-one in the draft rows (q of position s+1 used at s) is caught."""
    target, draft = forced_prefix_case(3, 0, 16, seed=7)
    accepted, _ = verify_rounds(target, draft, draws_for(16), seed=7, draft_shift=1)
    assert check_distribution(accepted[:, 0], target[0]) is not None


# ------------------------------------------------------------------------------ many rounds of a Markov chain


def test_speculative_chain_is_the_target_chain():
    """Whole decoding: drafts from ``vanilla_markov_sample`` (context-dependent q with top-k zeros),
    a bigram target filtered by top-k and top-p, ``probabilistic_accept``, accepted tokens appended,
    the last one the next anchor. Each emitted sequence must be a path of the target chain: the
    marginal of every absolute position j equals ``pi_0 P^j`` and every transition follows the
    target's row of the previous token."""
    vocab, width, rank, horizon = 8, 3, 4, 6
    rows = draws_for(vocab)
    g = cases.generator(3)
    target_table = K.logits_to_probabilities(torch.randn(vocab, vocab, generator=g) * 2, 0.8, top_k=6, top_p=0.9)
    backbone = (torch.randn(1, width, vocab, generator=g) * 1.5).expand(rows, -1, -1)
    w1 = (torch.randn(vocab, rank, generator=g) * 0.7).half()
    w2 = (torch.randn(vocab, rank, generator=g) * 0.7).half()

    sequences = torch.zeros(rows, horizon * (width + 1), dtype=torch.long)
    length = torch.zeros(rows, dtype=torch.long)
    anchor = torch.zeros(rows, dtype=torch.int32)  # x0 = token 0
    for round_index in range(horizon):  # every round emits >= 1 token
        offset = round_index * rows * (3 * width + 1)  # NVIDIA's per-round uniform budget layout
        tokens, draft = K.vanilla_markov_sample(backbone, w1, w2, anchor, uniforms(rows, width, offset), 1.0, top_k=5)
        verify = torch.cat([anchor[:, None], tokens], 1).long()
        accepted, emitted = K.probabilistic_accept(
            target_table[verify], draft, tokens, torch.full((rows,), width, dtype=torch.int32),
            uniforms(rows, 2 * width + 1, offset + rows * width), width)
        keep = torch.arange(width + 1) < emitted[:, None].long()
        row_index = torch.arange(rows)[:, None].expand(-1, width + 1)
        sequences[row_index[keep], (length[:, None] + torch.arange(width + 1))[keep]] = accepted[keep].long()
        length += emitted.long()
        anchor = sequences[torch.arange(rows), length - 1].to(torch.int32)
    assert bool((length >= horizon).all())

    marginal = target_table[0].double()
    for position in range(horizon):
        assert_distribution(sequences[:, position], marginal, f"absolute position {position}")
        marginal = marginal @ target_table.double()
    problem = check_transitions(sequences[:, :horizon], target_table)
    assert problem is None, problem


# ------------------------------------------------------------------------------ draft-side samplers


def test_vanilla_markov_sample_draws_from_its_distributions():
    vocab, width = 16, 3
    rows = draws_for(vocab)
    case = cases.markov_sample_inputs(1, width, vocab, 8, seed=5)
    case["backbone_logits"] = case["backbone_logits"].expand(rows, -1, -1)
    case["first_prev_tokens"] = torch.randint(0, vocab, (rows,), generator=cases.generator(6), dtype=torch.int32)
    case["proposal_uniforms"] = uniforms(rows, width, offset=11)
    tokens, probs = K.vanilla_markov_sample(**case, temperature=0.9, top_p=0.8)
    for step in range(width):
        assert_distribution(tokens[:, step], probs[:, step].double().sum(0), f"draft step {step}")
        assert bool((probs[:, step].gather(1, tokens[:, step : step + 1].long()) > 0).all())


def test_sample_top_k_rows_and_store_draws_from_its_distributions():
    vocab, k = 16, 6
    rows = draws_for(vocab)
    case = cases.top_k_step_inputs(rows, 2, k, vocab, seed=8)
    case["proposal_uniforms"] = uniforms(rows, 2, offset=0)
    K.sample_top_k_rows_and_store(**case, step=1, temperature=0.7)
    mass = torch.zeros(vocab, dtype=torch.float64).index_add_(
        0, case["top_k_indices"].flatten().long(), case["draft_top_k_probabilities"][:, 1].flatten().double())
    assert_distribution(case["draft_token_ids"][:, 1], mass, "sparse draft step")


# ------------------------------------------------------------------------------ Triton backend


def triton_verify_once(target, draft, rows, seed):
    """``rows`` independent rounds in ONE call: drafts drawn from ``draft`` [P, V], verified against
    ``target`` [P+1, V] on the Triton backend; returns (accepted, accept_length)."""
    width = draft.shape[0]
    tokens = torch.multinomial(draft, rows, replacement=True, generator=cases.generator(seed)).t()
    u = uniforms(rows, 2 * width + 1, offset=seed * (2 * width + 1)).to(DEVICE)  # built on the CPU
    with K.use_backend("triton"):
        return K.probabilistic_accept(
            target.to(DEVICE).expand(rows, -1, -1), draft.to(DEVICE).expand(rows, -1, -1),
            tokens.to(I32).contiguous().to(DEVICE), torch.full((rows,), width, dtype=I32, device=DEVICE), u, width)


@requires_triton
@pytest.mark.parametrize("width", [1, 3])
def test_triton_every_emitted_position_follows_the_target(width):
    vocab = 16
    rows = draws_for(vocab)  # 2^17 >= 1e5 draws, one call per position
    for position in range(width + 1):
        seed = 100 * width + position
        target, draft = forced_prefix_case(width, position, vocab, seed)
        accepted, lengths = triton_verify_once(target, draft, rows, seed)
        assert bool((lengths > position).all()), "an always-acceptable draft was rejected"
        assert_distribution(accepted[:, position].cpu(), target[position], f"P={width}, position {position}")
        if position < width:
            closed_form = float(torch.minimum(target[position], draft[position]).double().sum())
            assert_rate((lengths > position + 1).cpu(), closed_form, f"P={width}, acceptance at {position}")


@requires_triton
def test_triton_dense_draws_follow_their_rows():
    vocab = 16
    rows = draws_for(vocab)
    probs = cases.random_distributions((1,), vocab, zero_fraction=0.35, seed=9)
    u = uniforms(rows, 1, offset=77).to(DEVICE)
    tokens = torch.zeros(rows, 1, dtype=I32, device=DEVICE)
    with K.use_backend("triton"):
        K.sample_probability_rows(probs.to(DEVICE).expand(rows, -1), u, tokens, 0)
    assert_distribution(tokens[:, 0].cpu(), probs[0], "sample_probability_rows")


@requires_triton
@gpu
def test_real_vocab_accept_is_lossless():
    """1e5 verification rounds at V = 151936 (support scattered over the vocabulary, tail tile included)."""
    vocab, rows, calls = 151936, 10_000, 10
    support = torch.tensor([0, 17, 4095, 4096, 70_001, 99_999, 123_456, 151_000, 151_935])
    g = cases.generator(12)
    target, draft = torch.zeros(2, vocab), torch.zeros(1, vocab)
    target[:, support] = torch.rand(2, len(support), generator=g) + 0.1
    target[0, support[1]] = 0.0
    draft[0, support[:-1]] = torch.rand(len(support) - 1, generator=g) + 0.1
    draft[0, 5] = 0.3  # draft mass outside the target's support
    target, draft = target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)
    results = [triton_verify_once(target, draft, rows, seed=50 + i) for i in range(calls)]
    accepted = torch.cat([a for a, _ in results]).cpu()
    lengths = torch.cat([n for _, n in results]).cpu()
    assert_distribution(accepted[:, 0], target[0], "first emitted token")
    assert_rate(lengths > 1, float(torch.minimum(target[0], draft[0]).double().sum()), "acceptance")


# ------------------------------------------------------------------------------ many rounds through the engine

ENGINE_VOCAB, ENGINE_TOP_K = 4, 3  # a zero in every row of the chain: a forbidden transition is caught
# 65 536 transitions: an exact engine's TV ~ 0.4 * sqrt(12 / N) = 0.005. The check counts transitions
# whatever the rows' length, so its power is that of N; 512 rows of 128 (dozens of rounds each) take
# some 15 % less time than 256 rows of 256 (attention over shorter lines, fuller steps)
ENGINE_ROWS, ENGINE_TOKENS = 512, 128
ENGINE_MODES = {  # block size 4: P = 4 drafts, a tree up to 4 deep
    "off": dict(),
    "threshold": dict(scheduler="threshold", threshold=0.3),  # verifies 1 to 3 drafts
    "sps": dict(scheduler="sps", threshold=0.7),  # 1 or 2
    "cost": dict(scheduler="cost", cost_table=SPSCostTable((1, 64), (1.0, 1.2))),  # 0 (plain rounds) to 4
    "tree": dict(draft_top_k=2),
}


def bigram_target(vocab: int):
    """A Qwen3 whose next token depends on the last token only (its attention outputs zeroed), and
    its logits after each token ``[V, V]``."""
    target = tiny_qwen3_target(vocab_size=vocab, num_layers=2)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        logits = target(torch.arange(vocab)[:, None]).logits[:, 0]
    return target, logits


@pytest.fixture(scope="module")
def bigram_pair(one_thread):
    """A bigram target (``bigram_target``) and a random draft (context-dependent q). Returns
    (target, draft, chain): the chain ``[V, V]`` is the target's filtered distribution after each
    token, computed from the target itself, so that the exact distribution of a whole output is known."""
    target, logits = bigram_target(ENGINE_VOCAB)
    draft = random_draft(tiny_draft_config(target.config, layer_types=["full_attention"]), 0, target)
    return target, draft, K.logits_to_probabilities(logits, 1.0, top_k=ENGINE_TOP_K)


def engine_sequences(pair, mode: str, settings=None) -> torch.Tensor:
    """``ENGINE_ROWS`` seeded requests of ``ENGINE_TOKENS`` sampled tokens each, in one engine
    batch, with ``settings`` (``SamplingParams`` fields; default temperature 1, ``ENGINE_TOP_K``);
    returns each row's prompt token followed by its output."""
    target, draft = pair[:2]
    vocab = target.config.vocab_size
    settings = settings or dict(temperature=1.0, top_k=ENGINE_TOP_K)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=ENGINE_ROWS, **ENGINE_MODES[mode]))
    prompts = [s % vocab for s in range(ENGINE_ROWS)]
    sampling = [SamplingParams(**settings, seed=s) for s in range(ENGINE_ROWS)]
    results = engine.generate([Request([p], ENGINE_TOKENS, s, stop_ids=[], ignore_eos=True)
                               for p, s in zip(prompts, sampling)])
    return torch.tensor([[p] + r.token_ids for p, r in zip(prompts, results)])


def nudged(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` off by 5 %: even token ids up, odd ones down, renormalised."""
    weights = probs * (1 + 0.05 * (1 - 2 * (torch.arange(probs.shape[-1], device=probs.device) % 2)))
    return weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_engine_outputs_are_the_target_chain_over_many_rounds(bigram_pair, mode):
    """Every emitted token -- accepted drafts, residual draws and bonus tokens of every round, plain
    rounds included -- follows the target's distribution given everything before it: here its row
    of the chain, whatever the draft's context-dependent q and the schedulers' verify lengths."""
    problem = check_transitions(engine_sequences(bigram_pair, mode), bigram_pair[2])
    assert problem is None, f"{mode}: {problem}"


@pytest.mark.parametrize("mode", ["threshold", "cost", "tree"])
def test_the_engine_check_catches_a_five_percent_error(bigram_pair, mode, monkeypatch):
    """The check above has teeth: the verifier given q off by 5 % (the chain), or the target's
    probabilities off by 5 % (the tree, which tests the target's own candidates), fails it. A wrong q
    moves only the tokens of verified drafts; the chain modes kept are those where the check catches
    it by the least (chi-square p about 3e-9 under "threshold", 4e-10 under "cost" with its plain
    rounds; 1e-12 under "sps", 2e-21 under "off", which verifies every draft), so it catches it in
    every mode; "tree" is the other kernel (p about 4e-35)."""
    accept, tree_accept = K.probabilistic_accept, K.sampled_tree_accept
    monkeypatch.setattr(K, "probabilistic_accept", lambda p, q, *args, **kw: accept(p, nudged(q), *args, **kw))
    monkeypatch.setattr(K, "sampled_tree_accept", lambda p, *args, **kw: tree_accept(nudged(p), *args, **kw))
    assert check_transitions(engine_sequences(bigram_pair, mode), bigram_pair[2]) is not None


# every filter binds after some token: min_p, top-k, top-p and the bias each change the chain
WARPED_VOCAB = 6
WARPED = dict(temperature=0.8, top_k=4, top_p=0.6, min_p=0.2, logit_bias={1: 0.7, 3: -0.5})


@pytest.fixture(scope="module")
def warped_pair(one_thread):
    """A bigram target and a random draft; the chain is transformers' warpers (vLLM's order:
    ``test_request_sampling.transformers_warpers``) on the target's logits after each token; the
    negative control the kernels' mass-clipped top-p after the same bias, temperature, min_p and top-k.
    Returns (target, draft, chain, mass-clipped chain)."""
    target, logits = bigram_target(WARPED_VOCAB)
    draft = random_draft(tiny_draft_config(target.config, layer_types=["full_attention"]), 0, target)
    chain = transformers_probabilities(logits, **WARPED)
    biased = logits.clone()
    for token, bias in WARPED["logit_bias"].items():
        biased[:, token] += bias
    scaled = biased / WARPED["temperature"]
    probs = scaled.softmax(-1)
    scaled = scaled.masked_fill(probs < WARPED["min_p"] * probs.amax(-1, keepdim=True), -float("inf"))
    clipped = K.logits_to_probabilities(scaled, 1.0, WARPED["top_k"], WARPED["top_p"])
    return target, draft, chain, clipped


@pytest.mark.parametrize("mode", ["off", "tree"])
def test_engine_outputs_follow_transformers_warpers(warped_pair, mode):
    """Speculative (chain and tree) sampling with logit_bias, temperature, min_p, top-k and top-p:
    every transition follows transformers' warpers on the target's logits, and not the kernels'
    mass-clipped nucleus (the old request semantics; the check has teeth)."""
    sequences = engine_sequences(warped_pair, mode, WARPED)
    problem = check_transitions(sequences, warped_pair[2])
    assert problem is None, f"{mode}: {problem}"
    assert check_transitions(sequences, warped_pair[3]) is not None
