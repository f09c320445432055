"""Tool calls on chat completions (OpenAI's ``tools`` / ``tool_choice``, as vLLM serves them).

``tool_choice``:

* ``"none"``: the tools go to the chat template, the output is plain text;
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's ``parameters``
  schema (a structured output) and returned as one call of N, its text the ``arguments``;
* ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one
  of the tools each (vLLM's schema), returned as those calls;
* ``"auto"`` (the default with tools): the output is free; calls the model writes in the Hermes /
  Qwen format -- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Qwen3 family's
  template -- are parsed out, the text before the first one is the ``content``.

An answer with calls has finish reason ``"tool_calls"`` (when it ended by itself); streamed, each call
comes as OpenAI streams it: a delta with its ``index``, ``id``, ``type`` and ``function.name``, then
``function.arguments`` pieces.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCallStream", "ToolChoice", "parse_hermes_calls"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)


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

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool calls)`` of a whole answer (calls as OpenAI's message ``tool_calls``)."""
        if self.mode == "named":
            return None, [tool_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short (length): no call to return
            return None, [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        if self.mode == "auto":
            return parse_hermes_calls(text)
        return text, []


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a Hermes / Qwen answer: each ``<tool_call>{"name", "arguments"}
    </tool_call>`` block whose body is such a JSON object is a call; the text before the first block is
    the content (None when empty). Without a parsable block the whole text is the content."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(tool_call(call["name"], arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


@dataclass
class ToolCallStream:
    """One streamed choice's tool calls: ``feed`` each piece's text, ``finish`` at its end; each
    returns ``(content delta, tool_call deltas)`` as OpenAI's chunks carry them. A named call streams
    its arguments as they come; ``required`` and ``auto`` calls come when the answer is complete
    (``auto`` streams the content before a ``<tool_call>``, holding back what may begin one)."""

    choice: ToolChoice
    text: str = ""
    sent: int = 0  # content characters streamed (auto / none)
    calls: int = 0  # calls streamed
    call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def feed(self, piece: str) -> tuple[str | None, list[dict]]:
        self.text += piece
        mode = self.choice.mode
        if mode == "named":
            deltas = [{"index": 0, "function": {"arguments": piece}}] if piece else []
            if self.calls == 0:
                self.calls = 1
                deltas = [{"index": 0, "id": self.call_id, "type": "function",
                           "function": {"name": self.choice.name, "arguments": piece}}]
            return None, deltas
        if mode == "required":
            return None, []
        return self._content(self._safe_end()), []

    def finish(self) -> tuple[str | None, list[dict]]:
        mode = self.choice.mode
        if mode == "named":
            return None, []
        content, calls = self.choice.parse(self.text)
        if not calls:
            return self._content(len(self.text)), []
        deltas = []
        for i, call in enumerate(calls):
            deltas.append({"index": i, "id": call["id"], "type": "function",
                           "function": {"name": call["function"]["name"], "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call["function"]["arguments"]}})
        self.calls = len(calls)
        return None, deltas

    def _safe_end(self) -> int:
        """How far the content may stream: up to a ``<tool_call>``, or up to a tail that may begin one."""
        at = self.text.find(TOOL_CALL_OPEN)
        if at >= 0:
            return at
        for keep in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def _content(self, end: int) -> str | None:
        if end <= self.sent:
            return None
        piece, self.sent = self.text[self.sent:end], end
        return piece
