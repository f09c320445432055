"""Structured outputs (``engine/structured.py``, xgrammar) exact under speculative decoding: every
output matches its schema / regex / choice / grammar, greedy and sampled, beside free rows; greedy
with the drafter is plain greedy decoding under the same grammar, token for token, batched or alone;
a verify window's masks are the matcher's states after the drafts before each position and the
drafts are cut to their valid prefix; sampled outputs follow the target's masked distribution
(chi-square / TV over a bigram target's transitions, testing.md §5)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from conftest import gpu
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from statistics_cases import check_transitions

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams, StructuredOutputs
from dspark.engine.structured import (FREE_MASK, Grammars, MaskFiller, fill_draft_masks, only_tokens, walk_tree,
                                      walk_windows)
from dspark.training.data import demo_pair, read_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                                     "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
SCORE = {"type": "object", "additionalProperties": False, "required": ["ok", "score"],
         "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": -1, "maximum": 1}}}
REGEX = r"def [a-z_]{1,12}\((self)?\):\n    return [0-9]{1,4}\n"
CHOICES = ("True", "False", "None")


def matches(schema: dict, value) -> bool:
    """``value`` satisfies ``schema`` (the keywords the schemas above use, as JSON Schema defines them)."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(matches(props[k], v) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(matches(schema["items"], v) for v in value))
    if kind == "string":
        return (isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30)
                and re.search(schema.get("pattern", ""), value) is not None)
    if kind in ("integer", "number"):
        exact = isinstance(value, int) if kind == "integer" else isinstance(value, (int, float))
        return (exact and not isinstance(value, bool) and schema.get("minimum", value) <= value
                <= schema.get("maximum", value))
    return kind == "boolean" and isinstance(value, bool)


def test_the_checker_has_teeth():
    assert matches(PERSON, {"name": "ab", "age": 3, "tags": ["red"], "address": {"zip": "12345"}})
    for bad in ({"name": "", "age": 3, "tags": [], "address": {"zip": "12345"}},
                {"name": "a", "age": 121, "tags": [], "address": {"zip": "12345"}},
                {"name": "a", "age": 3, "tags": ["pink"], "address": {"zip": "12345"}},
                {"name": "a", "age": 3, "tags": [], "address": {"zip": "1234"}},
                {"name": "a", "age": 3, "tags": [], "address": {"zip": "12345"}, "x": 1}):
        assert not matches(PERSON, bad)


@pytest.fixture(scope="module")
def demo():
    """(demo pair, tokenizer, two prompts, an engine with the drafter, a plain engine)."""
    from transformers import AutoTokenizer

    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [tokenizer(r["text"][:100])["input_ids"] for r in read_prompts(str(pair.prompts))[:2]]
    config = EngineConfig(max_batch=8, max_model_len=512)
    return (pair, tokenizer, prompts, LLMEngine(str(pair.target), str(pair.draft), config),
            LLMEngine(str(pair.target), None, config))


def check_output(spec: StructuredOutputs, text: str) -> None:
    if spec.json is not None:
        assert matches(json.loads(spec.json), json.loads(text)), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice, text


SPECS = [StructuredOutputs(json=PERSON), StructuredOutputs(json=json.dumps(SCORE)), StructuredOutputs(regex=REGEX),
         StructuredOutputs(choice=CHOICES)]


def test_every_output_matches_greedy_and_sampled_beside_free_rows(demo):
    """Each spec, greedy and sampled (two seeds), in one batch with free rows: every constrained
    output completes (finish reason "stop", the EOS last) and matches; the free rows stay what they
    are alone."""
    pair, tokenizer, prompts, engine, _ = demo
    free = [Request(p, 24, SamplingParams(), ignore_eos=True) for p in prompts]
    alone = [r.token_ids for r in engine.generate(free)]
    constrained = [Request(prompts[i % 2], 96, SamplingParams(t, seed=i, structured_outputs=spec))
                   for i, spec in enumerate(SPECS) for t in (0.0, 1.0, 1.0)]
    out = engine.generate(free[:1] + constrained + free[1:])
    assert [out[0].token_ids, out[-1].token_ids] == alone
    for request, result in zip(constrained, out[1:-1]):
        assert result.finish_reason == "stop" and result.token_ids[-1] in engine.eos_ids
        check_output(request.sampling.structured_outputs, tokenizer.decode(result.token_ids[:-1]))


