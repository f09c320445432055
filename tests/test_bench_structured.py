"""``dspark.bench.structured`` on the CPU: the tiny shape end to end (the plumbing the GPU session's
one command relies on: every configuration free and constrained, each constrained output valid JSON of
the schema, DSpark's outputs plain decoding's in fp32), the oracle's runs again while its target
parts from its continuation, the schema checker's teeth, and the 8B
shape's offline tokenizer (the real vocabulary and bitmask width)."""

from __future__ import annotations

import json

import pytest

from dspark.bench import structured

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"type": "object", "additionalProperties": False, "required": ["kind", "n", "tags"],
         "properties": {"kind": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                        "tags": {"type": "array", "minItems": 1, "maxItems": 2,
                                 "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}}}}
# (strings bounded by a pattern: xgrammar 0.2.9 lets raw control characters into a string bounded by
# minLength / maxLength, which strict JSON refuses -- the bench counts such outputs invalid)


def test_the_tiny_shape_runs_every_configuration_free_and_constrained(tmp_path, capsys):
    """Two rows, prompts of 16 tokens, a small schema (its JSON fits 64 new tokens): each
    configuration's free and constrained runs with their ratio, every constrained output complete
    and valid, DSpark's outputs equal to plain decoding's (greedy, fp32) and the acceptance-1 oracle
    committing whole blocks, into structured.json / .md and the printed table."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SMALL))
    out = tmp_path / "out"
    assert structured.main(["--device", "cpu", "--shape", "tiny", "--batches", "2", "--prompt", "16", "--new", "64",
                            "--schema", str(schema), "--out", str(out), "--profile", "dspark_a1,plain"]) == 0
    report = json.loads((out / "structured.json").read_text())
    profile = (out / "profile-dspark_a1-b2.txt").read_text()  # the host's functions of one more constrained run
    assert "engine/structured.py" in profile and "Ordered by: internal time" in profile
    assert (out / "profile-plain-b2.txt").is_file()
    assert (report["shape"], report["dtype"], report["vocab"], report["schema"]) == ("tiny", "float32", 4096, SMALL)
    (row,) = report["rows"]
    configs = ["plain", "dspark_a1", "dspark_a0.8", "dspark_random"]
    assert [k for k in row if k != "batch"] == configs
    for name in configs:
        cell = row[name]
        assert set(structured.MODES) <= set(cell) and not [m for m in structured.MODES if "error" in cell[m]], cell
        none, constrained = cell["none"], cell["constrained"]
        assert cell["ratio"] == round(constrained["step_ms"] / none["step_ms"], 3)
        assert "outputs" not in none and "valid" not in none and none["steady_steps"] > 0
        valid = constrained["valid"]
        assert valid["valid"] == valid["complete"] == valid["of"] == 2 and valid["first_invalid"] is None, valid
        if name != "plain":  # greedy under the grammar is exact: DSpark's tokens are plain decoding's
            assert none["same_as_plain"] == constrained["same_as_plain"] == 2
            assert cell["x_plain_constrained"] == round(constrained["tok_per_s"] / row["plain"]["constrained"]
                                                        ["tok_per_s"], 3)
        if name.startswith("dspark_a"):  # fp32: the first run keeps its continuation
            assert none["oracle_runs"] == constrained["oracle_runs"] == 1
            assert none["oracle_departed"] == constrained["oracle_departed"] == 0
    assert row["plain"]["none"]["tau"] == row["plain"]["constrained"]["tau"] == 1.0
    assert row["dspark_a1"]["none"]["tau"] > 0.75 * (report["drafts_per_round"] + 1)
    table = capsys.readouterr().out
    assert "| B | config | none ms/step | constrained ms/step | ratio |" in table
    assert f"| 2 | plain | {row['plain']['none']['step_ms']} | {row['plain']['constrained']['step_ms']} |" in table
    assert table.count("| 2/2 |") == 4 and (out / "structured.md").read_text().strip() in table


def test_an_oracle_runs_again_from_its_own_outputs_while_a_row_parts_from_its_continuation(monkeypatch):
    """``oracle_run``: a target that parts from the continuation it drafts from (a bf16 near-tie
    decided by the batch's layout) is run again with its own outputs as drafts until no row parts,
    at most ``ORACLE_RUNS`` times; the last run is the measurement. The emulated target keeps its
    drafts up to a position, then writes its own tokens: that position moves later run by run."""
    calls = []

    def engine_run(engine, prompts, new, drafts, sampling):
        calls.append(drafts)
        keep = 3 * len(calls)  # each run repeats its predecessor further
        outputs = [d[:min(keep, new)] + [100 * len(calls) + i for i in range(keep, new)] for d in drafts]
        return dict(tokens_per_step=1.0, outputs=outputs)

    monkeypatch.setattr(structured, "engine_run", engine_run)
    start = [[1, 2, 3, 4, 5, 6, 7, 8], [9] * 8]
    result = structured.oracle_run(None, [[0], [0]], 8, start, None, 2)
    assert result["oracle_runs"] == 3 and result["oracle_departed"] == 0  # runs keep 3, 6, then all 8 drafts
    first = [[1, 2, 3, 103, 104, 105, 106, 107], [9, 9, 9, 103, 104, 105, 106, 107]]
    assert calls[0] == [c + [0, 0] for c in start] and calls[1] == [o + [0, 0] for o in first]
    assert result["outputs"] == [o[:8] for o in calls[2]]
    calls.clear()
    result = structured.oracle_run(None, [[0], [0]], 40, [[1] * 40, [2] * 40], None, 2)  # parts every time
    assert result["oracle_runs"] == len(calls) == structured.ORACLE_RUNS and result["oracle_departed"] == 2


def test_a_profile_of_an_unknown_configuration_is_refused(capsys):
    with pytest.raises(SystemExit):
        structured.main(["--device", "cpu", "--shape", "tiny", "--profile", "dspark_a0.5"])
    assert "--profile must name configurations of ['plain', 'dspark_a1', 'dspark_a0.8', 'dspark_random']" \
        in capsys.readouterr().err


def test_the_checker_has_teeth_and_names_what_it_cannot_check():
    good = {"kind": "beta", "n": 7, "tags": ["ab"]}
    assert structured.conforms(SMALL, good)
    for bad in ({**good, "kind": "gamma"}, {**good, "n": 100}, {**good, "n": 7.5}, {**good, "n": True},
                {**good, "tags": []}, {**good, "tags": ["abcd"]}, {**good, "tags": ["A"]}, {**good, "extra": 1},
                {"kind": "beta", "n": 7}):
        assert not structured.conforms(SMALL, bad), bad
    assert structured.conforms(structured.SCHEMA["properties"]["address"],
                               {"street": "1 Main", "city": "Oslo", "zip": "01234"})
    assert not structured.conforms(structured.SCHEMA["properties"]["address"],
                                   {"street": "1 Main", "city": "Oslo", "zip": "0123"})
    assert structured.unchecked_keywords(structured.SCHEMA) == set()
    assert structured.unchecked_keywords({"type": "array", "items": {"type": "string", "format": "date"}}) == {"format"}
    with pytest.raises(ValueError, match="format"):
        structured.conforms({"type": "string", "format": "date"}, "x")


def test_an_incomplete_or_invalid_output_is_counted_with_its_text():
    tokenizer, eos = structured.bench_tokenizer(structured.SHAPES["tiny"])
    complete = tokenizer.encode('{"kind":"alpha","n":3,"tags":["x"]}') + [eos]
    cut = tokenizer.encode('{"kind":"alpha","n":3')
    wrong = tokenizer.encode('{"kind":"alpha","n":300,"tags":["x"]}') + [eos]
    result = structured.check_outputs([complete, cut, wrong], tokenizer, eos, SMALL)
    assert (result["valid"], result["complete"], result["of"]) == (1, 2, 3)
    assert result["first_invalid"] == '{"kind":"alpha","n":3'


def test_the_8b_tokenizer_has_the_real_vocabulary_and_bitmask_width():
    """Qwen3's 151,643 regular tokens, the ids after them never allowed: the masks are ceil(151,936 /
    32) words wide and the schema's first mask allows regular tokens only (the opening brace's)."""
    import numpy as np
    import torch

    from dspark.engine.structured import Grammars, StructuredOutputs

    shape = structured.SHAPES["qwen3-8b"]
    tokenizer, eos = structured.bench_tokenizer(shape)
    assert (len(tokenizer), eos, shape.vocab) == (151643, 0, 151936)
    grammars = Grammars(tokenizer, shape.vocab, [eos])
    assert grammars.width == 4748
    mask = torch.zeros(grammars.width, dtype=torch.int32)
    grammars.matcher(StructuredOutputs(json=structured.SCHEMA)).next_mask(mask)
    allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:shape.vocab].astype(bool)
    assert allowed.any() and not allowed[151643:].any()
    assert all(tokenizer.decode([i]).startswith("{") for i in np.flatnonzero(allowed))
