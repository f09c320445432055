"""vLLM's API conventions on ``dspark serve`` (CPU, demo pair, loopback HTTP): a list of prompts,
``n`` samples, logprobs (completions and chat, streamed or not), the demo tokenizer's chat template,
OpenAI-shaped routing errors, bodies without a JSON Content-Type, request fields (honoured, accepted
at their no-op values, refused otherwise), the API key, the latency histograms, and the CLI's flags.
The server requires ``API_KEY`` (as ``dspark serve --api-key``), so every test also checks that an
authorised request goes through unchanged.

Logprobs come from the engine (``Request.logprobs`` -> ``RequestOutput.logprobs``); here a wrapper
around the real engine attaches made-up values that depend on the token (``fake_logprobs``), so the
tests check what the server does with them: alignment with the tokens, the OpenAI shapes, the top-k
cut. ``test_serve.py::test_logprobs_are_the_targets_log_softmax`` checks the engine's real values.
"""

import dataclasses
import json

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402
from dspark.engine.request import TokenLogprobs  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import demo_pair, read_prompts  # noqa: E402
from test_serve import TIMEOUT, ServerThread  # noqa: E402

MODEL = "demo"
API_KEY = "sk-dspark-test"
NEW = 8
VOCAB = 2048


def fake_logprobs(token_id: int, k: int) -> TokenLogprobs:
    """Values a test can predict: the chosen token's logprob from its id, k alternatives after it."""
    lp = -(token_id % 7) / 10
    return TokenLogprobs(token_id, lp, [((token_id + j) % VOCAB, lp - j) for j in range(1, k + 1)])


class LogprobEngine:
    """The real engine, its outputs given ``fake_logprobs`` for the requests that ask for logprobs."""

    def __init__(self, engine: LLMEngine):
        self._engine, self._wanted = engine, {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request: Request) -> int:
        rid = self._engine.add_request(request)
        if request.logprobs is not None:
            self._wanted[rid] = request.logprobs
        return rid

    def finish(self):
        return [dataclasses.replace(out, logprobs=[fake_logprobs(t, self._wanted[out.request_id])
                                                   for t in out.new_token_ids])
                if out.request_id in self._wanted else out for out in self._engine.finish()]

    def step(self):
        self.launch()
        return self.finish()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_pair().target))


@pytest.fixture(scope="module")
def prompts():
    return [r["text"][:120] for r in read_prompts(str(demo_pair().prompts))[:3]]


@pytest.fixture(scope="module")
def served(tokenizer, prompts):
    """(server url, offline greedy output ids of each prompt)."""
    pair = demo_pair()
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=8, max_model_len=256))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core box runs this much faster on one intra-op thread
    try:
        reference = [r.token_ids for r in engine.generate([Request(tokenizer(p)["input_ids"], NEW) for p in prompts])]
    finally:
        torch.set_num_threads(threads)
    with ServerThread(create_app(LogprobEngine(engine), tokenizer, MODEL, api_key=API_KEY)) as server:
        yield server.url, reference


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[0], timeout=TIMEOUT, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _complete(client, prompt, **kw):
    kw.setdefault("max_tokens", NEW)
    kw.setdefault("temperature", 0.0)
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kw)


def _ids(choice):
    return choice.model_extra["token_ids"]


def _by_index(chunks):
    """Streamed chunks -> {choice index: [chunk choices in order]}."""
    out = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(choice)
    return out


# ---- a list of prompts, n samples ------------------------------------------------------------------


