"""The server's structured-output fields (vLLM's): ``response_format`` ``json_object`` /
``json_schema``, ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``) and the older
``guided_*``, on completions and chat completions through the ``openai`` client; a spec that cannot
compile or more than one spec is a 400 naming the problem."""

from __future__ import annotations

import json
import re

import pytest
import torch

openai = pytest.importorskip("openai")

from dspark.engine import EngineConfig, LLMEngine  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import demo_pair  # noqa: E402
from test_serve import TIMEOUT, ServerThread  # noqa: E402

MODEL, API_KEY = "demo", "key"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def client():
    from transformers import AutoTokenizer

    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=4, max_model_len=256))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ServerThread(create_app(engine, tokenizer, MODEL, api_key=API_KEY)) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    finally:
        torch.set_num_threads(threads)


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt="def main():", max_tokens=48, temperature=0.0, **kw)


def test_each_field_family_constrains_completions(client):
    schema_fields = [dict(extra_body={"structured_outputs": {"json": SCHEMA}}), dict(extra_body={"guided_json": SCHEMA}),
                     dict(extra_body={"response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": SCHEMA}}})]
    for kw in schema_fields:
        choice = complete(client, **kw).choices[0]
        value = json.loads(choice.text)
        assert choice.finish_reason == "stop" and set(value) == {"ok", "n"} and 0 <= value["n"] <= 9
    assert isinstance(json.loads(complete(client, extra_body={"response_format": {"type": "json_object"}})
                                 .choices[0].text), dict)
    for body in ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}):
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", complete(client, extra_body=body).choices[0].text)
    for body in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        assert complete(client, extra_body=body).choices[0].text in ("yes", "no")
    grammar = 'root ::= "x" ("+" "x")?'
    for body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        assert re.fullmatch(r"x(\+x)?", complete(client, extra_body=body).choices[0].text)


def test_chat_takes_response_format(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a record"}], max_tokens=48, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    assert set(json.loads(response.choices[0].message.content)) == {"ok", "n"}


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "(a"}, "structured_outputs: the regex cannot be compiled"),
    ({"guided_json": {"type": "nonsense"}}, "structured_outputs: the json cannot be compiled"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one structured output per request"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json"),
    ({"structured_outputs": {"backend": "x"}}, "unsupported key"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be text, json_object or json_schema"),
])
def test_bad_specs_are_400s_naming_the_problem(client, body, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        complete(client, extra_body=body)