def test_greedy_with_the_drafter_is_plain_greedy_under_the_grammar_batched_or_alone(demo):
    """Token for token: speculative greedy equals plain greedy decoding under the same grammar (its
    windows cut after a refused draft), beside a sampled row too (the sampled path: a greedy row's
    one-hot target accepts what equals its argmax, whatever the q), and a request's output does not
    depend on its batch."""
    pair, tokenizer, prompts, engine, plain = demo
    requests = [Request(p, 96, SamplingParams(structured_outputs=spec)) for spec in SPECS[:3] for p in prompts]
    expected = [r.token_ids for r in plain.generate(requests)]
    assert [r.token_ids for r in engine.generate(requests)] == expected
    sampled = Request(prompts[0], 96, SamplingParams(1.0, seed=5, structured_outputs=SPECS[2]))
    assert [r.token_ids for r in engine.generate(requests + [sampled])[:-1]] == expected
    assert engine.generate(requests[2:3])[0].token_ids == expected[2]


def test_ignore_eos_still_ends_a_constrained_output_at_its_grammars_stop_token(demo):
    """A constrained request ends where its grammar takes the stop token, ``ignore_eos`` or not: a
    round that verifies past that token (a forced EOS draft, then the bonus token) commits nothing
    after it, so speculative greedy stays plain greedy."""
    pair, tokenizer, prompts, engine, plain = demo
    requests = [Request(p, 96, SamplingParams(structured_outputs=spec), ignore_eos=True) for spec in SPECS[:2]
                for p in prompts]
    expected = [r.token_ids for r in plain.generate(requests)]
    outputs = engine.generate(requests)
    assert [r.token_ids for r in outputs] == expected
    assert all(r.finish_reason == "stop" and r.token_ids[-1] == tokenizer.eos_token_id for r in outputs)


class ForcedDrafts:
    """Drafts replaced by a known continuation (``tokens`` after the prompt of ``prompt_len``; None:
    the drafter's own), with the draft at ``wrong`` made a token the grammar refuses."""

    def __init__(self, tokens: list[int] | None, prompt_len: int, wrong: int, refused: int):
        self.tokens = None if tokens is None else tokens + [0] * 16
        self.prompt_len, self.wrong, self.refused = prompt_len, wrong, refused

    def apply(self, runner, b: int) -> None:
        s = runner.state
        if self.tokens is not None:
            start = int(s.anchor_pos[0]) + 1 - self.prompt_len
            s.draft_tokens[0] = torch.tensor(self.tokens[start:start + runner.num_drafts], dtype=torch.int32)
        s.draft_tokens[0, self.wrong] = self.refused

    def buffers(self) -> list[torch.Tensor]:
        return []


def forced_run(engine, request, drafts: ForcedDrafts):
    engine.runner.draft_override = drafts
    try:
        return engine.generate([request])[0]
    finally:
        engine.runner.draft_override = None


def test_a_greedy_rows_window_is_cut_after_its_first_refused_draft(demo):
    """Drafts that follow plain greedy decoding under the grammar (what the target will choose) up
    to a refused token at position 2: each round verifies the two valid drafts and the refused one
    (cut after it; nothing is drafted again), unless the grammar forces position 2 (then the forced
    token replaces it and the window goes on), accepts the two valid ones and the target's token
    there (a mask row taken from another state would change the masked argmax), and the output is
    plain greedy's."""
    pair, tokenizer, prompts, engine, plain = demo
    request = Request(prompts[0], 40, SamplingParams(structured_outputs=SPECS[0]))
    expected = plain.generate([request])[0].token_ids
    refused = tokenizer("\n")["input_ids"][0]  # never inside JSON
    result = forced_run(engine, request, ForcedDrafts(expected, len(prompts[0]), 2, refused))
    assert result.token_ids == expected
    rounds = result.stats.scheduled_lengths[:-1]  # the last round may be cut by the request's end
    assert 3 in rounds and set(rounds) <= {3, engine.runner.num_drafts}
    assert all(accepted == 3 for n, accepted in zip(rounds, result.stats.accept_lengths) if n == 3)