def test_prompt_lists_give_one_choice_per_prompt(served, client, tokenizer, prompts):
    reference = served[1]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    for batch in (prompts, ids):  # strings, or token-id lists
        response = _complete(client, batch)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [_ids(c) for c in response.choices] == reference
        assert [c.model_extra["prompt_token_ids"] for c in response.choices] == ids
        assert response.usage.prompt_tokens == sum(map(len, ids))
        assert response.usage.completion_tokens == sum(map(len, reference))
    one = _complete(client, ids[1])  # a flat id list is one prompt
    assert len(one.choices) == 1 and _ids(one.choices[0]) == reference[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=NEW, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    streamed = _by_index(chunks)
    assert sorted(streamed) == [0, 1, 2]
    assert [[t for c in streamed[i] for t in c.model_extra["token_ids"]] for i in range(3)] == reference
    assert chunks[-1].usage.completion_tokens == sum(map(len, reference))


def test_n_samples(served, client, prompts):
    reference = served[1]
    greedy = _complete(client, prompts[:2], n=3)
    assert [c.index for c in greedy.choices] == list(range(6))  # prompt_index * n + sample
    assert [_ids(c) for c in greedy.choices] == [reference[0]] * 3 + [reference[1]] * 3
    assert greedy.usage.prompt_tokens == _complete(client, prompts[:2]).usage.prompt_tokens  # prompts count once

    def sampled(**kw):
        return [_ids(c) for c in _complete(client, prompts[2], temperature=1.5, **kw).choices]

    samples = sampled(n=3, seed=7)
    assert len({tuple(s) for s in samples}) > 1  # the samples differ ...
    assert sampled(n=3, seed=7) == samples  # ... and repeat
    assert [sampled(seed=7 + i)[0] for i in range(3)] == samples  # sample i uses seed + i, as vLLM
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=NEW, temperature=1.5, seed=7,
                                            n=3, stream=True, extra_body={"return_token_ids": True}))
    streamed = _by_index(chunks)
    assert [[t for c in streamed[i] for t in c.model_extra["token_ids"]] for i in range(3)] == samples
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "import os"}],
                                          max_tokens=NEW, temperature=0.0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


# ---- logprobs ----------------------------------------------------------------------------------------


