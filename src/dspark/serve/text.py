"""Token ids to text, incrementally, with stop strings.

``IncrementalDetokenizer`` decodes a short window of ids (the last few of the prompt, then the
output) so a token's text is what it adds in context (SentencePiece's leading spaces), and holds
back a token whose text ends in U+FFFD: byte-level tokenizers split a UTF-8 character across tokens
and the replacement character means its bytes are not all there yet.

``TextOutput`` adds stop strings on top: the text is searched as it grows (a token at a time, so the
output ends at the token that completes the stop string); at a match the output ends just before
the stop string. Text that could be the start of a stop string is held back until the next token
shows it is not.
"""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded with the output (as vLLM's incremental detokenizer)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(token_ids) -> str``: the text the tokens complete (may be empty); ``flush()`` the rest."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if self._decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character
            context = []
        self.ids = context
        self.prefix, self.read = 0, len(context)  # the window's start; the end of the text returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

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
    releases what was held back once generation ended for another reason.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = [s for s in stop if s]
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
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            end, self.stopped = min(hits)
            released, self.pending = self.pending[:end], ""
            return released
        cut = max(len(self.pending) - self.hold, 0)
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released