def test_a_sampled_rows_drafts_are_cut_after_the_first_refused_one(demo):
    """A sampled row under ``[a-z ]+`` (nothing forced) whose draft at position 1 the grammar
    refuses: every round verifies its valid first draft and the refused one (cut after it, the
    refused one kept for its residual draw), never accepts the refused one, and the output matches."""
    pair, tokenizer, prompts, engine, _ = demo
    spec = StructuredOutputs(regex="[a-z ]+")
    request = Request(prompts[0], 40, SamplingParams(1.0, seed=1, structured_outputs=spec))
    result = forced_run(engine, request, ForcedDrafts(None, len(prompts[0]), 1, tokenizer("\n")["input_ids"][0]))
    assert max(result.stats.scheduled_lengths) == 2 and max(result.stats.accept_lengths) <= 2
    assert re.fullmatch("[a-z ]+", tokenizer.decode(result.token_ids).removesuffix(tokenizer.eos_token))


def _parallel_filler() -> MaskFiller:
    """A ``MaskFiller`` that goes parallel once it has measured one call on one thread."""
    filler = MaskFiller()
    filler.PARALLEL_AFTER_S = 0.0
    return filler


@pytest.mark.parametrize("filler", [xgr.BatchGrammarMatcher, MaskFiller, _parallel_filler])
def test_a_window_masks_each_position_by_the_state_before_it(demo, filler):
    """``walk_windows`` (two requests walked together, the second's rows after the first's): row j is
    a fresh matcher's bitmask after the first j drafts, the valid prefix stops at the first refused
    draft, a position the grammar forces to one token takes it (here the EOS once the regex is
    complete), and the matchers are rolled back -- filled by xgrammar's threads, by the engine's
    ``MaskFiller`` on one thread, or by it in parallel after its first, measured, call."""
    pair, tokenizer, _, engine, _ = demo
    grammars = engine.structured.grammars(engine.tokenizer, engine.eos_ids)
    prefix = tokenizer("12x")["input_ids"]
    refused = tokenizer("z")["input_ids"]
    specs = (StructuredOutputs(regex=r"[0-9]+x[a-c]"), StructuredOutputs(regex=r"[0-9]+x"))
    expected = ((len(prefix), {}), (len(prefix) + 1, {len(prefix): engine.eos_ids}))
    size = len(prefix) + 2
    grammar_list = [grammars.matcher(spec) for spec in specs]
    out = torch.full((2 * size, grammars.width), FREE_MASK, dtype=torch.int32)
    filler = filler()
    drafts = [prefix + refused] * 2
    windows = walk_windows(grammar_list, drafts, [len(d) for d in drafts], out, [0, size], filler)
    if isinstance(filler, MaskFiller):
        assert filler.seconds_per_mask > 0.0  # its first call ran on one thread, measured
    for i, (spec, (valid, forced)) in enumerate(zip(specs, expected)):
        assert windows.valid[i] == valid
        mine = windows.forced_requests == i
        got = dict(zip(windows.forced_positions[mine].tolist(), windows.forced_tokens[mine].tolist()))
        assert {k: {v} for k, v in got.items()} == {k: set(v) for k, v in forced.items()}
        for j in range(len(prefix) + 1):
            fresh = grammars.matcher(spec)
            assert fresh.advance(prefix[:j]) is False
            row = torch.zeros(1, grammars.width, dtype=torch.int32)
            fresh.next_mask(row[0])
            assert torch.equal(out[i * size + j], row[0]), (spec, j)
        assert grammar_list[i].advance(prefix) is False  # rolled back: the drafts are taken again


