"""Token ids to text, incrementally, with stop strings.

``IncrementalDetokenizer`` decodes a short window of ids (the last few of the prompt, then the
output) so a token's text is what it adds in context (SentencePiece's leading spaces), and holds
back a token whose text ends in U+FFFD: byte-level tokenizers split a UTF-8 character across tokens
and the replacement character means its bytes are not all there yet.

``TextOutput`` adds stop strings on top: the text is searched as it grows; at a match the output
ends just before the stop string. Text that could be the start of a stop string is held back until
the next token shows it is not.
"""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded with the output (as vLLM's incremental detokenizer)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(token_id) -> str``: the text the token completes (may be empty); ``flush()`` the rest."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if self._decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character
            context = []
        self.ids = context
        self.prefix, self.read = 0, len(context)  # the window's start; the end of the text returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
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
    """The output text of one request: ``add`` a token, get the text released now.

    ``stopped`` is the stop string that ended the text (then no more text comes); ``flush()``
    releases what was held back once generation ended for another reason.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far (up to a stop string)
        self.sent = 0  # characters of ``text`` released
        self.stopped: str | None = None

    def add(self, token_id: int) -> str:
        return self._grow(self.detok.add(token_id))

    def flush(self) -> str:
        released = self._grow(self.detok.flush())
        if self.stopped is not None:
            return released
        rest, self.sent = self.text[self.sent:], len(self.text)
        return released + rest

    def _grow(self, piece: str) -> str:
        if self.stopped is not None or not piece:
            return ""
        start = max(len(self.text) - self.hold, 0)  # a stop string may begin in the held-back tail
        self.text += piece
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            end, self.stopped = min(hits)
            self.text = self.text[:end]
            end = len(self.text)
        else:
            end = len(self.text) - self.hold
        released = self.text[self.sent:max(end, self.sent)]
        self.sent += len(released)
        return released