def _expected_completion_logprobs(tokenizer, ids, k, offset=0):
    tokens = [tokenizer.decode([t]) for t in ids]
    top = []
    for t, tok in zip(ids, tokens):
        lp = fake_logprobs(t, k)
        entry = {tok: lp.logprob}
        for alt, value in lp.top:
            entry.setdefault(tokenizer.decode([alt]), value)
        top.append(entry)
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [fake_logprobs(t, k).logprob for t in ids], "top_logprobs": top,
            "text_offset": offsets}


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs(served, http, tokenizer, prompts, k):
    body = {"prompt": prompts[0], "max_tokens": NEW, "temperature": 0, "logprobs": k, "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == served[1][0]
    assert choice["logprobs"] == _expected_completion_logprobs(tokenizer, served[1][0], k)
    assert all(len(top) in (k, k + 1) for top in choice["logprobs"]["top_logprobs"])
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    merged = {key: [x for c in chunks for x in c["logprobs"][key]] for key in choice["logprobs"]}
    assert merged == choice["logprobs"]  # text_offset continues across chunks
    text = "".join(c["text"] for c in chunks)
    assert all(text[o:].startswith(t) for o, t in zip(merged["text_offset"], merged["tokens"]))


def test_chat_logprobs(served, client, tokenizer):
    messages = [{"role": "user", "content": "def main():"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                          logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    ids = chat.choices[0].model_extra["token_ids"]
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    for entry, t in zip(content, ids):
        expected = fake_logprobs(t, 2)
        assert entry.logprob == expected.logprob and entry.bytes == list(entry.token.encode())
        assert [(x.token, x.logprob) for x in entry.top_logprobs] == [(tokenizer.decode([a]), v)
                                                                       for a, v in expected.top]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    assert [c for chunk in chunks for c in chunk.choices[0].logprobs.content] == content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                           logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"logprobs": 1}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, extra_body=bad)
        assert info.value.body["param"] == param


def test_requests_without_logprobs_have_none(client, prompts):
    assert _complete(client, prompts[0]).choices[0].logprobs is None


# ---- the demo's chat template ---------------------------------------------------------------------


def test_chat_with_the_demo_tokenizers_template(client, tokenizer):
    messages = [{"role": "system", "content": "Python"}, {"role": "user", "content": "import sys"}]
    rendered = "<|system|>\nPython\n<|user|>\nimport sys\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    expected = _complete(client, rendered).choices[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0)
    assert chat.choices[0].message.content == expected.text and chat.choices[0].finish_reason == expected.finish_reason
    turns = messages + [{"role": "assistant", "content": "x = 1"}, {"role": "user", "content": "more"}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    assert text.endswith("x = 1\n<|endoftext|><|user|>\nmore\n")  # a finished reply ends with EOS


# ---- routing errors, bodies -----------------------------------------------------------------------


def _error(r, status):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error["message"]


def test_unknown_routes_and_methods_answer_in_openai_shape(http):
    assert "/v1/nothing" in _error(http.get("/v1/nothing"), 404)
    assert "/v1/completions" in _error(http.post("/v1/completion", json={}), 404)
    r = http.get("/v1/completions")
    assert "POST" in _error(r, 405) and r.headers["allow"] == "POST"
    assert "GET" in _error(http.post("/health"), 405)


def test_body_without_json_content_type(http, served, prompts):
    body = json.dumps({"prompt": prompts[0], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}).encode()
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)
        assert r.json()["choices"][0]["token_ids"] == served[1][0]
    assert "not valid JSON" in _error(http.post("/v1/completions", content=b'{"prompt": ',
                                                headers={"content-type": "text/plain"}), 400)
    assert "empty" in _error(http.post("/v1/completions", content=b""), 400)


# ---- request fields: honoured, accepted where they change nothing, refused otherwise -------------------

# Values client libraries send by default or that ask for nothing: accepted, and the output is that of
# the request without them (chat-only fields: CHAT_NOOPS). Not the server's table: the brief's list.
NOOPS = {"best_of": 1, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
         "min_p": 0, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True,
         "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
         "response_format": {"type": "text"}, "guided_json": None, "structured_outputs": None, "tools": [],
         "tool_choice": "none", "parallel_tool_calls": True, "functions": [], "user": "u-1", "seed": None,
         "metadata": {"run": "7"}, "store": False, "service_tier": "auto", "allowed_token_ids": None, "bad_words": [],
         "stream_options": None, "priority": 0, "cache_salt": "tenant-1", "suffix": None}
CHAT_NOOPS = {**{k: v for k, v in NOOPS.items() if k != "suffix"}, "logprobs": False, "top_logprobs": None,
              "modalities": ["text"], "max_completion_tokens": None, "reasoning_effort": None, "audio": None,
              "prediction": None, "chat_template_kwargs": {}, "continue_final_message": False}

REFUSED = [  # (field, a value that would change the output, the param named)
    ("best_of", 2, "best_of"), ("length_penalty", 0.5, "length_penalty"), ("use_beam_search", True, "use_beam_search"),
    ("include_stop_str_in_output", True, "include_stop_str_in_output"),
    ("spaces_between_special_tokens", False, "spaces_between_special_tokens"),
    ("truncate_prompt_tokens", 4, "truncate_prompt_tokens"), ("allowed_token_ids", [1, 2], "allowed_token_ids"),
    ("store", True, "store"), ("metadata", "run-7", "metadata"), ("temprature", 0.5, "temprature"),  # a typo
    ("stream_options", {"include_usge": True}, "stream_options.include_usge"),
]


def _refusal(r, param, value):
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert json.dumps(value)[:60] in error["message"], error["message"]  # the value given (long ones cut)
    return error["message"]


def test_noop_values_are_accepted_and_change_nothing(served, http, client, prompts):
    body = {"prompt": prompts[0], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
    for noops in ({**NOOPS}, {"n": 2, "best_of": 2}):  # best_of == n: the n best of n
        r = http.post("/v1/completions", json={**body, **noops})
        assert r.status_code == 200, (noops, r.text)
        assert [c["token_ids"] for c in r.json()["choices"]] == [served[1][0]] * noops.get("n", 1)
    messages = [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "x", "tool_calls": []}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0)
    typed = ("presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "user", "logprobs")  # as the openai client itself spells them
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                          **{k: CHAT_NOOPS[k] for k in typed},
                                          extra_body={k: v for k, v in CHAT_NOOPS.items() if k not in typed})
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert chat.usage.completion_tokens == plain.usage.completion_tokens


@pytest.mark.parametrize("field, value, param", REFUSED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(REFUSED)])
def test_fields_the_server_would_ignore_are_refused(http, field, value, param):
    shown = value[param.split(".")[1]] if "." in param else value  # a nested field's own value
    message = _refusal(http.post("/v1/completions", json={"prompt": "x", field: value}), param, shown)
    assert "not supported" in message or "unrecognized" in message or "must be" in message
    chat = {"messages": [{"role": "user", "content": "x"}], field: value}
    assert _refusal(http.post("/v1/chat/completions", json=chat), param, shown) == message