def reference_window(grammars: Grammars, spec: StructuredOutputs, committed: list[int], drafts: list[int]):
    """One request's window walked alone, token by token, with fresh matchers: (valid drafts, forced
    {position: token}, the mask rows of positions 0 .. valid)."""
    grammar = grammars.matcher(spec)
    grammar.advance(committed)
    valid, forced, rows = 0, {}, []
    for j in range(len(drafts) + 1):
        row = torch.zeros(grammars.width, dtype=torch.int32)
        grammar.next_mask(row)
        rows.append(row)
        if j == len(drafts):
            break
        token = drafts[j]
        if not (int(row[token >> 5]) >> (token & 31)) & 1:
            only = grammar.only_token(row)
            if only is None:
                break
            forced[j] = token = only
        assert grammar.matcher.accept_token(token)
        valid += 1
        if grammar.terminated:
            break
    return valid, forced, rows


def test_random_windows_of_many_requests_walk_as_each_alone():
    """``walk_windows`` over 12 requests of two grammars at different states, random drafts of
    random lengths (most refused somewhere, some forced, some reaching the stop token): each
    request's valid prefix, forced drafts and mask rows are those of its window walked alone with a
    fresh matcher, and every matcher is rolled back."""
    generator = torch.Generator().manual_seed(0)
    grammars = Grammars(letters_tokenizer(), 5, [EOS])
    specs = [StructuredOutputs(regex="(a[cd]b)+"), StructuredOutputs(regex="([ab][cd]){1,3}")]
    size, n = 6, 12
    cases = []
    states = ([[], [0], [0, 2], [0, 2, 1]], [[], [1], [1, 3], [0, 2, 1, 3]])  # committed tokens per spec
    for i in range(n):
        committed = states[i % 2][i // 2 % 4]
        drafts = torch.randint(0, 5, (int(torch.randint(1, size, (1,), generator=generator)),),
                               generator=generator).tolist()
        cases.append((specs[i % 2], committed, drafts))
    live = []
    for spec, committed, _ in cases:
        grammar = grammars.matcher(spec)
        grammar.advance(committed)
        live.append(grammar)
    padded = [d + [0] * (size - len(d)) for _, _, d in cases]
    out = torch.zeros(n * size, grammars.width, dtype=torch.int32)
    windows = walk_windows(live, padded, [len(d) for _, _, d in cases], out, [i * size for i in range(n)],
                           MaskFiller())
    seen_valid, seen_forced = set(), 0
    for i, (spec, committed, drafts) in enumerate(cases):
        valid, forced, rows = reference_window(grammars, spec, committed, drafts)
        assert windows.valid[i] == valid, i
        mine = windows.forced_requests == i
        assert dict(zip(windows.forced_positions[mine].tolist(), windows.forced_tokens[mine].tolist())) == forced
        for j, row in enumerate(rows):
            assert torch.equal(out[i * size + j], row), (i, j)
        seen_valid.add(valid == len(drafts))
        seen_forced += len(forced)
        fresh = grammars.matcher(spec)
        fresh.advance(committed)
        assert live[i].matcher.is_terminated() == fresh.matcher.is_terminated()
        row, again = torch.zeros(grammars.width, dtype=torch.int32), torch.zeros(grammars.width, dtype=torch.int32)
        live[i].next_mask(row), fresh.next_mask(again)
        assert torch.equal(row, again), i  # rolled back
    assert seen_valid == {True, False} and seen_forced  # the cases cut, run through and force


def test_bad_specs_name_the_problem(demo):
    engine = demo[3]
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        StructuredOutputs(choice="yes")
    with pytest.raises(ValueError, match="json must be a JSON schema"):
        StructuredOutputs(json="{not json")
    for spec, kind in ((StructuredOutputs(regex="(a"), "regex"), (StructuredOutputs(grammar="root ::= missing"), "grammar"),
                       (StructuredOutputs(json={"type": "nonsense"}), "json")):
        with pytest.raises(ValueError, match=f"structured_outputs: the {kind} cannot be compiled"):
            engine.add_request(Request([1, 2], 4, SamplingParams(structured_outputs=spec)))


@gpu
@pytest.mark.parametrize("tree", [{}, dict(draft_top_k=4, tree_budget=16)], ids=["chain", "tree"])
def test_cuda_graphs_replay_any_mix_of_constrained_and_free_rows(demo, tree):
    """On CUDA with every graph captured up front, chained and in trees: a constrained greedy row is
    plain greedy decoding under its grammar (the CPU's, float32), a free row beside it stays what it
    is alone, a sampled constrained row gives the same tokens alone and in the batch, every output
    matches, and no step captures a graph (the masks are per-row state in fixed buffers)."""
    pair, tokenizer, prompts, _, plain = demo
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=4, max_model_len=512, device="cuda",
                                                                       dtype=torch.float32, **tree))
    engine.capture_graphs()
    captured = engine.runner.captures
    greedy = Request(prompts[0], 96, SamplingParams(structured_outputs=SPECS[0]))
    free = Request(prompts[1], 24, SamplingParams(), ignore_eos=True)
    sampled = Request(prompts[1], 96, SamplingParams(1.0, seed=3, structured_outputs=SPECS[2]))
    alone = [engine.generate([r])[0].token_ids for r in (free, sampled)]
    out = engine.generate([greedy, free, sampled])
    assert out[0].token_ids == plain.generate([greedy])[0].token_ids
    assert [out[1].token_ids, out[2].token_ids] == alone
    for request, result in ((greedy, out[0]), (sampled, out[2])):
        check_output(request.sampling.structured_outputs, tokenizer.decode(result.token_ids[:-1]))
    assert engine.runner.captures == captured and not engine.runner.uncapturable


