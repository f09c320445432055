"""Prompt log-probabilities in the engine (``Request.prompt_logprobs``, what ``echo`` and lm-eval's
loglikelihood requests read).

Oracle: one plain transformers forward of the target over the prompt (float32, CPU): position i > 0
holds log p(prompt[i] | prompt[:i]) of its log-softmax, its rank and the k most likely tokens;
position 0 None. The same whatever splits the prompt into chunks (a step budget far below the
prompt's length, other requests running meanwhile) and for a target running its own modeling code
(``HFTarget``, a sliding window shorter than the prompt); the other requests of the batch and the
request's own tokens are those of a run without it; ``max_new_tokens`` 0 scores the prompt alone.
"""

import copy

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = [(7 * i + 3) % 96 for i in range(70)]  # far beyond a step's chunk budget below
OTHERS = [[3, 17, 42, 8, 61, 5], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18]]
NEW, K = 6, 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = 5e-5  # float32 rounding apart over a few layers (3e-6 seen); an off-by-one position is off by units


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


def _engine(target, budget=None, draft=True):
    drafter = random_draft(tiny_draft_config(target.config), 0, target).to(target.device) if draft else None
    return LLMEngine(target, drafter, EngineConfig(max_batch=3, max_num_batched_tokens=budget))


def _run(engine, requests):
    """(output tokens, prompt_logprobs of the first output, outputs) per request, in order."""
    outputs = {}
    results = engine.generate(requests, on_output=lambda out: outputs.setdefault(out.request_id, []).append(out))
    ids = sorted(outputs)
    return [(r.token_ids, outputs[i][0].prompt_logprobs, outputs[i]) for r, i in zip(results, ids)]


def _expected(model, prompt):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt], device=model.device)).logits[0].float(), -1).cpu()


def assert_prompt_logprobs(model, prompt, scored, k=K):
    logp = _expected(model, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        row, entry = logp[i - 1], scored[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=TOL)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        values, index = row.topk(k)
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [t for t, _ in entry.top] == index.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_of_a_split_prompt_in_a_batch_equal_the_targets_forward(target, device):
    """70 prompt tokens through steps of 3 x 8 verify tokens + a few chunk tokens: many chunks, each
    scored on its own; the batch's other requests and the request's own tokens are unchanged (on
    CUDA: the steps replay their graphs, the scoring forwards run eagerly beside them)."""
    target = copy.deepcopy(target).to(device)
    engine = _engine(target, budget=3 * 8 + 5)
    requests = [Request(OTHERS[0], NEW), Request(LONG, NEW, prompt_logprobs=K), Request(OTHERS[1], NEW)]
    runs = _run(engine, requests)
    assert_prompt_logprobs(target, LONG, runs[1][1])
    assert all(run[1] is None for run in (runs[0], runs[2]))  # not asked for
    assert sum(out.prompt_logprobs is not None for out in runs[1][2]) == 1  # in the first output only
    plain = _run(_engine(target, budget=3 * 8 + 5),
                 [Request(OTHERS[0], NEW), Request(LONG, NEW), Request(OTHERS[1], NEW)])
    assert [run[0] for run in runs] == [run[0] for run in plain]
    whole = _run(_engine(target), [Request(LONG, NEW, prompt_logprobs=K)])[0][1]  # one chunk
    for split, one in zip(runs[1][1][1:], whole[1:]):
        assert split.logprob == pytest.approx(one.logprob, abs=TOL)


def test_max_new_tokens_zero_only_scores_the_prompt(target):
    engine = _engine(target, draft=False)
    (tokens, scored, outputs), = _run(engine, [Request(LONG[:20], 0, prompt_logprobs=0)])
    assert tokens == [] and len(outputs) == 1
    assert outputs[0].finished and outputs[0].finish_reason == "length" and outputs[0].new_token_ids == []
    assert_prompt_logprobs(target, LONG[:20], scored, k=0)
    assert all(entry.top == [] for entry in scored[1:])
    assert not engine.has_unfinished() and len(engine.scheduler.free_slots) == 3


def test_prompt_logprobs_of_a_target_running_its_own_modeling_code():
    """``HFTarget`` (Mistral, a sliding window of 5 tokens under a 40-token prompt split in chunks)."""
    import transformers as t

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = t.MistralForCausalLM(t.MistralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=5, max_position_embeddings=256,
            initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    engine = LLMEngine(model, None, EngineConfig(max_batch=2, max_num_batched_tokens=16))
    (_, scored, _), _ = _run(engine, [Request(LONG[:40], 2, prompt_logprobs=1), Request(OTHERS[0], 4)])
    assert_prompt_logprobs(model, LONG[:40], scored, k=1)


def test_a_failed_scoring_fails_its_request_alone(target, monkeypatch):
    """A prompt whose scoring forward raises ends with ``"error"`` naming the cause; the request
    scored beside it and the one that scores nothing run as without it."""
    engine = _engine(target, budget=3 * 8 + 5)
    clean = _run(_engine(target, budget=3 * 8 + 5), [Request(OTHERS[0], NEW), Request(LONG, NEW, prompt_logprobs=1)])
    poisoned, forward = [9, 9, 9, 9], engine.runner.prompt_logits

    def prompt_logits(slot, token_ids, start):
        if token_ids[:4] == poisoned:
            raise RuntimeError("scoring forward broke")
        return forward(slot, token_ids, start)

    monkeypatch.setattr(engine.runner, "prompt_logits", prompt_logits)
    runs = _run(engine, [Request(OTHERS[0], NEW), Request(poisoned + LONG[:30], NEW, prompt_logprobs=0),
                         Request(LONG, NEW, prompt_logprobs=1)])
    failed = runs[1][2][-1]
    assert failed.finish_reason == "error" and "scoring forward broke" in failed.error and runs[1][0] == []
    assert [runs[0][0], runs[2][0]] == [run[0] for run in clean]
    assert [lp.logprob for lp in runs[2][1][1:]] == [lp.logprob for lp in clean[1][1][1:]]


def test_a_one_token_prompt_has_nothing_to_score(target):
    (tokens, scored, _), = _run(_engine(target, draft=False), [Request([5], 3, prompt_logprobs=2)])
    assert scored == [None] and len(tokens) == 3


@pytest.mark.parametrize("value, error", [(-1, ValueError), (21, ValueError), ("2", TypeError), (1.0, TypeError)])
def test_bad_prompt_logprobs_are_refused_by_name(value, error):
    with pytest.raises(error, match="prompt_logprobs must be"):
        Request([1, 2], 1, prompt_logprobs=value)
