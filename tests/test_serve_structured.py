"""The server's structured-output fields (vLLM's): ``response_format`` ``json_object`` /
``json_schema``, ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``) and the older
``guided_*``, on completions and chat completions through the ``openai`` client; a spec that cannot
compile or more than one spec is a 400 naming the problem. Tools on chat: a named function's
arguments follow its schema, ``"required"`` gives calls of the tools, ``"auto"`` parses Hermes /
Qwen ``<tool_call>`` blocks (the model made to write one by a regex), with ids and finish reason
``tool_calls``, whole and streamed as OpenAI streams them; the tools reach the chat template."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def serving(tool_call_parser: str | None = None, **config):
    """An ``openai`` client of a server of the demo pair with ``EngineConfig(**config)`` (and the
    ``--tool-call-parser`` given)."""
    from transformers import AutoTokenizer

    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=4, max_model_len=256, **config))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ServerThread(create_app(engine, tokenizer, MODEL, api_key=API_KEY, chat_template=TEMPLATE,
                                     tool_call_parser=tool_call_parser)) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client():
    with serving() as chain_client:
        yield chain_client


# the demo tokenizer's template with the tools written first (as Qwen's does, in its system turn)
TEMPLATE = ("{%- if tools %}{{- '<|system|>\\n' + (tools | map(attribute='function') | map(attribute='name') "
            "| join(',')) + '\\n' }}{%- endif %}{%- for message in messages %}{{- '<|' + message['role'] + "
            "'|>\\n' + (message['content'] or '') + '\\n' }}{%- endfor %}{{- '<|assistant|>\\n' }}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
HERMES = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                          max_tokens=64, temperature=0.0, tools=[WEATHER, CLOCK], **kw)


def test_a_named_tool_call_follows_its_schema(client):
    response = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    extra_body={"return_token_ids": True})
    choice = response.choices[0]
    call, = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(demo_pair().target)).decode(response.model_extra["prompt_token_ids"])
    assert prompt.startswith("<|system|>\nget_weather,get_time\n")  # the tools reached the template


def test_required_tool_calls_are_calls_of_the_tools(client):
    choice = chat(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))


def test_auto_parses_hermes_tool_calls(client):
    choice = chat(client, tool_choice="auto", extra_body={"guided_regex": HERMES}).choices[0]
    call, = choice.message.tool_calls
    assert choice.message.content == "Sure. " and choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    plain = chat(client, tool_choice="none", extra_body={"guided_regex": HERMES}).choices[0]
    assert plain.message.tool_calls in (None, []) and "<tool_call>" in plain.message.content


@pytest.mark.parametrize("mode", ["named", "auto"])
def test_streamed_tool_calls_come_as_openai_streams_them(client, mode):
    """A delta with the call's index, id, type and name first, then ``arguments`` pieces that add up;
    content only before the call; the last chunk's finish reason ``tool_calls``."""
    kw = (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}) if mode == "named" else
          dict(tool_choice="auto", extra_body={"guided_regex": HERMES}))
    chunks = list(chat(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].index == 0 and calls[0].id.startswith("chatcmpl-tool-") and calls[0].function.name == "get_weather"
    assert all(t.index == 0 and t.id is None for t in calls[1:])
    assert json.loads("".join(t.function.arguments or "" for t in calls))["city"] in ("Paris", "Oslo")
    assert "".join(d.content or "" for d in deltas) == ("" if mode == "named" else "Sure. ")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


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


def test_a_tree_mode_server_answers_json_schemas(client):
    """A tree-mode server (top-4 trees of 16 nodes): ``response_format`` ``json_schema`` gives JSON
    of the schema, greedy (the chain server's answer: both are plain greedy decoding under the
    grammar) and sampled."""
    def ask(server, **kw):
        return server.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a record"}], max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, **kw).choices[0]

    with serving(draft_top_k=4, tree_budget=16) as tree_client:
        greedy = ask(tree_client, temperature=0.0)
        assert greedy.message.content == ask(client, temperature=0.0).message.content
        for seed in range(3):
            choice = ask(tree_client, temperature=1.0, seed=seed)
            value = json.loads(choice.message.content)
            assert choice.finish_reason == "stop" and set(value) == {"ok", "n"} and 0 <= value["n"] <= 9
        assert set(json.loads(greedy.message.content)) == {"ok", "n"}


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


@pytest.mark.parametrize("kw, message", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "at most one structured output"),
])
def test_bad_tool_requests_are_400s(client, kw, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        chat(client, **kw)