def test_tree_mode_greedy_is_plain_greedy_under_the_grammar_and_sampled_outputs_match(demo):
    """Tree mode (top-4 trees of 16 nodes, each node masked by its path's state, refused nodes cut):
    greedy is plain greedy decoding under the grammar token for token, batched; sampled outputs
    complete and match, and a sampled request's tokens do not depend on its batch."""
    pair, tokenizer, prompts, _, plain = demo
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=8, max_model_len=512, draft_top_k=4,
                                                                       tree_budget=16))
    greedy = [Request(p, 96, SamplingParams(structured_outputs=spec)) for spec in SPECS for p in prompts]
    assert [r.token_ids for r in engine.generate(greedy)] == [r.token_ids for r in plain.generate(greedy)]
    sampled = [Request(prompts[i % 2], 96, SamplingParams(1.0, seed=i, structured_outputs=spec))
               for i, spec in enumerate(SPECS)]
    out = engine.generate(sampled)
    for request, result in zip(sampled, out):
        assert result.finish_reason == "stop" and result.token_ids[-1] in engine.eos_ids
        check_output(request.sampling.structured_outputs, tokenizer.decode(result.token_ids[:-1]))
    assert engine.generate(sampled[2:3])[0].token_ids == out[2].token_ids


def letters_tokenizer():
    """A word-level tokenizer of a b c d (ids 0..3) and ``<eos>`` (``EOS``)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"a": 0, "b": 1, "c": 2, "d": 3, "<eos>": EOS}, unk_token="a")), eos_token="<eos>")


def test_a_tree_walk_masks_each_node_by_its_path_and_cuts_what_the_grammar_refuses():
    """``walk_tree`` on ``(a[cd]b)+`` over a drafted tree: node i's mask is a fresh matcher's after
    the tokens of i's path; a refused node goes with its subtree, so does what follows a stop token;
    a node forced to one token gives its first child that token; the kept nodes are renumbered in
    order with their parents, depths and ancestor masks; the matcher is rolled back."""
    a, b, c, d = range(4)
    grammars = Grammars(letters_tokenizer(), 5, [EOS])
    spec = StructuredOutputs(regex="(a[cd]b)+")
    # node:        0  1  2  3  4  5  6  7    8  9
    tokens = [b, a, c, c, a, b, d, EOS, a, a]
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 7, 6]
    depths = [0, 1, 1, 2, 2, 2, 3, 4, 5, 4]
    grammar = grammars.matcher(spec)
    masks = torch.zeros(len(tokens), grammars.width, dtype=torch.int32)
    walk = walk_tree(grammar, tokens, parents, depths, masks)
    assert walk.source == [0, 1, 3, 6, 7, 9] and walk.forced == {6: b}  # 2 (and 5), 4, 8 cut; d -> b
    assert walk.tokens == [b, a, c, b, EOS, a] and walk.parents == [-1, 0, 1, 2, 3, 3]
    assert walk.depths == [0, 1, 2, 3, 4, 4]
    paths = {0: [], 1: [a], 3: [a, c], 6: [a, c, b], 7: [a, c, b, EOS], 9: [a, c, b, a]}
    for node, path in paths.items():
        fresh = grammars.matcher(spec)
        fresh.advance(path)
        row = torch.zeros(1, grammars.width, dtype=torch.int32)
        fresh.next_mask(row[0])
        assert torch.equal(masks[node], row[0]), node
    assert int(masks[7, 0]) == FREE_MASK  # after the stop token: nothing is masked, nothing follows
    laid_tokens, laid_parents, laid_depths, bits = walk.layout(8)
    assert laid_tokens.tolist() == [b, a, c, b, EOS, a, b, b] and laid_parents.tolist() == [-1, 0, 1, 2, 3, 3, -1, -1]
    assert laid_depths.tolist() == [0, 1, 2, 3, 4, 4, 0, 0]
    assert bits.tolist() == [1, 0b11, 0b111, 0b1111, 0b11111, 0b101111, 1 << 6, 1 << 7]
    assert grammar.advance([a, d, b]) is False  # rolled back: the root's state again


@pytest.mark.parametrize("argv, expected", [
    (["--choice", "yes", "--choice", "no"], StructuredOutputs(choice=("yes", "no"))),
    (["--regex", "[0-9]+"], StructuredOutputs(regex="[0-9]+")),
    (["--json-object"], StructuredOutputs(json_object=True)),
    ([], None),
])
def test_cli_flags_give_the_structured_output(argv, expected):
    import argparse

    from dspark.cli.generate import add_arguments, structured_outputs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert structured_outputs(parser.parse_args(argv)) == expected


def test_cli_flags_read_files_and_refuse_two(tmp_path):
    import argparse

    from dspark.cli.generate import add_arguments, structured_outputs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    schema, grammar = tmp_path / "s.json", tmp_path / "g.ebnf"
    schema.write_text(json.dumps(SCORE))
    grammar.write_text('root ::= "a"')
    assert structured_outputs(parser.parse_args(["--json-schema", str(schema)])) == StructuredOutputs(json=SCORE)
    assert structured_outputs(parser.parse_args(["--grammar", str(grammar)])).grammar == 'root ::= "a"'
    with pytest.raises(ValueError, match="give at most one of .*; got --regex, --choice"):
        structured_outputs(parser.parse_args(["--regex", "a", "--choice", "a"]))
    with pytest.raises(ValueError, match="--json-schema: cannot read"):
        structured_outputs(parser.parse_args(["--json-schema", str(tmp_path / "missing.json")]))


def test_the_drafter_is_masked_where_the_state_is_known_before_drafting():
    """``fill_draft_masks`` on ``(a[cd]b)+``, four requests at once: position 0's mask is the state
    after the new tokens; through a forced run (b after a c) each next position's is the state after
    it; from the first position with a choice on, every bit is set, and so after a stop token. The
    new tokens are taken ahead of their commit and the forced runs' rolled back: ``advance`` with the
    commit takes nothing twice, and a commit shorter than the tokens (an output ending inside the
    step) rolls the rest back. With ``stale``, rows past it are not written (they hold every bit)."""
    a, b, c, d = range(4)
    grammars = Grammars(letters_tokenizer(), 5, [EOS])
    spec = StructuredOutputs(regex="(a[cd]b)+")

    def state(path):
        fresh = grammars.matcher(spec)
        fresh.advance(path)
        row = torch.zeros(grammars.width, dtype=torch.int32)
        fresh.next_mask(row)
        return row

    grammar_list = [grammars.matcher(spec) for _ in range(4)]
    grammar_list[3].advance([a, c])
    out = torch.zeros(4 * 4, grammars.width, dtype=torch.int32)
    new = [[a, c], [a], [a, c, b], [b, EOS]]
    known = fill_draft_masks(grammar_list, new, out, [0, 4, 8, 12], 4, MaskFiller())
    assert known.tolist() == [2, 1, 1, 0]
    assert torch.equal(out[0], state([a, c])) and torch.equal(out[1], state([a, c, b]))  # b forced, then a or EOS
    assert (out[2:4] == FREE_MASK).all() and not torch.equal(out[0], out[1])
    assert torch.equal(out[4], state([a])) and (out[5:8] == FREE_MASK).all()  # c or d: nothing known after
    assert torch.equal(out[8], state([a, c, b])) and (out[9:12] == FREE_MASK).all()
    assert (out[12:16] == FREE_MASK).all()  # after the stop token nothing follows
    commits = [[a, c], [a], [a], [b, EOS]]  # request 2's output ends after its first token
    for grammar, before, commit in zip(grammar_list, ([], [], [], [a, c]), commits):
        assert grammar.advance(commit) == (commit[-1] == EOS)
        row = torch.zeros(grammars.width, dtype=torch.int32)
        grammar.next_mask(row)
        assert torch.equal(row, state(before + commit))  # each token taken once
    out[:] = 7  # rows past ``stale`` are left as they are
    known = fill_draft_masks(grammar_list[:3], [[b], [c], [c, b]], out, [0, 4, 8], 4, MaskFiller(), np.array([2, 1, 3]))
    assert known.tolist() == [1, 2, 1]  # after a c b: a; after a c: b forced, then a
    assert torch.equal(out[0], state([a, c, b])) and (out[1] == FREE_MASK).all() and (out[2:4] == 7).all()
    assert torch.equal(out[5], state([a, c, b])) and (out[6:8] == 7).all()
    assert (out[9:11] == FREE_MASK).all() and (out[11] == 7).all()


# ------------------------------------------------------------------------------ sampled: the masked distribution

ROWS, TOKENS = 128, 256  # 32 768 transitions over 8 allowed pairs: an exact engine's TV ~ 0.006
EOS = 4


@pytest.fixture(scope="module")
def bigram_grammar_pair(one_thread):
    """A bigram target over tokens a b c d (and EOS, biased away), a random draft, a tokenizer, and
    the target's logits after each of a b c d ``[4, 4]``."""
    target = tiny_qwen3_target(vocab_size=5, num_layers=2, eos_token_id=EOS)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        logits = target(torch.arange(4)[:, None]).logits[:, 0, :4]
    draft = random_draft(tiny_draft_config(target.config, layer_types=["full_attention"]), 0, target)
    return target, draft, letters_tokenizer(), logits


