"""Tool calls on chat completions (OpenAI's ``tools`` / ``tool_choice``, as vLLM serves them).

``tool_choice``:

* ``"none"``: the tools go to the chat template, the output is plain text;
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's ``parameters``
  schema (a structured output) and returned as one call of N, its text the ``arguments``;
* ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one
  of the tools each (vLLM's schema), returned as those calls;
* ``"auto"`` (the default with tools): the output is free; the server's tool-call parser (vLLM's
  ``--tool-call-parser``, ``TOOL_PARSERS``) finds the calls the model wrote in its chat template's
  format, and the text before them is the ``content``:

  - ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5,
    Qwen3);
  - ``llama3_json``: an answer that is ``{"name": ..., "parameters": {...}}`` objects separated by
    ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3; no content then);
  - ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or ``[TOOL_CALLS]name
    [ARGS]{...}`` per call (the v11 tokenizers' form); the marker is a special token that decoding
    drops, so an answer that begins with ``[`` is read as the array too.

Every format is read by one scan (``ToolParser.scan``) that the whole answer and the stream share, so
the streamed deltas add up to the whole answer's message: a call counts once its ``name`` is
complete, and its ``arguments`` are the text of its arguments object exactly as generated (a JSON
object once complete; an ``arguments`` given as a JSON string is decoded). Streamed as OpenAI streams
calls: a delta with the call's ``index``, ``id``, ``type`` and ``function.name`` once the name is
complete, then ``function.arguments`` pieces as they are generated; content streams until what may
begin a call. An answer with calls has finish reason ``"tool_calls"`` (when it ended by itself).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["TOOL_PARSERS", "ParsedCalls", "PartialCall", "ToolCallStream", "ToolChoice", "ToolError", "ToolParser",
           "parse_calls", "parser_for_template", "tool_parser"]


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` the server cannot act on; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tools ask for: ``mode`` ``none`` / ``auto`` / ``required`` / ``named``
    (``name`` then the function), over ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``
    dicts, as the chat template takes them)."""

    mode: str
    tools: tuple[dict, ...]
    name: str | None = None

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice) -> "ToolChoice | None":
        """The request's choice (None without tools and without a tool_choice that needs them);
        ``ToolError`` naming the field otherwise."""
        tools = tuple(tools or ())
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"parameters\": ...}}}}", f"tools[{i}]")
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tool_choice == "none":
            return cls("none", tools) if tools else None
        if not tools:
            raise ToolError(f"tool_choice {json.dumps(tool_choice)} needs tools", "tool_choice")
        if tool_choice in ("auto", "required"):
            return cls(tool_choice, tools)
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {json.dumps(tool_choice)[:80]}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        return cls("named", tools, name)

    def parameters(self, name: str) -> dict:
        """The JSON schema of function ``name``'s arguments (any object when it has none)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object"}

    def schema(self) -> dict | None:
        """The JSON schema the output is constrained to (None: free text)."""
        if self.mode == "named":
            return self.parameters(self.name)
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"]} for t in self.tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}

    def parser(self, auto: "ToolParser") -> "ToolParser | None":
        """The parser of this choice's answers: ``auto`` (the server's) for ``"auto"``, the array of
        vLLM's schema for ``"required"``, the whole text as the arguments for a named function, None
        (plain text) for ``"none"``."""
        if self.mode == "named":
            return NamedCall(self.name)
        if self.mode == "required":
            return RequiredCalls()
        return auto if self.mode == "auto" else None


# ---- one scan of an answer, shared by the whole answer and the stream ----------------------------

@dataclass(frozen=True)
class PartialCall:
    """A call as far as the answer has written it: ``name`` complete, ``arguments`` the text of its
    arguments so far (it only grows as the answer does; "" while the name came first and the object
    not yet)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedCalls:
    """What an answer (so far) is: ``content`` the text that is surely content (all of it once final
    and without calls), ``calls`` the calls begun."""

    content: str
    calls: tuple[PartialCall, ...]