def test_refusals_name_the_field_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"allowed_token_ids": [3]})
    assert info.value.body["param"] == "allowed_token_ids"
    assert "allowed_token_ids is not supported" in info.value.body["message"]
    turn = {"role": "assistant", "content": "x", "refusal": "no"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}, turn], max_tokens=2)
    assert info.value.body["param"] == "messages[1].refusal"


def test_min_p_and_logit_bias_are_honoured(served, http, client, tokenizer, prompts):
    """``logit_bias`` bans a token of the greedy output (completions and chat, through the openai
    client as it spells the field); ``min_p`` changes a seeded sample and 0 changes nothing. Their
    exactness against transformers: test_request_sampling.py."""
    greedy = served[1][0]
    k = next(i for i in range(1, NEW) if greedy[i] not in greedy[:i])
    ban = {str(greedy[k]): -100}
    ids = _ids(_complete(client, prompts[0], logit_bias=ban).choices[0])
    assert ids[:k] == greedy[:k] and greedy[k] not in ids
    assert _ids(_complete(client, tokenizer(prompts[0])["input_ids"], logit_bias=ban).choices[0]) == ids
    messages = [{"role": "user", "content": "import os"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                           extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    banned = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                            logit_bias={str(plain[0]): -100}, extra_body={"return_token_ids": True})
    assert plain[0] not in banned.choices[0].model_extra["token_ids"]
    sampled = [_ids(_complete(client, prompts[0], temperature=1.0, seed=4, extra_body={"min_p": m}).choices[0])
               for m in (0, 0.0, 0.9)]
    assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p: Input should be less than or equal to 1, got 1.5"),
    ("min_p", "0.1", 'min_p: Input should be a valid number, got "0.1"'),
    ("logit_bias", {"x": 1}, 'logit_bias keys must be token ids (decimal integers), got "x"'),
    ("logit_bias", {"5": 101}, 'logit_bias["5"] must be in [-100, 100], got 101'),
    ("logit_bias", {"5": "a"}, 'logit_bias.5: Input should be a valid number, got "a"'),
    ("logit_bias", [5], "logit_bias: Input should be a valid dictionary, got [5]"),
    ("logit_bias", {"5000": 1}, "logit_bias holds token id 5000, outside the target's vocabulary [0, 2048)"),
])
def test_bad_min_p_and_logit_bias_are_400s_naming_the_field(http, field, value, message):
    assert_400_naming_the_field(http, field, value, message)