# regex -> tokens allowed after a, b, c, d (the grammar's state is the last token's); the second forces
# b after c / d and a after b (the EOS aside), which the engine drafts itself (``Windows.forced_tokens``)
GRAMMAR_CHAINS = {"([ab][cd])+": [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]],
                  "(a[cd]b)+": [[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]]}


@pytest.mark.parametrize("head, from_anchor", [("vanilla", True), ("gated", False), ("rnn", False)])
def test_greedy_rows_of_random_drafters_are_plain_greedy_under_the_grammar(bigram_grammar_pair, head, from_anchor):
    """Random drafters of each Markov head, drafting from the anchor's slot or the next (drafts the
    grammar mostly refuses): greedy rows under a grammar -- their windows cut after a refused draft,
    forced drafts put in -- are plain greedy decoding under it, batched."""
    target, _, tokenizer, _ = bigram_grammar_pair
    draft = random_draft(tiny_draft_config(target.config, layer_types=["full_attention"], markov_head_type=head,
                                           sample_from_anchor=from_anchor), 1, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=4))
    plain = LLMEngine(target, None, EngineConfig(max_batch=4))
    engine.tokenizer = plain.tokenizer = tokenizer
    requests = [Request([s % 4], 24, SamplingParams(structured_outputs=StructuredOutputs(regex=regex),
                                                    logit_bias={EOS: -100.0}), ignore_eos=True)
                for s in range(4) for regex in GRAMMAR_CHAINS]
    assert [r.token_ids for r in engine.generate(requests)] == [r.token_ids for r in plain.generate(requests)]


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("regex", list(GRAMMAR_CHAINS))
def test_sampled_outputs_follow_the_masked_target(bigram_grammar_pair, regex, top_k):
    """Every transition of sampled speculative outputs under the grammar follows the target's masked
    distribution (after each token, the target's distribution over what the grammar allows next,
    renormalised), chained drafts and trees alike (top-3 trees of 6 nodes: refused nodes cut, forced
    ones put in); the same outputs do not follow the unmasked one (the check has teeth)."""
    target, draft, tokenizer, logits = bigram_grammar_pair
    allowed = torch.tensor(GRAMMAR_CHAINS[regex], dtype=torch.bool)
    chain = logits.masked_fill(~allowed, -float("inf")).softmax(-1)
    tree = dict(draft_top_k=top_k, tree_budget=6) if top_k > 1 else {}
    engine = LLMEngine(target, draft, EngineConfig(max_batch=ROWS, **tree))
    engine.tokenizer = tokenizer
    spec = StructuredOutputs(regex=regex)
    out = engine.generate([Request([s % 4], TOKENS, SamplingParams(1.0, seed=s, structured_outputs=spec,
                                                                   logit_bias={EOS: -100.0}), ignore_eos=True)
                           for s in range(ROWS)])
    sequences = torch.tensor([r.token_ids for r in out])
    assert sequences.shape == (ROWS, TOKENS)
    assert check_transitions(sequences, chain) is None
    with torch.no_grad():
        unmasked = target(torch.arange(4)[:, None]).logits[:, 0, :4].softmax(-1)
    assert check_transitions(sequences, unmasked) is not None


