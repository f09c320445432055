"""``echo``, ``max_tokens`` 0 and ``prompt_logprobs`` on ``dspark serve`` (the demo pair, float32 on
the CPU, a real server on a loopback port): what lm-eval's loglikelihood requests read.

Oracles: a plain transformers forward of the target over the prompt (its log-softmax at each prompt
position) and lm-eval's own parser of the response (``LocalCompletionsAPI.parse_logprobs``). The
prompts are longer than a step's chunk budget (scored chunk by chunk) and run beside a long greedy
stream, whose tokens stay those of the engine alone.
"""

import threading

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, TIMEOUT, ServerThread, pair, tokenizer  # noqa: E402,F401 (fixtures)

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import read_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4  # float32 kernels against transformers' (1e-5 seen); a shifted position is off by units
LONG = 40  # tokens of the stream running beside the scored prompts
BUDGET = 4 * 8 + 8  # tokens per step: rows of 8 verify tokens and a short chunk (the prompts take several)


@pytest.fixture(scope="module")
def model(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def texts(pair):
    return [r["text"][:200] for r in read_prompts(str(pair.prompts))[:3]]


@pytest.fixture(scope="module")
def served(pair, tokenizer, texts):
    """(server, the long stream's request body, its tokens from the engine alone before it serves)."""
    engine = LLMEngine(str(pair.target), str(pair.draft),
                       EngineConfig(max_batch=4, max_model_len=256, max_num_batched_tokens=BUDGET))
    assert engine.target.dtype == torch.float32
    ids = tokenizer(texts[1])["input_ids"]
    stream = {"prompt": ids, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
              "stream": True}
    alone = engine.generate([Request(ids, LONG, SamplingParams(), ignore_eos=True)])[0].token_ids
    with ServerThread(create_app(engine, tokenizer, MODEL)) as server:
        yield server, stream, alone


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=TIMEOUT) as c:
        yield c


def _post(http, body, url="/v1/completions"):
    r = http.post(url, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _log_softmax(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_logprobs_are_the_targets_and_lm_evals_parser_reads_them(served, http, model, tokenizer, texts):
    """lm-eval's loglikelihood request (token-id prompt, echo, logprobs 1, max_tokens 1) beside a long
    greedy stream: every prompt token's logprob is the target's, the generated one's too, and
    lm-eval's parser gets the continuation's loglikelihood and greediness."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    import json

    server, stream, alone = served
    streamed, started = [], threading.Event()

    def run_stream():
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c, c.stream("POST", "/v1/completions",
                                                                               json=stream) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                    started.set()

    thread = threading.Thread(target=run_stream)
    thread.start()
    assert started.wait(TIMEOUT)
    ids = tokenizer(texts[0])["input_ids"]
    ctxlen = len(ids) - 5  # the last 5 tokens: the continuation lm-eval scores
    out = _post(http, {"model": MODEL, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                       "temperature": 0, "seed": 1234})
    during = len(streamed)  # the stream's tokens when the scored request ended
    thread.join(TIMEOUT)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(ids) > BUDGET and len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the new token
    assert choice["text"].startswith(tokenizer.decode(ids)) and choice["finish_reason"] == "length"
    assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = _log_softmax(model, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=TOL)
        top = lp["top_logprobs"][i]
        assert max(top.values()) == pytest.approx(expected[i - 1].max().item(), abs=TOL)
    assert lp["token_logprobs"][-1] == pytest.approx(expected[-1].max().item(), abs=TOL)  # greedy: the argmax
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    (loglikelihood, greedy), = LocalCompletionsAPI.parse_logprobs(outputs=out, tokens=[ids], ctxlens=[ctxlen])
    rows = expected[ctxlen - 1:-1]
    assert loglikelihood == pytest.approx(rows.gather(1, torch.tensor(ids[ctxlen:])[:, None]).sum().item(), abs=TOL)
    assert greedy == (rows.argmax(-1).tolist() == ids[ctxlen:])
    assert during < LONG and streamed == alone  # the stream ran beside it, unchanged


def test_max_tokens_zero_with_echo_only_scores_the_prompt(http, model, tokenizer, texts):
    text = texts[2]
    ids = tokenizer(text)["input_ids"]
    out = _post(http, {"prompt": text, "echo": True, "max_tokens": 0, "logprobs": 0})
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    # a request that scores its prompt runs all of it: nothing comes from the prefix cache (vLLM's rule)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                            "prompt_tokens_details": {"cached_tokens": 0}}
    expected = _log_softmax(model, ids)
    scored = choice["logprobs"]["token_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert scored[1:] == pytest.approx([expected[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOL)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # the token itself (k = 0)


def test_prompt_logprobs_in_vllms_shape(http, model, tokenizer, texts):
    """``prompt_logprobs: 2``: per position, by token id, the prompt's token with its rank and the two
    most likely (ranks 1, 2); the text is the completion alone (no echo)."""
    ids = tokenizer(texts[0])["input_ids"][:30]
    choice = _post(http, {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None and choice["logprobs"] is None
    assert not choice["text"].startswith(tokenizer.decode(ids[:3]))
    expected = _log_softmax(model, ids)
    for i in range(1, len(ids)):
        row, entry = expected[i - 1], scored[i]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(row[ids[i]].item(), abs=TOL)
        assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert mine["decoded_token"] == tokenizer.decode([ids[i]])
        values, index = row.topk(2)
        for rank, (token, value) in enumerate(zip(index.tolist(), values.tolist()), 1):
            assert entry[str(token)]["rank"] == rank and entry[str(token)]["logprob"] == pytest.approx(value, abs=TOL)
        assert len(entry) in (2, 3)


def test_streamed_echo_is_the_unstreamed_one(http, tokenizer, texts):
    import json

    body = {"prompt": texts[1][:80], "echo": True, "logprobs": 0, "max_tokens": 6, "temperature": 0}
    whole = _post(http, body)["choices"][0]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["text"].startswith(texts[1][:80])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][field]] == whole["logprobs"][field]


def test_chat_prompt_logprobs_are_the_rendered_prompts(http, model):
    messages = [{"role": "user", "content": "Say something about the sea."}]
    out = _post(http, {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True},
                "/v1/chat/completions")
    ids, scored = out["prompt_token_ids"], out["prompt_logprobs"]
    expected = _log_softmax(model, ids)
    assert len(scored) == len(ids) and scored[0] is None
    assert [scored[i][str(ids[i])]["logprob"] for i in range(1, len(ids))] == pytest.approx(
        [expected[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOL)


@pytest.mark.parametrize("body, url, param, says", [
    ({"prompt": "x", "max_tokens": 0}, "/v1/completions", "max_tokens", "needs echo"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "/v1/completions", "prompt_logprobs", "stream"),
    ({"prompt": "x", "prompt_logprobs": 21}, "/v1/completions", "prompt_logprobs", "less than or equal to 20"),
    ({"prompt": "x", "prompt_logprobs": -1}, "/v1/completions", "prompt_logprobs", "greater than or equal to 0"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "/v1/chat/completions", "echo", "chat"),
])
def test_what_scoring_refuses(http, body, url, param, says):
    r = http.post(url, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], r.text