def assert_400_naming_the_field(http, field, value, message):
    """Completions and chat both answer 400 with ``param`` = ``field`` and ``message`` in the text."""
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        r = http.post(path, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and message in error["message"], error


def test_penalties_and_filters_are_honoured(served, client, tokenizer, prompts):
    """presence / frequency / repetition penalties, min_tokens and bad_words on one greedy request
    (through the openai client as it spells them): transformers' ``generate()`` with the same
    processors (test_penalties.py); chat honours them too (a bad word never comes)."""
    from transformers import AutoModelForCausalLM

    from dspark.engine import encode_bad_words
    from test_penalties import transformers_greedy

    greedy, prompt = served[1][0], tokenizer(prompts[0])["input_ids"]
    word = next(w for w in (tokenizer.decode([t]).strip() for t in greedy[3:]) if w)
    fields = dict(presence_penalty=1.0, frequency_penalty=0.5, extra_body=dict(
        repetition_penalty=1.3, min_tokens=5, bad_words=[word], stop_token_ids=[greedy[1]]))
    sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=5,
                              bad_words=encode_bad_words([word], tokenizer))
    model = AutoModelForCausalLM.from_pretrained(str(demo_pair().target), dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompt, sampling, stop_ids=(0, greedy[1]), new_tokens=NEW)
    assert _ids(_complete(client, prompts[0], **fields).choices[0]) == expected != greedy
    messages = [{"role": "user", "content": "import os"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                           extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    banned = tokenizer.decode([plain[0]]).strip()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0.0,
                                          extra_body={"return_token_ids": True, "bad_words": [banned]})
    assert banned not in tokenizer.decode(chat.choices[0].model_extra["token_ids"])


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty: Input should be less than or equal to 2, got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty: Input should be greater than or equal to -2, got -3"),
    ("repetition_penalty", 0, "repetition_penalty: Input should be greater than 0, got 0"),
    ("repetition_penalty", True, "repetition_penalty: Input should be a valid number, got true"),
    ("min_tokens", -1, "min_tokens: Input should be greater than or equal to 0, got -1"),
    ("min_tokens", 3, "min_tokens must be at most max_tokens (2), got 3"),
    ("bad_words", "x", 'bad_words: Input should be a valid list, got "x"'),
    ("bad_words", [""], "bad_words[0] is empty: it has no tokens"),
    ("bad_words", ["x" * 200], "tokens; at most 16 are supported"),
    ("bad_words", [f"x{i} y" for i in range(65)], "bad_words may hold at most 64 sequences of two tokens or more"),
])
def test_bad_penalties_are_400s_naming_the_field(http, field, value, message):
    assert_400_naming_the_field(http, field, value, message)


# ---- the API key ----------------------------------------------------------------------------------


def test_api_key_guards_every_v1_route(served, prompts):
    url = served[0]
    for key in ("wrong", API_KEY + "x", API_KEY[:-1]):
        other = openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)
        for call in (lambda: other.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2),
                     lambda: other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}]),
                     lambda: other.models.list()):
            with pytest.raises(openai.AuthenticationError) as info:
                call()
            assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
            assert key not in info.value.body["message"] and API_KEY not in info.value.body["message"]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as anonymous:
        for headers in ({}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
            for r in (anonymous.post("/v1/completions", json={"prompt": "x"}, headers=headers),
                      anonymous.get("/v1/models", headers=headers), anonymous.get("/v1/nothing", headers=headers)):
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
                assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                              "param": None, "code": "invalid_api_key"}}
        assert anonymous.get("/health").status_code == 200  # the routes outside /v1 stay open
        assert "dspark:num_requests_running" in anonymous.get("/metrics").text
        assert anonymous.get("/nothing").status_code == 404
    assert [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0).models.list()] == [MODEL]


# ---- opting out of speculative decoding -----------------------------------------------------------


def test_disable_spec_decode_verifies_no_draft_and_keeps_the_output(served, client, http, prompts):
    """``disable_spec_decode: true`` (vLLM's name, an extra body field): the greedy output is the
    same, completions and chat, streamed or not, and the server's draft counters do not move -- while
    the same request without it verifies drafts. A non-bool is a 400 naming the field."""
    def drafts():
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        return sum(s.value for s in families["dspark:spec_decode_num_draft_tokens"].samples if s.name.endswith("_total"))

    before = drafts()
    opted = _complete(client, prompts, extra_body={"disable_spec_decode": True})
    assert [_ids(c) for c in opted.choices] == served[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=NEW, temperature=0.0,
                                            stream=True, extra_body={"disable_spec_decode": True,
                                                                     "return_token_ids": True}))
    assert [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]] == served[1][0]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": prompts[1]}], max_tokens=NEW, temperature=0.0)
    opted_chat = client.chat.completions.create(**chat, extra_body={"disable_spec_decode": True})
    assert drafts() == before
    assert opted_chat.choices[0].message == client.chat.completions.create(**chat).choices[0].message
    assert drafts() > before  # the same chat request without the opt-out verified drafts
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "disable_spec_decode": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "disable_spec_decode"