def test_min_tokens_with_a_grammar_is_refused_naming_both():
    """Where the grammar allows only the stop token, ``min_tokens`` would ban it and leave no token
    (NaN probabilities, an arbitrary token): the combination is refused, not run approximately."""
    with pytest.raises(ValueError, match=r"min_tokens \(4\) cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=4, structured_outputs=StructuredOutputs(regex="[a-z]+"))
    assert SamplingParams(min_tokens=4).min_tokens == 4


def test_a_bounded_json_string_takes_no_control_character(demo):
    """JSON forbids raw U+0000-U+001F in strings; xgrammar 0.2.9's bounded strings (minLength /
    maxLength) let them in, so the engine's JSON grammar keeps those strings to JSON's characters:
    every output parses with a strict parser. Unbounded strings and their escapes are unchanged."""
    grammars = Grammars(demo[1], 2048, [0])
    schema = {"type": "object", "required": ["s", "t"], "additionalProperties": False,
              "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 5}, "t": {"type": "string"}}}
    grammar = grammars.compile(StructuredOutputs(json=schema))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.accept_token(0) and matcher.is_terminated()

    assert accepts('{"s": "ab", "t": "x"}') and accepts('{"s": "ab", "t": "x\\n"}')
    for bad in ('{"s": "a\x01", "t": "x"}', '{"s": "a\x1f", "t": "x"}', '{"s": "a\x00b", "t": "x"}',
                '{"s": "", "t": "x"}', '{"s": "abcdef", "t": "x"}'):
        assert not accepts(bad), repr(bad)


def test_only_tokens_reads_each_row_alone():
    """The one token a bitmask row allows (bits past the vocabulary are no tokens), or -1 for
    none or several, row by row in one pass."""
    vocab = 70  # 3 words, the last holding 6 tokens and 26 padding bits
    rows = torch.zeros(6, 3, dtype=torch.int32)
    rows[0, 1] = 1 << 4                        # token 36 alone
    rows[1, 2] = (1 << 5) | (1 << 20)          # token 69, and a padding bit
    rows[2, 0] = 3                             # tokens 0 and 1
    rows[3, 0], rows[3, 2] = 1, 1              # tokens 0 and 64
    rows[4, 2] = -(1 << 31)                    # a padding bit only (the sign bit): no token
    rows[5, 0] = -(1 << 31)                    # token 31 (the sign bit of an int32 word)
    assert only_tokens(rows.numpy(), vocab).tolist() == [36, 69, -1, -1, -1, 31]