_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|["{}\[\]]', re.S)  # whole strings skipped; a lone " is an open one
_SCALAR = re.compile(r"[^\s,\]}]*")


class _Malformed(Exception):
    """Not JSON of the expected shape at this point."""


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value at ``text[i]`` ends (None: the text ends inside it). Nesting is tracked
    by brackets outside strings; what lies inside is not validated."""
    if i >= len(text):
        return None
    if text[i] == '"':
        match = _STRING.match(text, i)
        return match.end() if match else None
    if text[i] in "{[":
        depth = 0
        for match in _NESTING.finditer(text, i):
            token = match.group()
            if token == '"':
                return None
            depth += 1 if token in "{[" else -1 if token in "}]" else 0
            if depth == 0:
                return match.end()
        return None
    end = _SCALAR.match(text, i).end()
    if end == i:
        raise _Malformed
    return end if end < len(text) else None  # a number may go on


@dataclass(frozen=True)
class _CallScan:
    call: PartialCall | None  # None until the name is complete
    end: int | None  # after the object's "}"; None: the text ends inside it or it went wrong there
    malformed: bool = False


def _scan_call(text: str, i: int, argument_keys: tuple[str, ...]) -> _CallScan:
    """The call object ``{"name": ..., <argument key>: {...}}`` at ``text[i]``, as far as it goes."""
    name: str | None = None
    arguments: str | None = None

    def scanned(end: int | None, malformed: bool = False) -> _CallScan:
        done = end is not None
        call = None if name is None else PartialCall(name, arguments if arguments is not None else "{}" if done else "")
        return _CallScan(call, end, malformed)

    if i >= len(text):
        return scanned(None)
    if text[i] != "{":
        return scanned(None, True)
    i += 1
    try:
        while True:
            i = _skip(text, i)
            if i == len(text):
                return scanned(None)
            if text[i] == "}":
                return scanned(i + 1)
            if text[i] != '"':
                raise _Malformed
            key_end = _value_end(text, i)
            if key_end is None:
                return scanned(None)
            key, i = json.loads(text[i:key_end]), _skip(text, key_end)
            if i == len(text):
                return scanned(None)
            if text[i] != ":":
                raise _Malformed
            i = _skip(text, i + 1)
            end = _value_end(text, i)
            if key == "name" and name is None:
                if end is None:
                    return scanned(None)
                name = json.loads(text[i:end])
                if not isinstance(name, str):
                    raise _Malformed
            elif key in argument_keys and arguments is None:
                if end is None:  # an object streams as it comes; a string (encoded JSON) once whole
                    arguments = text[i:] if text[i:i + 1] == "{" else None
                    return scanned(None)
                arguments = text[i:end] if text[i] != '"' else json.loads(text[i:end])
                if not isinstance(arguments, str):
                    raise _Malformed
            elif end is None:
                return scanned(None)
            i = _skip(text, end)
            if i == len(text):
                return scanned(None)
            if text[i] == "}":
                return scanned(i + 1)
            if text[i] != ",":
                raise _Malformed
            i += 1
    except (_Malformed, json.JSONDecodeError):
        return scanned(None, True)


def _longest_tail_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that begins ``marker`` (content held back)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


class ToolParser:
    """One format of tool calls in an answer. A format says where its calls begin (``_start``), how
    far content may stream before a call has begun (``_content_end``) and reads the calls from there
    (``_calls``); ``scan`` puts them together for a whole answer (``final``) or one being streamed."""

    name: ClassVar[str]
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    reads_special_tokens: ClassVar[bool] = False  # its markers are special tokens: the text must keep them

    def scan(self, text: str, final: bool) -> ParsedCalls:
        """The answer ``text`` read so far (``final``: it is complete, so held-back content is content
        and an answer without calls is all content)."""
        start = self._start(text)
        if start is not None:
            calls = self._calls(text, start[1])
            if calls or not final:
                return ParsedCalls(text[:start[0]], tuple(calls))
        return ParsedCalls(text if final else text[:self._content_end(text)], ())

    def new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def _start(self, text: str) -> tuple[int, int] | None:
        """(where the content ends, where the calls begin), None while no call has begun."""
        raise NotImplementedError

    def _content_end(self, text: str) -> int:
        return len(text)

    def _calls(self, text: str, i: int) -> list[PartialCall]:
        raise NotImplementedError

    def _array(self, text: str, i: int) -> list[PartialCall]:
        """The calls of a JSON array ``[{...}, {...}]`` at ``text[i]``."""
        if text[i:i + 1] != "[":
            return []
        return self._separated(text, _skip(text, i + 1), ",")

    def _separated(self, text: str, i: int, separator: str) -> list[PartialCall]:
        """The call objects from ``text[i]`` on, ``separator`` between them (the last may be partial)."""
        calls = []
        while True:
            scan = _scan_call(text, i, self.argument_keys)
            calls += [scan.call] if scan.call else []
            if scan.end is None:
                return calls
            i = _skip(text, scan.end)
            if text[i:i + 1] != separator:
                return calls
            i = _skip(text, i + 1)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    OPEN = "<tool_call>"

    def _start(self, text):
        at = text.find(self.OPEN)
        return None if at < 0 else (at, at)

    def _content_end(self, text):
        return len(text) - _longest_tail_prefix(text, self.OPEN)

    def _calls(self, text, at):
        calls = []
        while at >= 0:
            scan = _scan_call(text, _skip(text, at + len(self.OPEN)), self.argument_keys)
            calls += [scan.call] if scan.call else []
            if scan.end is None and not scan.malformed:
                return calls  # still being written
            at = text.find(self.OPEN, at + len(self.OPEN) if scan.end is None else scan.end)
        return calls


class Llama3JsonParser(ToolParser):
    """An answer that is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, after an
    optional ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3's JSON tool calling; calls only at the start)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def _start(self, text):
        begin = _skip(text, 0)
        if text.startswith(self.PYTHON_TAG, begin):
            return 0, _skip(text, begin + len(self.PYTHON_TAG))
        return (0, begin) if text.startswith("{", begin) else None

    def _content_end(self, text):
        rest = text.lstrip()
        return 0 if self.PYTHON_TAG.startswith(rest) else len(text)  # "" too: a call may begin yet

    def _calls(self, text, i):
        return self._separated(text, i, ";")


class MistralParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo) or, from the
    v11 tokenizers on, ``[TOOL_CALLS]name[ARGS]{...}`` (``[ARGS]`` optional) per call. ``[TOOL_CALLS]``
    and ``[ARGS]`` are special tokens of Mistral's tokenizers, so the server decodes an answer read by
    this parser with its special tokens (as vLLM's parser asks); an answer beginning with ``[`` is read
    as the array too (a client that decoded it without them). Ids are 9 letters and digits, which
    Mistral's chat templates require."""

    name = "mistral"
    reads_special_tokens = True
    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
    argument_keys = ("arguments",)
    FUNCTION = re.compile(r"[A-Za-z0-9_-]+")

    def _start(self, text):
        at = text.find(self.BOT)
        if at >= 0:
            return at, _skip(text, at + len(self.BOT))
        begin = _skip(text, 0)
        return (0, begin) if text.startswith("[", begin) else None

    def _content_end(self, text):
        if not text.strip():
            return 0
        return len(text) - _longest_tail_prefix(text, self.BOT)

    def _calls(self, text, i):
        if self.ARGS.startswith(text[i:i + len(self.ARGS)]):
            return []  # "[", "[A", ...: which form is not known yet
        if text.startswith("[", i):
            return self._array(text, i)
        calls = []
        while True:
            match = self.FUNCTION.match(text, i)
            if match is None:
                return calls
            at = match.end() + len(self.ARGS) if text.startswith(self.ARGS, match.end()) else match.end()
            if not text.startswith("{", at):
                return calls  # the name may go on (or the call is malformed)
            end = _value_end(text, at)
            calls.append(PartialCall(match.group(), text[at:] if end is None else text[at:end]))
            following = -1 if end is None else text.find(self.BOT, end)
            if following < 0:
                return calls
            i = _skip(text, following + len(self.BOT))

    def new_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class RequiredCalls(ToolParser):
    """``tool_choice: "required"``: the answer is the array of vLLM's schema, ``[{"name": ...,
    "parameters": {...}}, ...]`` (no content)."""

    name = "required"
    argument_keys = ("parameters",)

    def _start(self, text):
        return 0, _skip(text, 0)

    def _calls(self, text, i):
        return self._array(text, i)


@dataclass(frozen=True)
class NamedCall(ToolParser):
    """A named ``tool_choice``: the whole answer is the arguments of function ``function``."""

    function: str
    name: ClassVar[str] = "named"

    def scan(self, text, final):
        return ParsedCalls("", (PartialCall(self.function, text),))


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser of vLLM's ``--tool-call-parser`` name; ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def parser_for_template(template: str | dict | None) -> str:
    """The tool-call parser a chat template's format calls for (``hermes`` when it says nothing); a
    tokenizer's named templates (a dict, as Hermes 2 Pro's ``"tool_use"``) are read together."""
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    template = template if isinstance(template, str) else ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def parse_calls(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool calls)`` of a whole answer (calls as OpenAI's message ``tool_calls``)."""
    parsed = parser.scan(text, final=True)
    return parsed.content or None, [{"id": parser.new_id(), "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]


@dataclass
class ToolCallStream:
    """One streamed choice's tool calls: ``feed`` each piece's text, ``finish`` at its end; each
    returns ``(content delta, tool_call deltas)`` as OpenAI's chunks carry them (see the module's
    docstring): they add up to ``parse_calls`` of the whole text."""

    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)  # of the calls whose header went out
    arguments_sent: list[int] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.ids)

    def feed(self, piece: str) -> tuple[str | None, list[dict]]:
        # The whole text is scanned again for each piece, so the stream reads exactly what the whole
        # answer's parse reads; the scan is regex-driven (about 0.1 ms a piece for a 4k-character call).
        self.text += piece
        return self._deltas(self.parser.scan(self.text, final=False))

    def finish(self) -> tuple[str | None, list[dict]]:
        return self._deltas(self.parser.scan(self.text, final=True))

    def _deltas(self, parsed: ParsedCalls) -> tuple[str | None, list[dict]]:
        content = parsed.content[self.content_sent:] or None
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            piece = call.arguments[self.arguments_sent[i]:] if i < len(self.ids) else call.arguments
            if i == len(self.ids):
                self.ids.append(self.parser.new_id())
                self.arguments_sent.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": piece}})
            elif piece:
                deltas.append({"index": i, "function": {"arguments": piece}})
            self.arguments_sent[i] = len(call.arguments)
        return content, deltas