# ---- metrics --------------------------------------------------------------------------------------


def test_latency_histograms(http, client, prompts):
    def scrape():
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        return {(name, suffix): sum(s.value for s in families[f"dspark:{name}"].samples if s.name.endswith(suffix))
                for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                             "e2e_request_latency_seconds") for suffix in ("_count", "_sum")}

    before = scrape()
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=NEW, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True}))
    after = scrape()
    steps = len([c for c in chunks if c.choices[0].text or c.choices[0].finish_reason])
    assert after["time_to_first_token_seconds", "_count"] - before["time_to_first_token_seconds", "_count"] == 1
    assert after["e2e_request_latency_seconds", "_count"] - before["e2e_request_latency_seconds", "_count"] == 1
    itl = after["inter_token_latency_seconds", "_count"] - before["inter_token_latency_seconds", "_count"]
    assert 1 <= itl <= NEW - 1 and itl >= steps - 2  # one per engine output after the first
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert after[name, "_sum"] > before[name, "_sum"]


# ---- the CLI's flags ------------------------------------------------------------------------------


def _serve_parser():
    import argparse

    from dspark.cli import serve
    from dspark.cli._runtime import HelpFormatter

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    serve.add_arguments(parser)
    return parser


def test_cli_flags(tmp_path):
    from dspark.cli._runtime import HelpFormatter
    from dspark.engine import default_dtype

    parser = _serve_parser()
    assert parser.parse_args(["--max-num-seqs", "4"]).max_batch == 4 == parser.parse_args(["--max-batch", "4"]).max_batch
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--max-num-batched-tokens", "512"]).max_num_batched_tokens == 512
    formatter = HelpFormatter("dspark serve")
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and "default" in formatter._get_help_string(action), action.option_strings
    # --dtype auto: the checkpoint's half precision on a GPU, float32 on a CPU
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_dtype(cuda, str(demo_pair().target)) is torch.bfloat16  # the demo's config.json: "dtype"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert default_dtype(cuda, str(tmp_path)) is torch.float16 and default_dtype(cpu, str(tmp_path)) is torch.float32
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    assert default_dtype(cuda, str(tmp_path)) is torch.bfloat16 and default_dtype(cuda, str(tmp_path / "none")) is torch.bfloat16

def test_api_key_flag_and_environment(monkeypatch):
    from dspark.cli import serve
    from dspark.cli._runtime import HelpFormatter

    monkeypatch.setenv("DSPARK_API_KEY", "env-secret")
    parser = _serve_parser()
    parser.formatter_class = HelpFormatter
    assert "env-secret" not in parser.format_help()  # the help names the variable, never its value
    assert serve._api_key(parser.parse_args([]).api_key) == "env-secret"
    assert serve._api_key(parser.parse_args(["--api-key", "flag-secret"]).api_key) == "flag-secret"
    for bad in ("", " flag-secret"):
        with pytest.raises(ValueError, match="--api-key must be a non-empty key") as info:
            serve._api_key(parser.parse_args(["--api-key", bad]).api_key)
        assert "flag-secret" not in str(info.value)
    monkeypatch.setenv("DSPARK_API_KEY", "")
    assert serve._api_key(None) is None  # set but empty: no key, as unset


def test_docs_api_md_lists_every_request_field():
    from pathlib import Path

    from dspark.serve import protocol

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    fields = {*protocol.COMPLETION_NOOPS, *protocol.CHAT_NOOPS, *protocol.MESSAGE_NOOPS,
              *protocol.CompletionRequest.model_fields, *protocol.ChatCompletionRequest.model_fields}
    assert not [f for f in sorted(fields) if f"`{f}`" not in text]
