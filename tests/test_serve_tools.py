"""Tool-call parsers (vLLM's ``--tool-call-parser``: ``hermes``, ``llama3_json``, ``mistral``) and the
streaming of calls: each parser on whole answers, and on every split of an answer into pieces the
streamed deltas add up to the whole answer's message (the same content, calls and arguments; each
call's header once, its arguments in pieces as generated); the parser a chat template's format calls
for; an unknown parser name refused naming the known ones; through a server: a ``llama3_json``
server's ``"auto"`` and ``"required"`` calls streamed incrementally and accumulated by the ``openai``
client's stream helper into the non-streamed answer."""

from __future__ import annotations

import argparse
import json

import pytest

from dspark.serve.tools import (TOOL_PARSERS, NamedCall, RequiredCalls, ToolCallStream, parse_calls,
                                parser_for_template, tool_parser)

HERMES = ('I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "at": [1, {"x": "}"}]}}'
          '\n</tool_call>\n<tool_call>\n{"arguments": {"q": "\\"}{"}, "name": "search"}\n</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
MISTRAL = ('Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "now", "arguments": "{}"}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now{}'
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}, '
            '{"name": "now", "parameters": {}}]')

# (parser, answer, its content, its calls as (name, arguments))
CASES = [
    ("hermes", HERMES, "I will look. ", [("get_weather", '{"city": "Paris", "at": [1, {"x": "}"}]}'),
                                         ("search", '{"q": "\\"}{"}')]),
    ("hermes", "no call, only <tool_c", "no call, only <tool_c", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", LLAMA3, None, [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]),
    ("llama3_json", ' {"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ("llama3_json", "Paris is {sunny}", "Paris is {sunny}", []),
    ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but no call
    ("mistral", MISTRAL, "Sure ", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ("mistral", MISTRAL[len("Sure [TOOL_CALLS]"):], None, [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ("mistral", MISTRAL_V11, None, [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ("mistral", "[1, 2] are [TOOL_C", "[1, 2] are [TOOL_C", []),
    ("required", REQUIRED, None, [("get_weather", '{"city": "Oslo", "days": [1, 2]}'), ("now", "{}")]),
    ("named", '{"city": "Oslo"}', None, [("get_weather", '{"city": "Oslo"}')]),
]


def parser_of(name: str):
    return {"required": RequiredCalls, "named": lambda: NamedCall("get_weather")}.get(name, TOOL_PARSERS.get(name))()


def streamed(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """(content, calls, the tool-call deltas) of an answer streamed in ``pieces``, as a client adds them up."""
    stream, content, deltas = ToolCallStream(parser), "", []
    for piece in pieces + [None]:
        text, calls = stream.feed(piece) if piece is not None else stream.finish()
        content, deltas = content + (text or ""), deltas + calls
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if "id" in delta:  # the header: once per call, in order, with its name
            assert delta["index"] == len(calls) and delta["type"] == "function", delta
            calls[delta["index"]] = [delta["function"]["name"], ""]
        calls[delta["index"]][1] += delta["function"]["arguments"]
    return content or None, [tuple(c) for _, c in sorted(calls.items())], deltas


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_parser_reads_whole_answers(name, text, content, calls):
    parsed_content, parsed = parse_calls(parser_of(name), text)
    assert parsed_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed] == calls
    for call in parsed:
        json.loads(call["function"]["arguments"])
        assert call["type"] == "function" and len({c["id"] for c in parsed}) == len(parsed)
        assert (call["id"].isalnum() and len(call["id"]) == 9 if name == "mistral"
                else call["id"].startswith("chatcmpl-tool-"))


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_every_split_of_an_answer_streams_the_whole_answer(name, text, content, calls):
    """Two pieces at every cut, and a character at a time: the deltas add up to the whole answer."""
    for cut in range(len(text) + 1):
        assert streamed(parser_of(name), [text[:cut], text[cut:]])[:2] == (content, calls), cut
    assert streamed(parser_of(name), list(text))[:2] == (content, calls)


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL),
                                       ("required", REQUIRED)])
def test_arguments_stream_as_they_are_generated(name, text):
    """Fed a character at a time, a call's header comes once its name is complete and its arguments
    follow in many pieces (not at the end), content only before the calls."""
    parser = parser_of(name)
    stream = ToolCallStream(parser)
    header_at, argument_pieces = None, 0
    for i, ch in enumerate(text):
        _, deltas = stream.feed(ch)
        for delta in deltas:
            if "id" in delta and header_at is None:
                header_at = i
            argument_pieces += bool(delta["function"]["arguments"])
    first_name = parse_calls(parser, text)[1][0]["function"]["name"]
    assert header_at is not None and header_at < text.index(first_name) + len(first_name) + 2
    assert argument_pieces > 10


@pytest.mark.parametrize("template,name", [
    ("{{ '<tool_call>' }}{{ tool_call | tojson }}{{ '</tool_call>' }}", "hermes"),  # Qwen2.5 / Qwen3, Hermes
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),  # Llama 3.1
    ("<|start_header_id|>user<|end_header_id|>{\"name\": function name, \"parameters\": ...}", "llama3_json"),
    ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
    ({"default": "{{ messages[0]['content'] }}", "tool_use": "[TOOL_CALLS]"}, "mistral"),  # named templates
    ("{{ messages[0]['content'] }}", "hermes"), (None, "hermes")])
def test_the_default_parser_follows_the_chat_template(template, name):
    assert parser_for_template(template) == name


def test_an_unknown_parser_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'hermes2'; known: hermes, llama3_json, mistral"):
        tool_parser("hermes2")
    from dspark.cli.serve import _check, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json, mistral, got 'x'"):
        _check(parser.parse_args(["--tool-call-parser", "x"]))
    assert "llama3_json" in parser.format_help()


# ---- through a server whose --tool-call-parser is llama3_json ----------------------------------

openai = pytest.importorskip("openai")
from test_serve_structured import CLOCK, MODEL, WEATHER, serving  # noqa: E402

LLAMA3_REGEX = (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)"\}\}; '
                r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}')


@pytest.fixture(scope="module")
def client():
    with serving(tool_call_parser="llama3_json") as llama3_client:
        yield llama3_client


def request(**kw) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=96, temperature=0.0,
                tools=[WEATHER, CLOCK], **kw)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_calls_add_up_to_the_answer_in_the_openai_client(client, choice):
    """The ``openai`` client's stream helper accumulates the streamed calls into the non-streamed
    answer; the call's header comes before its last arguments piece (streamed as generated)."""
    kw = request(tool_choice=choice, **({"extra_body": {"guided_regex": LLAMA3_REGEX}} if choice == "auto" else {}))
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None and whole.message.tool_calls
    if choice == "auto":
        assert [c.function.name for c in whole.message.tool_calls] == ["get_weather", "get_time"]
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert ([(c.function.name, c.function.arguments) for c in final.message.tool_calls]
            == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls])
    assert all(c.id.startswith("chatcmpl-tool-") for c in final.message.tool_calls)
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
    assert len(pieces) > len(whole.message.tool_calls), [e.arguments_delta for e in pieces]  # as generated
    assert json.loads(whole.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Oslo")


def test_a_llama3_server_leaves_plain_answers_as_content(client):
    choice = client.chat.completions.create(**request(tool_choice="auto",
                                                      extra_body={"guided_regex": "Paris is sunny"})).choices[0]
    assert choice.message.content == "Paris is sunny" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def _demo_tokenizer():
    from transformers import AutoTokenizer

    from dspark.training.data import demo_pair

    return AutoTokenizer.from_pretrained(str(demo_pair().target))


def test_mistral_markers_that_are_special_tokens_are_read():
    """Mistral's tokenizers make ``[TOOL_CALLS]`` and ``[ARGS]`` special tokens: the text the server
    gives the ``mistral`` parser keeps them (decoded without them the v11 form is lost), and the
    calls are read from it."""
    from dspark.engine.text import TextOutput

    tokenizer = _demo_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    ids = tokenizer.encode(MISTRAL_V11, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    texts = {}
    for skip in (True, False):
        text = TextOutput(tokenizer, [1, 2, 3], [], skip_special_tokens=skip)
        released, used = text.add(ids)
        texts[skip] = released + text.flush()
        assert used == len(ids)
    assert "[TOOL_CALLS]" not in texts[True] and texts[False] == MISTRAL_V11
    assert parser_of("mistral").reads_special_tokens and not parser_of("hermes").reads_special_tokens
    content, calls = parse_calls(parser_of("mistral"), texts[False])
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("now", "{}")]


def test_skip_special_tokens_false_keeps_them_and_a_stop_token_is_no_text(client):
    """``skip_special_tokens: false`` (vLLM's field) keeps a special token's text; the stop token that
    ends an output is left out of the text either way (vLLM's rule), and named as the stop reason."""
    tokenizer = _demo_tokenizer()
    mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    forced = dict(model=MODEL, prompt="def f(x):", max_tokens=3, temperature=0.0, logit_bias={str(mask): 100})
    kept = client.completions.create(**forced, extra_body={"skip_special_tokens": False}).choices[0]
    skipped = client.completions.create(**forced).choices[0]
    assert kept.text == "<|MASK|>" * 3 and skipped.text == ""
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    stopped = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=0.0,
                                        logit_bias={str(letter): 100},
                                        extra_body={"stop_token_ids": [letter], "return_token_ids": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == letter
    assert stopped.token_ids == [letter] and stopped.text == ""
