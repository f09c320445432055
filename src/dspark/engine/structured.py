"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, one
of a few strings or an EBNF grammar (xgrammar: its ``GrammarCompiler`` builds the token automaton,
its ``GrammarMatcher`` tracks one request's state and fills token bitmasks).

How a grammar stays exact under speculative decoding (docs/structured-outputs.md): each round the
host advances the request's matcher through the round's drafts, one bitmask row per verify position
(the state after the drafts before it), and rolls it back, all rows at once; a row's drafts are cut
after the first one the grammar refuses (that one is verified and rejected by its mask: a sampled
row's residual draw keeps sampling exact, a greedy row takes the masked argmax there), with no
device work beyond the round's one draft read, and a tree's nodes are masked by the state after
their paths, refused nodes cut with their subtrees (tree acceptance reads no draft distribution). The rows are staged into the runner's fixed ``[rows, verify_len, ceil(V / 32)]`` int32
buffer (all ones for a free row) and the target's logits at every verify position are masked before
acceptance, so greedy takes the masked argmax and speculative sampling reproduces the masked
distribution. After the round the matcher takes the committed tokens. The drafter is masked where the
state is known before drafting: its first position (the state after the committed tokens) and the
positions after a forced run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..kernels._validate import Checker

__all__ = ["FREE_MASK", "GrammarRow", "GrammarStager", "Grammars", "RequestGrammar", "StructuredOutputs",
           "StructuredStage", "TreeWalk", "Windows", "apply_bitmask", "bitmask_width", "fill_draft_masks",
           "only_tokens", "walk_tree", "walk_windows"]

FREE_MASK = -1  # an int32 bitmask word with every bit set: every token allowed (a free row's mask)
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match -- exactly one of: ``json`` a JSON schema (its text or a
    dict), ``json_object`` True (any JSON object), ``regex`` (xgrammar's regex dialect), ``choice``
    (one of these strings, a tuple), ``grammar`` (EBNF, xgrammar's dialect). A dict schema is kept as
    its compact JSON text (key order kept), so equal specs share one compiled grammar."""

    json: str | Mapping | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputs: exactly one of json, json_object, regex, choice, grammar must be "
                             f"set, got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"StructuredOutputs: json_object must be a bool, got {type(self.json_object).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"StructuredOutputs: {name} must be a non-empty string, got {value!r:.60}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is (the field that is set)."""
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))


def _schema_text(schema) -> str:
    """A JSON schema as canonical text: a dict (or a JSON text of one) sorted and compact."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"StructuredOutputs: json must be a JSON schema, got text that is not JSON ({exc})") from None
    if not isinstance(schema, (Mapping, bool)):
        raise TypeError(f"StructuredOutputs: json must be a JSON schema (a dict or its text), got "
                        f"{type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))  # key order kept: it is the properties' order


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (tuple, list)):
        raise TypeError(f"StructuredOutputs: choice must be a list of strings, got {type(choice).__name__}")
    if not choice or not all(isinstance(c, str) and c for c in choice):
        raise ValueError(f"StructuredOutputs: choice must be a non-empty list of non-empty strings, got {list(choice)!r:.80}")
    return tuple(choice)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one bitmask row over a ``vocab_size``-token vocabulary: ceil(V / 32)."""
    return -(-vocab_size // 32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set f32 ``logits`` ``[R, V]`` to -inf in place where int32 ``bitmask`` ``[R, ceil(V / 32)]``
    has a 0 bit (xgrammar's kernel: Triton on CUDA, C++ on the CPU). Fixed shapes, no host
    synchronisation: capturable."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


class Grammars:
    """Compiled grammars of one engine: ``tokenizer`` (Hugging Face) over the model's ``vocab_size``
    logits (ids past the tokenizer's are never allowed), ``stop_ids`` the tokens that end a finished
    grammar (the model's EOS). xgrammar's compiler caches each spec's grammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        import xgrammar as xgr

        self.vocab_size, self.width = vocab_size, bitmask_width(vocab_size)
        self.stop_ids = sorted(stop_ids)
        if not self.stop_ids:  # a grammar is complete when it takes a stop token
            raise ValueError("structured_outputs need the target's end-of-sequence token id, and it has none")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutputs):
        """``spec``'s compiled grammar; ValueError naming the field and the problem when it cannot
        compile."""
        c, kind = self.compiler, spec.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_grammar(_json_grammar(spec.json if kind == "json" else '{"type": "object"}'))
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":  # EBNF string literals take JSON's escapes
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            return c.compile_grammar(spec.grammar)
        except Exception as exc:  # noqa: BLE001 -- xgrammar raises RuntimeError / ValueError / its own
            raise ValueError(f"structured_outputs: the {kind} cannot be compiled: {_first_line(exc)}") from None

    def matcher(self, spec: StructuredOutputs) -> "RequestGrammar":
        """A fresh matcher of ``spec`` for one request."""
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self.stop_ids)


# xgrammar 0.2.9 writes a string bounded by minLength / maxLength as characters of this class, which
# lets raw control characters (U+0000-U+001F) in: JSON forbids them, strict parsers refuse the output
_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str) -> str:
    """The EBNF of ``schema`` (compact JSON, xgrammar's converter), its bounded strings' characters
    kept to what JSON allows unescaped."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def only_tokens(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """The one token each int32 bitmask row of ``rows`` ``[n, width]`` (host, numpy) allows, -1
    where it allows none or several: int64 ``[n]``, vectorised over the rows (no per-row Python)."""
    words = rows.view(np.uint32)
    tail = np.uint32((1 << (vocab_size % 32)) - 1) if vocab_size % 32 else np.uint32(0xFFFFFFFF)
    last = words[:, -1] & tail  # bits past the vocabulary in the last word are not tokens
    counts = np.count_nonzero(words[:, :-1], axis=1) + (last != 0)
    tokens = np.full(len(words), -1, dtype=np.int64)
    one = np.flatnonzero(counts == 1)
    if one.size:
        picked = words[one].copy()
        picked[:, -1] &= tail
        row, column = np.nonzero(picked)  # one nonzero word per picked row, rows in order
        word = picked[row, column].astype(np.int64)
        single = word & (word - 1) == 0  # one bit set
        bit = np.log2(np.where(single, word, 1)).astype(np.int64)  # exact for powers of two
        tokens[one[single]] = column[single] * 32 + bit[single]
    return tokens


class RequestGrammar:
    """One request's grammar state (an xgrammar ``GrammarMatcher``) over a ``vocab_size``-token model
    and the bitmask rows the engine stages for it: int32 ``[*, ceil(V / 32)]`` host tensors.
    ``stop_ids``: the tokens that end a complete grammar -- the matcher terminates when it takes
    one and only then, so the walks test the tokens they take rather than ask the matcher."""

    def __init__(self, matcher, vocab_size: int, stop_ids):
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, frozenset(stop_ids)
        self.ahead: list[int] = []  # tokens taken before their commit (``take_ahead``)

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and took its stop token: the output ends."""
        return self.matcher.is_terminated()

    def only_token(self, row: torch.Tensor) -> int | None:
        """The one token an int32 bitmask row ``[width]`` allows, or None (none or several)."""
        token = int(only_tokens(row[None].numpy(), self.vocab_size)[0])
        return None if token < 0 else token

    def next_mask(self, out: torch.Tensor) -> None:
        """Fill ``out`` int32 ``[width]`` with the bitmask after the committed tokens (every bit
        set once the grammar has terminated: nothing follows)."""
        if self.matcher.is_terminated():
            out[:] = FREE_MASK
        else:
            self.matcher.fill_next_token_bitmask(out[None], 0)

    def take_ahead(self, tokens: list[int]) -> None:
        """Take a step's ``tokens`` before the engine commits them (the drafter's masks are the
        states after them), up to a stop token the grammar takes or a token it refuses; ``advance``
        then takes only what the commit adds to them."""
        if self.ahead:  # a step that took tokens ahead and never committed them
            self.matcher.rollback(len(self.ahead))
        taken = 0
        if not self.matcher.is_terminated():
            for token in tokens:
                if not self.matcher.accept_token(token):
                    break
                taken += 1
                if token in self.stop_ids:  # the grammar terminated: nothing follows
                    break
        self.ahead = list(tokens[:taken])

    def advance(self, tokens: list[int]) -> bool:
        """Take committed ``tokens``; returns whether the grammar terminated. Tokens taken ahead
        (``take_ahead``) are not taken again: past the commit's prefix of them (an output can end
        inside a step) they are rolled back. A token the grammar refuses raises: verification never
        commits one."""
        ahead, self.ahead = self.ahead, []
        if ahead:
            tokens = list(tokens)
            same = len(ahead) if tokens[:len(ahead)] == ahead else next(  # where the commit leaves them
                i for i, (taken, kept) in enumerate(zip(ahead, tokens + [None])) if taken != kept)
            if same < len(ahead):
                self.matcher.rollback(len(ahead) - same)
            tokens = tokens[same:]
        for token in tokens:
            if self.matcher.is_terminated():
                return True
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused committed token {token}: a verify row's mask was wrong")
        return self.matcher.is_terminated()


def _accept(matchers: list, tokens: np.ndarray) -> np.ndarray:
    """Each of ``matchers`` takes its token of ``tokens``; bool ``[n]``: which did. One
    ``accept_token`` call per matcher: xgrammar's ``batch_accept_token`` hands its booleans back
    through an FFI array read item by item, which made it 3-4x slower (about 200 us for 64 matchers
    against 40-60 us, on this project's CPU)."""
    return np.fromiter((m.accept_token(t) for m, t in zip(matchers, tokens.tolist())), dtype=bool,
                       count=len(matchers))


def _rollback(matchers: list, counts: np.ndarray) -> None:
    """``matchers[i]`` rolled back by ``counts[i]`` tokens (one xgrammar call over those with any)."""
    import xgrammar as xgr

    some = np.flatnonzero(counts)
    if some.size:
        xgr.BatchGrammarMatcher.batch_rollback([matchers[i] for i in some], counts[some].tolist())


def _stop_ids(grammars: list[RequestGrammar]) -> np.ndarray:
    """The stop tokens of ``grammars`` (one engine's: the same for all), int64."""
    return np.array(sorted(grammars[0].stop_ids) if grammars else [], dtype=np.int64)


def _stops(tokens: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Which of ``tokens`` are stop tokens, bool (a comparison per stop id: ``np.isin`` costs ~40 us
    a call however few the tokens)."""
    return (tokens[:, None] == stops[None, :]).any(axis=1)


def _not_terminated(matchers: list, requests: np.ndarray) -> np.ndarray:
    """The ``requests`` (indices into ``matchers``) whose grammar has not terminated."""
    return requests[[not matchers[i].is_terminated() for i in requests.tolist()]]


@dataclass(frozen=True)
class Windows:
    """The verify windows' grammar walk of n requests: ``valid`` int64 ``[n]``, the drafts each
    grammar takes (forced ones included); the forced drafts -- the only token a position's mask
    allows, which replaces a draft the grammar refuses there -- as ``forced_requests``,
    ``forced_positions`` and ``forced_tokens``, int64 ``[f]`` each."""

    valid: np.ndarray
    forced_requests: np.ndarray
    forced_positions: np.ndarray
    forced_tokens: np.ndarray


def walk_windows(grammars: list[RequestGrammar], drafts: np.ndarray, lengths: np.ndarray, masks: torch.Tensor,
                 first_rows: np.ndarray, batch) -> Windows:
    """Each request's verify window: row ``first_rows[i] + j`` of ``masks`` (int32 ``[R, width]``,
    host) becomes request i's bitmask after its committed tokens and its first j drafts (``drafts``
    int64 ``[n, P]``, the first ``lengths[i]`` of row i drafted), for each j up to its grammar-valid
    prefix; rows after it are left as they are (no token is taken from them: they follow a refused
    draft, which the caller's cut keeps last). A position whose mask allows one token only takes that token in place
    of a refused draft (``Windows.forced_tokens``): the target's masked distribution there is that token
    alone, so it is accepted whatever was drafted. Position by position, the masks of every request
    still walking are filled at once (``batch``: a ``MaskFiller``), the drafts checked against them
    as arrays and taken in one xgrammar call; the matchers are rolled back (one call). No device
    work: a round's walk costs no host<->device round trip."""
    n, vocab, stops = len(grammars), (grammars[0].vocab_size if grammars else 0), _stop_ids(grammars)
    matchers = [g.matcher for g in grammars]
    drafts, first_rows = np.array(drafts, dtype=np.int64), np.asarray(first_rows, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    words = masks.numpy().view(np.uint32)
    valid = np.zeros(n, dtype=np.int64)
    forced: list[tuple[np.ndarray, int, np.ndarray]] = []
    walking, j = np.arange(n), 0
    while walking.size:
        rows = first_rows[walking] + j
        batch.batch_fill_next_token_bitmask([matchers[i] for i in walking], masks, rows.tolist())
        drafting = lengths[walking] > j
        walking, rows = walking[drafting], rows[drafting]
        if not walking.size:
            break
        tokens = drafts[walking, j]
        allowed = ((words[rows, tokens >> 5] >> (tokens & 31).astype(np.uint32)) & 1).astype(bool)
        refused = np.flatnonzero(~allowed)
        if refused.size:
            only = only_tokens(words[rows[refused]], vocab)
            put = refused[only >= 0]
            forced.append((walking[put], j, only[only >= 0]))
            drafts[walking[put], j] = tokens[put] = only[only >= 0]
            allowed[put] = True
        walking, tokens = walking[allowed], tokens[allowed]
        took = _accept([matchers[i] for i in walking], tokens)
        walking, tokens = walking[took], tokens[took]
        valid[walking] += 1
        walking = walking[~_stops(tokens, stops)]  # a stop token ends the output: no row follows it
        j += 1
    _rollback(matchers, valid)
    empty = np.zeros(0, dtype=np.int64)
    requests = np.concatenate([f[0] for f in forced]) if forced else empty
    positions = np.concatenate([np.full(len(f[0]), f[1], dtype=np.int64) for f in forced]) if forced else empty
    tokens = np.concatenate([f[2] for f in forced]) if forced else empty
    return Windows(valid, requests, positions, tokens)


def fill_draft_masks(grammars: list[RequestGrammar], tokens: list[list[int]], masks: torch.Tensor,
                     first_rows: np.ndarray, positions: int, batch, stale: np.ndarray | None = None) -> np.ndarray:
    """The drafter's masks after each request's ``tokens[i]`` more, which the matchers take ahead of
    their commit (``RequestGrammar.take_ahead``; the engine's commit then does not take them again):
    row ``first_rows[i] + j`` of ``masks`` (int32 ``[R, width]``, host), j < ``positions``, becomes
    draft position j's mask where the grammar's state there is known before drafting -- position
    0's (the state after ``tokens[i]``), and while a position's mask allows one token only (a
    forced run), the next one's after it -- and every bit set after that (the state depends on
    what is drafted) or once the grammar has terminated. ``stale`` int64 ``[n]``: how many leading
    rows of request i's may hold a mask (what this returned for those rows last time); the rows
    past it hold every bit already and are not written again (default: all ``positions``). All
    requests at once, position by position (``batch``: a ``MaskFiller``), the forced runs' tokens
    rolled back. Returns ``known`` int64 ``[n]``: the leading positions given a mask."""
    n, vocab, stops = len(grammars), (grammars[0].vocab_size if grammars else 0), _stop_ids(grammars)
    matchers = [g.matcher for g in grammars]
    first_rows = np.asarray(first_rows, dtype=np.int64)
    for grammar, new in zip(grammars, tokens):
        grammar.take_ahead(new)
    forced = np.zeros(n, dtype=np.int64)
    words = masks.numpy().view(np.uint32)
    known = np.zeros(n, dtype=np.int64)  # leading positions with a mask of their own
    live = _not_terminated(matchers, np.arange(n))
    for j in range(positions):
        if not live.size:
            break
        rows = first_rows[live] + j
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], masks, rows.tolist())
        known[live] = j + 1
        if j == positions - 1:
            break
        only = only_tokens(words[rows], vocab)
        live, only = live[only >= 0], only[only >= 0]
        took = _accept([matchers[i] for i in live], only)
        live, only = live[took], only[took]
        forced[live] += 1
        live = live[~_stops(only, stops)]  # a forced stop token: nothing follows
    stale = np.full(n, positions, dtype=np.int64) if stale is None else np.asarray(stale, dtype=np.int64)
    position = np.arange(positions)[None, :]
    request, position = np.nonzero((position >= known[:, None]) & (position < stale[:, None]))  # [n, positions]
    words[first_rows[request] + position] = np.uint32(0xFFFFFFFF)
    _rollback(matchers, forced)
    return known


@dataclass(frozen=True)
class TreeWalk:
    """A token tree cut to what its grammar takes: the kept nodes, root first, in the tree's order
    (parents before children). ``source``: each kept node's index in the drafted tree; ``tokens``
    (a forced token in place of the drafter's), ``parents`` (kept indices; -1 for the root) and
    ``depths`` per kept node; ``forced``: drafted index -> the only token its parent's mask allows,
    where no child had drafted it."""

    source: list[int]
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    forced: dict[int, int]

    def layout(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cut tree as the runner's tree rows of ``size`` node slots: ``(tokens int32, parents
        int32, depths int32, ancestor_bits int64)``, each ``[size]``; unused slots as the builder leaves
        them (the root's token, parent -1, depth 0, their own bit)."""
        n = len(self.source)
        tokens = torch.full((size,), self.tokens[0], dtype=torch.int32)
        parents = torch.full((size,), -1, dtype=torch.int32)
        depths = torch.zeros(size, dtype=torch.int32)
        tokens[:n], parents[:n], depths[:n] = (torch.tensor(v, dtype=torch.int32)
                                               for v in (self.tokens, self.parents, self.depths))
        bits = [1 << i for i in range(size)]
        for i in range(1, n):  # parents come first: a node's mask is its parent's plus itself
            bits[i] |= bits[self.parents[i]]
        return tokens, parents, depths, torch.tensor(bits, dtype=torch.int64)


def walk_tree(grammar: RequestGrammar, tokens: list[int], parents: list[int], depths: list[int],
              masks: torch.Tensor) -> TreeWalk:
    """One request's drafted tree (``tokens`` / ``parents`` / ``depths`` of its nodes, node 0 the
    root: the anchor, whose state the matcher holds) walked down every path: ``masks`` int32
    ``[>= len(tokens), width]`` (host) row i becomes node i's bitmask -- the grammar's state after the
    tokens of its path below the root, what the target's logits at node i are masked with. A node the
    grammar refuses is cut with its subtree, and so is everything after a stop token the grammar
    takes (the output ends there). Where a node's mask allows one token only and no child drafted
    it, its first child takes it (``TreeWalk.forced``; the target's masked distribution there is that
    token alone). The matcher is rolled back. Rows of cut nodes are left as they are.

    Cutting a refused node is exact, greedy and sampled: its masked target probability is 0, so the
    greedy walk never follows it, and the sampled walk (``K.sampled_tree_accept``, which tests fixed
    candidates against the target and never reads a draft distribution) accepts it with probability
    0 and removes no mass from its later siblings' tests."""
    children: list[list[int]] = [[] for _ in tokens]
    for node in range(1, len(tokens)):
        children[parents[node]].append(node)
    tokens, kept, forced = list(tokens), [0], {}
    matcher = grammar.matcher

    def visit(node: int) -> None:
        grammar.next_mask(masks[node])
        if grammar.terminated:  # this node took the stop token: nothing after it is output
            return
        only, kids = grammar.only_token(masks[node]), children[node]
        if only is not None and kids and all(tokens[c] != only for c in kids):
            forced[kids[0]] = tokens[kids[0]] = only
        for child in kids:
            if matcher.accept_token(tokens[child]):
                kept.append(child)
                visit(child)
                matcher.rollback(1)

    visit(0)
    kept.sort()
    index = {old: new for new, old in enumerate(kept)}
    return TreeWalk(kept, [tokens[i] for i in kept], [-1] + [index[parents[i]] for i in kept[1:]],
                    [depths[i] for i in kept], forced)


@dataclass(frozen=True)
class GrammarRow:
    """A constrained request in a step: its batch ``row``, its grammar and whether the step commits
    new tokens for it (a preempted request seated again keeps its committed anchor: none)."""

    row: int
    grammar: RequestGrammar
    commits: bool = True


class MaskFiller:
    """Fills many requests' bitmasks at once (xgrammar's ``BatchGrammarMatcher``): on one thread
    unless that is expected to take more than ``PARALLEL_AFTER_S`` -- the measured seconds per mask
    of its one-thread calls times the masks asked for -- and in parallel threads then. Waking
    threads costs more than a schema's masks take: on this project's 2-core machine a JSON-schema
    mask at a 152k vocabulary takes 1-4 us on one thread (4 on average over a customer record), while a threaded call took
    74 us for one matcher (up to 2.6 ms) and 99 us for 16 against 14 us on one thread; a verify
    window asks once per position."""

    PARALLEL_AFTER_S = 2e-3

    def __init__(self):
        import xgrammar as xgr

        self.serial, self.parallel = xgr.BatchGrammarMatcher(1), xgr.BatchGrammarMatcher()
        self.seconds_per_mask = 0.0  # of the one-thread calls, a running mean

    def batch_fill_next_token_bitmask(self, matchers: list, masks: torch.Tensor, rows: list[int]) -> None:
        """``matchers[i]``'s next-token bitmask into row ``rows[i]`` of int32 ``masks`` ``[R, width]`` (host)."""
        if len(matchers) * self.seconds_per_mask > self.PARALLEL_AFTER_S:
            self.parallel.batch_fill_next_token_bitmask(matchers, masks, rows)
            return
        start = time.perf_counter()
        self.serial.batch_fill_next_token_bitmask(matchers, masks, rows)
        per_mask = (time.perf_counter() - start) / max(len(matchers), 1)
        self.seconds_per_mask = per_mask if not self.seconds_per_mask else \
            self.seconds_per_mask + 0.1 * (per_mask - self.seconds_per_mask)


class RowSender:
    """Sends chosen rows of a host tensor into the same rows of a device tensor in one copy: a block
    of consecutive rows straight from the host tensor, others gathered into a pinned staging buffer,
    copied, scattered on the device (``index_copy_``), rather than one copy per row. ``host`` ``[R, *shape]`` and ``device`` ``[R, *shape]`` (views allowed); each call
    site has its own sender: a staging buffer is reused only after the step has waited for the
    device, by when its last copy is done."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor):
        self.host, self.device = host, device
        pinned = device.device.type == "cuda"
        self.staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=pinned)
        self.rows = torch.empty(host.shape[0], dtype=torch.long, pin_memory=pinned)
        self.device_staging = torch.empty(host.shape, dtype=host.dtype, device=device.device)
        self.device_rows = torch.empty(host.shape[0], dtype=torch.long, device=device.device)

    def send(self, rows: list[int]) -> None:
        n = len(rows)
        if not n:
            return
        first = rows[0]
        if rows == list(range(first, first + n)):  # a block of rows (every row constrained): copied as it is
            self.device[first:first + n].copy_(self.host[first:first + n], non_blocking=True)
            return
        self.rows[:n] = torch.tensor(rows, dtype=torch.long)
        torch.index_select(self.host, 0, self.rows[:n], out=self.staging[:n])
        self.device_staging[:n].copy_(self.staging[:n], non_blocking=True)
        self.device_rows[:n].copy_(self.rows[:n], non_blocking=True)
        self.device.index_copy_(0, self.device_rows[:n], self.device_staging[:n])


class GrammarStager:
    """The host side of the runner's grammar buffers (``RowState.grammar_mask`` int32
    ``[rows, verify_len, width]``: a verify position's mask; ``RowState.draft_mask``
    ``[rows, N, width]``: the drafter's per block slot, ``draft_slots`` those of the draft positions,
    set where the state is known before drafting): each step fills the constrained rows' masks in
    pinned host copies and sends those rows to the device; a free row keeps every bit set
    (``clear_rows``)."""

    def __init__(self, state, verify_len: int, width: int, draft_slots: slice | None = None):
        self.state, self.verify_len, self.draft_slots = state, verify_len, draft_slots
        rows, device = state.grammar_mask.shape[0], state.grammar_mask.device
        pinned = device.type == "cuda"
        self.verify_masks = torch.full((rows, verify_len, width), FREE_MASK, dtype=torch.int32, pin_memory=pinned)
        self.draft_masks = None if state.draft_mask is None else torch.full(  # None: no drafter
            state.draft_mask.shape, FREE_MASK, dtype=torch.int32, pin_memory=pinned)
        # per row of the host's draft masks, its leading draft positions that may hold a mask (the
        # rest have every bit set): a row's slots are reset only as far as they were written
        self.draft_known = np.zeros(rows, dtype=np.int64)
        self.batch = MaskFiller()
        # each step's masks go to the device in one copy per kind: a round's windows, a plain round's
        # (and a seat's) position 0, the drafter's block slots
        self.windows = RowSender(self.verify_masks, state.grammar_mask)
        self.firsts = RowSender(self.verify_masks[:, 0], state.grammar_mask[:, 0])
        self.seats = RowSender(self.verify_masks[:, 0], state.grammar_mask[:, 0])
        self.drafts = None if state.draft_mask is None else RowSender(self.draft_masks, state.draft_mask)
        # a round's forced drafts (rows, positions, tokens): one copy, reused once the step has waited
        self.forced_host = torch.empty(3, rows * verify_len, dtype=torch.long, pin_memory=pinned)
        self.forced_device = torch.empty(3, rows * verify_len, dtype=torch.long, device=device)

    def stage_round(self, rows: list[GrammarRow], verify_lens: list[int] | None, drafts: torch.Tensor | None):
        """Masks of the constrained running ``rows`` for this round, and the round's verify lengths
        cut after each row's first grammar-refused draft, greedy and sampled alike. That draft stays:
        its mask gives it target probability 0, so it is rejected and its position takes the target's
        own masked token -- a sampled row's drawn from the residual of its q, as speculative sampling
        must (drawing there from the target's distribution instead, cutting it too, would skew the
        output towards q's valid tokens); a greedy row's the masked argmax, whatever was drafted.
        The drafts after it are not verified (they followed a token that is not output). Nothing is
        drafted again: a redraft needs the device and a read back per call, which costs a round
        more than the drafts after a refusal buy (docs/structured-outputs.md, Cost). A position the
        grammar forces to one token gets it as its draft, drawn from a one-hot q (``walk_windows``).
        ``drafts`` int ``[rows, P]`` on the host (None for a plain round, ``verify_lens`` None: one
        position per row)."""
        if verify_lens is None:
            self._first_masks(rows)
            self.firsts.send([r.row for r in rows])  # a plain round reads position 0
            return None
        lens = np.array(verify_lens, dtype=np.int64)
        batch_rows = np.array([r.row for r in rows], dtype=np.int64)
        windows = walk_windows([r.grammar for r in rows], drafts.numpy()[batch_rows], lens[batch_rows] - 1,
                               self.verify_masks.view(-1, self.verify_masks.shape[-1]),
                               batch_rows * self.verify_len, self.batch)
        lens[batch_rows] = 1 + np.minimum(lens[batch_rows] - 1, windows.valid + 1)
        self._force(batch_rows[windows.forced_requests], windows.forced_positions, windows.forced_tokens)
        # whole rows, not just the windows: a position past a row's window must keep on the device the
        # mask its stale logits row there was masked with (rows move on the device, not here), or the
        # verify's finite-probabilities check over every position can meet a row masked to nothing
        self.windows.send(batch_rows.tolist())
        return lens.tolist()

    def _first_masks(self, rows: list[GrammarRow]) -> None:
        """Each row's mask after its committed tokens at its verify position 0, the rows still
        walking filled at once (in parallel threads); every bit set where the grammar has terminated."""
        live = [r for r in rows if not r.grammar.terminated]
        for r in rows:
            if r.grammar.terminated:
                self.verify_masks[r.row, 0] = FREE_MASK
        if live:
            self.batch.batch_fill_next_token_bitmask([r.grammar.matcher for r in live],
                                                     self.verify_masks.view(-1, self.verify_masks.shape[-1]),
                                                     [r.row * self.verify_len for r in live])

    def stage_trees(self, rows: list[GrammarRow]) -> None:
        """Tree mode: each constrained running row's drafted tree walked by its grammar
        (``walk_tree``): node i's mask (the state after its path) staged as verify position i's, and
        the tree cut to the nodes its grammar takes (forced tokens in place) written back over the
        row's tree (tokens, parents, depths, ancestor masks, node count). The trees are read from the
        device: the step waits for the last draft pass."""
        s, size = self.state, self.verify_len
        last = max(r.row for r in rows) + 1
        tokens, parents, depths, counts = (t[:last].cpu() for t in (s.tree_tokens, s.tree_parents, s.tree_depths,
                                                                      s.tree_nodes))
        scratch = torch.empty(size, self.verify_masks.shape[-1], dtype=torch.int32)
        for r in rows:
            n = int(counts[r.row])
            walk = walk_tree(r.grammar, tokens[r.row, :n].tolist(), parents[r.row, :n].tolist(),
                             depths[r.row, :n].tolist(), scratch)
            masks = self.verify_masks[r.row]
            masks.fill_(FREE_MASK)
            masks[:len(walk.source)] = scratch[walk.source]
            for buffer, value in zip((s.tree_tokens, s.tree_parents, s.tree_depths, s.tree_bits), walk.layout(size)):
                buffer[r.row].copy_(value)
            s.tree_nodes[r.row] = len(walk.source)
            s.grammar_mask[r.row].copy_(masks, non_blocking=True)

    def _force(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """The forced drafts (row ``rows[k]``'s draft at ``positions[k]`` is ``tokens[k]``, int64
        arrays) into the device state, each with a one-hot q (the distribution it was drawn from;
        sampled chain rounds read it): one copy of the indices, then indexed writes -- no per-token
        device work."""
        n = len(rows)
        if not n:
            return
        s = self.state
        self.forced_host[:, :n] = torch.from_numpy(np.stack([rows, positions, tokens]))
        forced = self.forced_device[:, :n]
        forced.copy_(self.forced_host[:, :n], non_blocking=True)
        row, position, token = forced
        s.draft_tokens[row, position] = token.to(s.draft_tokens.dtype)
        if s.draft_probs is not None:
            s.draft_probs[row, position] = 0.0
            s.draft_probs[row, position, token] = 1.0

    def stage_seats(self, rows: list[GrammarRow]) -> None:
        """The first-token masks of constrained requests seated this step (the state after their
        committed tokens). A free request's row has every bit set: a row is cleared when its request
        leaves (``ModelRunner.clear_rows``)."""
        for r in rows:
            r.grammar.next_mask(self.verify_masks[r.row, 0])
        self.seats.send([r.row for r in rows])

    def stage_drafts(self, rows: list[GrammarRow], tokens: list[list[int]]) -> None:
        """The drafter's masks (``fill_draft_masks``): each row's states after the step's ``tokens``
        (row i's its own list), before the engine commits them."""
        slots = self.draft_slots
        block = self.draft_masks.shape[1]
        batch_rows = np.array([r.row for r in rows], dtype=np.int64)
        self.draft_known[batch_rows] = fill_draft_masks(
            [r.grammar for r in rows], [tokens[r.row] if r.commits else [] for r in rows],
            self.draft_masks.view(-1, self.draft_masks.shape[-1]), batch_rows * block + slots.start,
            slots.stop - slots.start, self.batch, self.draft_known[batch_rows])
        self.drafts.send(batch_rows.tolist())


class StructuredStage:
    """An engine's structured outputs: its grammars (``Grammars``, compiled on first use against the
    engine's tokenizer, else ``tokenizer_source``'s: the target directory's) and the host side of
    ``runner``'s mask buffers (``GrammarStager``), staged before each step's launch."""

    def __init__(self, runner, tokenizer_source):
        self.runner, self.tokenizer_source = runner, tokenizer_source
        self.compiled: Grammars | None = None
        self.stager: GrammarStager | None = None

    def grammars(self, tokenizer, eos_ids) -> Grammars:
        """The compiled grammars, built on the first structured request."""
        if self.compiled is None:
            if tokenizer is None:
                from .api import load_tokenizer

                source = self.tokenizer_source
                tokenizer = load_tokenizer(source if isinstance(source, str) else getattr(source, "name_or_path", None))
            if tokenizer is None:
                Checker("add_request").fail("structured_outputs need the target's tokenizer, and it has none "
                                            "(set LLMEngine.tokenizer)")
            self.compiled = Grammars(tokenizer, self.runner.target.vocab_size, eos_ids)
            drafter = self.runner.drafter
            offset = 0 if drafter is None else drafter.slot_offset
            slots = None if drafter is None else slice(offset, offset + drafter.num_draft_tokens)
            self.stager = GrammarStager(self.runner.state, self.runner.verify_len, self.compiled.width, slots)
        return self.compiled

    def check(self, spec: StructuredOutputs, tokenizer, eos_ids) -> None:
        """``spec`` compiles (ValueError naming the problem, ``param`` ``structured_outputs``)."""
        try:
            self.grammars(tokenizer, eos_ids).compile(spec)
        except ValueError as exc:
            exc.param = "structured_outputs"  # the request field at fault, for the server's 400
            raise

    def constrain(self, running: list, verify_lens: list[int] | None, chunks) -> list[int] | None:
        """Stage the masks of the step's constrained rows (``running``: the step's running requests,
        row i first; ``chunks``: its (request, prompt chunk) pairs) and return the verify lengths cut
        to their grammar-valid drafts; with any, the drafter's masks are staged between
        the step's passes (``ModelRunner.between_passes``). The drafts are read from the device: a
        constrained step waits for the last draft pass."""
        runner = self.runner
        runner.between_passes = None
        if self.stager is None:  # no structured request yet
            return verify_lens
        rows = [GrammarRow(i, seq.grammar) for i, seq in enumerate(running) if seq.grammar is not None]
        seated = [GrammarRow(chunk.row, seq.grammar, commits=not seq.output_ids) for seq, chunk in chunks
                  if chunk.row >= 0 and seq.grammar is not None]
        self.stager.stage_seats(seated)
        if not rows and not seated:
            return verify_lens
        if rows and verify_lens is not None and runner.tree is not None:
            self.stager.stage_trees(rows)  # a tree verifies its nodes: the lengths stay
        else:
            drafts = runner.state.draft_tokens[:len(running)].cpu() if rows and verify_lens is not None else None
            verify_lens = self.stager.stage_round(rows, verify_lens, drafts)
        if runner.drafter is not None:
            def stage_drafts() -> None:
                result = runner.read(max(r.row for r in rows + seated) + 1)
                self.stager.stage_drafts(rows + seated, result.tokens)

            runner.between_passes = stage_drafts
        return verify_lens
