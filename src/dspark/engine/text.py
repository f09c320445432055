"""Token ids to text, incrementally, with stop strings: the one text stream of the server, the
Python API and the CLI.

``IncrementalDetokenizer`` decodes a short window of ids (the last few of the prompt, then the
output) so a token's text is what it adds in context (SentencePiece's leading spaces), and holds
back a token whose text ends in U+FFFD: byte-level tokenizers split a UTF-8 character across tokens
and the replacement character means its bytes are not all there yet.

``TextOutput`` adds stop strings on top: the text is searched as it grows (a token at a time, so the
output ends at the token that completes the stop string) once more than the request's
``min_tokens`` tokens were generated (vLLM's rule); at a match the output ends just before the stop
string. Text that could be the start of a stop string is held back until the next token
shows it is not. ``TextStream`` is what the Python API and the CLI keep per request on top: the
text so far and the output tokens up to the one that completed a stop string.
"""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded with the output (as vLLM's incremental detokenizer)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(token_ids) -> str``: the text the tokens complete (may be empty); ``flush()`` the rest.
    ``skip_special_tokens`` False keeps the special tokens' text (a tool-call marker, say)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if self._decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character
            context = []
        self.ids = context
        self.prefix, self.read = 0, len(context)  # the window's start; the end of the text returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(done) or text.endswith(REPLACEMENT)):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]


class TextOutput:
    """The output text of one request: ``add`` an engine step's tokens, get the text released now.

    ``stopped`` is the stop string that ended the text (then no more text comes); ``flush()``
    releases what was held back once generation ended for another reason. No stop string ends the
    first ``min_tokens`` tokens.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], min_tokens: int = 0,
                 skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.min_tokens, self.tokens = min_tokens, 0
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # decoded, not released: could still begin a stop string
        self.stopped: str | None = None

    def add(self, token_ids: list[int]) -> tuple[str, int]:
        """(text released, tokens used): with stop strings a token at a time, so the tokens after
        the one that completes a stop string are left out; otherwise all in one decode."""
        if not self.stop:
            return self._grow(self.detok.add(token_ids)), len(token_ids)
        text = ""
        for used, token in enumerate(token_ids, 1):
            self.tokens += 1
            text += self._grow(self.detok.add([token]))
            if self.stopped is not None:
                return text, used
        return text, len(token_ids)

    def flush(self) -> str:
        released = self._grow(self.detok.flush())
        if self.stopped is not None:
            return released
        rest, self.pending = self.pending, ""
        return released + rest

    def _grow(self, piece: str) -> str:
        # Released text held no stop string and the last ``hold`` characters were kept back, so a
        # stop string can only lie inside ``pending``.
        if self.stopped is not None or not piece:
            return ""
        self.pending += piece
        searched = self.tokens > self.min_tokens
        hits = [(i, s) for s in self.stop if searched and (i := self.pending.find(s)) >= 0]
        if hits:
            end, self.stopped = min(hits)
            released, self.pending = self.pending[:end], ""
            return released
        cut = max(len(self.pending) - self.hold, 0)
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released


class TextStream:
    """One request's text for ``generate``: a ``TextOutput`` plus what its ``GenerationResult``
    needs -- ``text`` so far and ``stop_tokens``, the output tokens up to the one that completed a
    stop string (None before one). A stop token (``stop_ids``) that ends the output is no text, as
    in the server."""

    def __init__(self, tokenizer, prompt_ids, stop=(), min_tokens: int = 0, stop_ids=()):
        self.output = TextOutput(tokenizer, list(prompt_ids), list(stop), min_tokens)
        self.stop_ids = frozenset(stop_ids)
        self.ids: list[int] = []
        self.text, self.emitted = "", 0
        self.stop_tokens: int | None = None
        self._flushed = False

    def add(self, tokens: list[int]) -> bool:
        """Append a round's tokens; True once the text holds a stop string (the request should end)."""
        if self.stop_tokens is None:
            ended = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
            released, used = self.output.add(list(tokens[:ended]))
            if used == ended < len(tokens):  # the stop token itself: kept as a token, not as text
                used += 1
            self.ids.extend(tokens[:used])
            self.text += released
            if self.output.stopped is not None:
                self.stop_tokens = len(self.ids)
        return self.stop_tokens is not None

    def take(self, *, final: bool = False) -> str:
        """The text released since the last call (with ``final`` also what was held back)."""
        if final:
            self._flush()
        new, self.emitted = self.text[self.emitted:], len(self.text)
        return new

    def finish(self, result) -> None:
        """Set ``result.text``; after a stop string also cut ``result.token_ids`` and mark it ``"stop"``."""
        if not self.ids and result.token_ids:  # nothing was streamed: decode once
            self.add(result.token_ids)
        self._flush()
        if self.stop_tokens is not None:
            result.token_ids = result.token_ids[:self.stop_tokens]
            result.finish_reason = "stop"
        result.text = self.text

    def _flush(self) -> None:
        if not self._flushed:
            self.text += self.output.flush()
            self._flushed = True
