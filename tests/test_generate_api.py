"""``dspark.generate`` from Python: text or token-id prompts, one or many, results with text, stop
strings, and the argument errors (raised before anything runs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from model_cases import write_tiny_checkpoints
from test_cli_generate import _words
from test_engine import _greedy

import dspark
from dspark.engine import TextStream, encode_prompts
from dspark.model import load_draft

PROMPT = [3, 17, 42, 8]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target directory with a word-level tokenizer, bare target directory, draft directory, greedy
    continuations of PROMPT and of PROMPT[:2])."""
    root = tmp_path_factory.mktemp("pair")
    target, drafts = write_tiny_checkpoints(root)
    return (root / "target", root / "bare", Path(drafts["speculators"]), _greedy(target, PROMPT, 16),
            _greedy(target, PROMPT[:2], 5))


def test_text_and_token_id_prompts_one_or_many(pair):
    target, _, draft, greedy, short = pair
    one = dspark.generate(target, draft, _words(PROMPT), max_new_tokens=8)  # pathlib.Path arguments
    assert one.token_ids == greedy[:8] and one.text == " " + _words(greedy[:8]) and one.finish_reason == "length"
    # a list of prompts; its lists of ids are prompts of a batch, never one concatenated prompt
    many = dspark.generate(str(target), str(draft), [_words(PROMPT), PROMPT, torch.tensor(PROMPT), PROMPT[:2]],
                           max_new_tokens=5)
    assert [r.token_ids for r in many] == [greedy[:5]] * 3 + [short[:5]]
    assert [r.text for r in many] == [" " + _words(greedy[:5])] * 3 + [" " + _words(short[:5])]


def test_stop_strings_eos_and_ignore_eos(pair):
    target, _, draft, greedy, _ = pair
    stop = f"t{greedy[6]}"
    text = " " + _words(greedy)
    shortest = next(k for k in range(1, 17) if stop in " " + _words(greedy[:k]))
    result = dspark.generate(target, draft, PROMPT, max_new_tokens=16, stop=[stop, "never"])
    assert result.finish_reason == "stop" and result.token_ids == greedy[:shortest]
    assert result.text == text[:text.find(stop)]
    k = next(i for i in range(2, 16) if greedy[i] not in greedy[:i])
    result = dspark.generate(target, draft, PROMPT, max_new_tokens=16, eos_token_id=greedy[k])
    assert result.token_ids == greedy[:k + 1] and result.finish_reason == "stop"
    assert result.text == " " + _words(greedy[:k])  # the stop token is no text (vLLM's rule, the server's)
    chunks = []
    result = dspark.generate(target, draft, PROMPT, max_new_tokens=6, ignore_eos=True, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == result.token_ids == greedy[:6]


def test_results_without_a_tokenizer_have_no_text(pair):
    _, bare, draft, greedy, _ = pair
    result = dspark.generate(bare, draft, PROMPT, max_new_tokens=4)
    assert result.token_ids == greedy[:4] and result.text is None


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(eos_token_id=96), ValueError, r"generate: eos_token_id must be in \[0, 95\], got 96"),  # checked against the vocab
    (dict(eos_token_id="2"), TypeError, "generate: eos_token_id must be a token id or a sequence of token ids, got str"),
    (dict(eos_token_id=[True]), TypeError, r"generate: eos_token_id\[\] must be an int, got bool"),
    (dict(on_tokens=5), TypeError, "generate: on_tokens must be callable, got int"),
    (dict(prompts=[PROMPT, PROMPT], on_tokens=print), ValueError, "on_tokens streams a single prompt; got a list of 2"),
    (dict(prompts=[]), ValueError, "prompts must hold at least one prompt"),
    (dict(prompts=[1, [2, 3]]), TypeError, "prompts mixes token ids and prompts"),
    (dict(prompts=[[1, [2]]]), TypeError, "prompt 0 must be a string or a flat list of token ids"),
    (dict(prompts=""), ValueError, "prompt 0 is empty"),
    (dict(prompts=3), TypeError, "prompts must be a string, a list of token ids or a list of prompts, got int"),
    (dict(stop=[""]), TypeError, "stop must be a non-empty string or a list of them"),
    (dict(max_new_tokens=-2), ValueError, r"max_new_tokens must be in \[0, inf\], got -2"),
    (dict(device="bogus"), ValueError, "device: 'bogus' is not a device"),
    (dict(max_model_len=4), ValueError, r"the prompt has 4 tokens; the context limit \(max_model_len\) is 4"),
    (dict(enforce_eager=1), TypeError, "LLM: enforce_eager must be a bool, got int 1"),
])
def test_bad_arguments_are_clear_errors(pair, kwargs, error, message):
    target, _, draft, _, _ = pair
    kwargs = {"prompts": PROMPT, **kwargs}
    with pytest.raises(error, match=message):
        dspark.generate(target, draft, kwargs.pop("prompts"), **kwargs)


def test_text_prompts_need_a_tokenizer_and_paths_must_exist(pair, tmp_path):
    target, bare, draft, _, _ = pair
    with pytest.raises(ValueError, match="a text prompt needs the target's tokenizer, and the target has none"):
        dspark.generate(bare, draft, "t1 t2")
    with pytest.raises(ValueError, match="load_target: target directory .* does not exist"):
        dspark.generate(tmp_path / "nowhere", draft, PROMPT)


def test_encode_prompts_shapes():
    assert encode_prompts(torch.tensor([[1, 2], [3, 4]]), None) == ([[1, 2], [3, 4]], False)
    assert encode_prompts((5, 6), None) == ([[5, 6]], True)
    with pytest.raises(ValueError, match=r"a prompt tensor must be 1-D \(one prompt\) or 2-D \(a batch\)"):
        encode_prompts(torch.zeros(1, 1, 1, dtype=torch.long), None)


def test_text_stream_holds_back_a_possible_stop_string(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    stream = TextStream(tokenizer, [3], stop=["t5 t6"])
    assert stream.add([4, 5]) is False
    first = stream.take()
    assert " t4 t5".startswith(first) and "t5" not in first  # "t5" may start the stop string: held back
    assert stream.add([7]) is False
    second = stream.take()
    assert " t4 t5 t7".startswith(first + second) and "t7" not in second  # " t7" could still grow into it
    assert stream.add([5, 6, 9]) is True and stream.stop_tokens == 5  # the token that completed it
    assert first + second + stream.take(final=True) == stream.text == " t4 t5 t7 "


# ---- dspark.LLM: the models loaded once ---------------------------------------------------------


def test_llm_loads_once_and_generates_many_times(pair, monkeypatch):
    import dspark.engine.api as api

    target, _, draft, greedy, short = pair
    loads, real = [], api.LLMEngine
    monkeypatch.setattr(api, "LLMEngine", lambda *a, **k: loads.append(a) or real(*a, **k))
    llm = dspark.LLM(target, draft, engine="reference")
    first = llm.generate(PROMPT, max_new_tokens=8)
    many = llm.generate([_words(PROMPT), PROMPT[:2]], max_new_tokens=5, stop="never")
    again = llm.generate(PROMPT, max_new_tokens=8)
    assert len(loads) == 1  # three calls, one load
    assert first.token_ids == again.token_ids == greedy[:8] and first.text == " " + _words(greedy[:8])
    assert [r.token_ids for r in many] == [greedy[:5], short[:5]]
    sampled = [llm.generate(PROMPT, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=s).token_ids
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # the seed fixes the uniforms


def test_llm_batched_and_without_a_draft(pair):
    target, _, draft, greedy, short = pair
    batched = dspark.LLM(target, draft, engine="batched", max_batch=2)
    assert [r.token_ids for r in batched.generate([PROMPT, PROMPT[:2]], max_new_tokens=5)] == [greedy[:5], short[:5]]
    assert batched.generate(PROMPT, max_new_tokens=6).token_ids == greedy[:6]  # the same engine, again
    plain = dspark.LLM(target, no_draft=True)  # engine "auto": the reference engine on the CPU
    result = plain.generate(PROMPT, max_new_tokens=6)
    assert result.token_ids == greedy[:6] and result.stats.acceptance_per_position == []


def test_logit_bias_and_min_p(pair):
    """``logit_bias`` bans a token of the greedy continuation (the output changes where it first
    came, as transformers' with the same bias: test_request_sampling.py); ``min_p`` reaches the
    sampler."""
    target, _, draft, greedy, _ = pair
    k = next(i for i in range(1, 16) if greedy[i] not in greedy[:i])
    llm = dspark.LLM(target, draft, engine="batched", max_batch=2)
    biased = llm.generate(PROMPT, max_new_tokens=k + 4, logit_bias={greedy[k]: -100.0}).token_ids
    assert biased[:k] == greedy[:k] and greedy[k] not in biased
    again = dspark.generate(target, draft, PROMPT, max_new_tokens=k + 4, logit_bias={greedy[k]: -100.0})
    assert again.token_ids == biased
    runs = [llm.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=5, min_p=m).token_ids for m in (0.0, 0.0, 0.9)]
    assert runs[0] == runs[1] != runs[2]
    with pytest.raises(ValueError, match=r"SamplingParams: min_p must be in \[0.0, 1.0\], got -0.1"):
        llm.generate(PROMPT, min_p=-0.1)


def test_penalties_min_tokens_and_bad_words(pair):
    """Each control reaches the engine from ``LLM.generate`` / ``dspark.generate``: a bad word (text)
    never comes; ``min_tokens`` keeps an EOS id, and a stop string, from ending the first tokens;
    penalties change the greedy output. Their exactness: test_penalties.py."""
    target, _, draft, greedy, _ = pair
    k = next(i for i in range(2, 16) if greedy[i] not in greedy[:i])
    llm = dspark.LLM(target, draft, engine="batched", max_batch=2)
    banned = llm.generate(PROMPT, max_new_tokens=k + 4, bad_words=[f"t{greedy[k]}"]).token_ids
    assert banned[:k] == greedy[:k] and greedy[k] not in banned
    assert dspark.generate(target, draft, PROMPT, max_new_tokens=k + 4, bad_words=[f"t{greedy[k]}"]).token_ids == banned
    held = llm.generate(PROMPT, max_new_tokens=16, eos_token_id=greedy[k], min_tokens=k + 2).token_ids
    assert held[:k] == greedy[:k] and greedy[k] not in held[:k + 2]
    unstopped = llm.generate(PROMPT, max_new_tokens=16, stop=[f"t{greedy[k]}"], min_tokens=k + 2)
    assert unstopped.token_ids[:k + 1] == greedy[:k + 1] and f"t{greedy[k]}" in unstopped.text
    strong = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0)
    penalised = [llm.generate(PROMPT, max_new_tokens=8, **{name: value}).token_ids for name, value in strong.items()]
    assert all(ids != greedy[:8] for ids in penalised)
    with pytest.raises(TypeError, match="generate: bad_words must be a list of strings, got 't5'"):
        llm.generate(PROMPT, bad_words="t5")
    with pytest.raises(ValueError, match=r"Request: min_tokens must be at most max_new_tokens \(4\), got 5"):
        llm.generate(PROMPT, max_new_tokens=4, min_tokens=5)


def test_none_none_is_the_demo_pair():
    from dspark.training.data import demo_pair

    result = dspark.generate(None, None, [1, 2, 3], max_new_tokens=4)
    expected = dspark.generate(demo_pair().target, demo_pair().draft, [1, 2, 3], max_new_tokens=4)
    assert result.token_ids == expected.token_ids and len(result.token_ids) == 4 and isinstance(result.text, str)


@pytest.mark.parametrize("models, kwargs, error, message", [
    ((5, None), {}, TypeError, "LLM: target must be a checkpoint directory .*, got int"),
    (("T", 3.0), {}, TypeError, "LLM: draft must be a DSpark checkpoint directory .*, got float"),
    (("T", None), {}, ValueError, "LLM: target 'T' needs a draft: draft is None .*no_draft=True for plain decoding"),
    ((None, "D"), {}, ValueError, "LLM: draft 'D' needs its target: target is None"),
    (("T", "D"), dict(no_draft=True), ValueError, "no_draft=True decodes with the target alone, but a draft was given"),
    (("T", "D"), dict(scheduler="cost"), ValueError, "EngineConfig: scheduler 'cost' needs cost_table"),
    (("T", "D"), dict(engine="fast"), ValueError, "engine must be 'auto', 'batched' or 'reference', got 'fast'"),
])
def test_llm_bad_models_are_clear_errors(pair, models, kwargs, error, message):
    target, _, draft, _, _ = pair
    models = tuple({"T": target, "D": draft}.get(m, m) if isinstance(m, str) else m for m in models)
    with pytest.raises(error, match=message.replace("'T'", repr(str(target))).replace("'D'", repr(str(draft)))):
        dspark.LLM(*models, **kwargs)


def test_a_bad_config_json_names_the_file_and_line(pair, tmp_path):
    target, _, draft, _, _ = pair
    bad = shutil.copytree(draft, tmp_path / "draft")
    (bad / "config.json").write_text('{"speculators_model_type": "dspark",\n}\n')
    message = (f"{str(bad / 'config.json')!r} is not valid JSON: Expecting property name enclosed in double quotes "
               f"(line 2, column 1)")
    for call, where in ((lambda: dspark.LLM(target, bad), "LLM"), (lambda: dspark.generate(target, bad, [1]), "generate"),
                        (lambda: load_draft(bad), "load_draft")):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == f"{where}: {message}"


def test_generate_function_names_its_bad_models():
    with pytest.raises(TypeError, match="generate: target must be a checkpoint directory .*, got int"):
        dspark.generate(7, None, [1, 2, 3])
    with pytest.raises(ValueError, match="generate: draft 'd' needs its target"):
        dspark.generate(None, "d", [1, 2, 3])


def test_generate_function_takes_tree_mode_as_llm_does():
    """``draft_top_k`` / ``tree_budget`` (tree mode) on ``dspark.generate``: the demo pair's 16-node
    top-4 tree verifies 15 drafts a round and gives plain greedy decoding's tokens (fp32); a bad
    setting is the engine's error naming it, as with ``LLM``."""
    prompt = "def fib(n):\n    "
    tree = dspark.generate(None, None, prompt, max_new_tokens=16, draft_top_k=4, tree_budget=16)
    plain = dspark.generate(None, None, prompt, max_new_tokens=16, no_draft=True)
    assert tree.token_ids == plain.token_ids and len(tree.token_ids) == 16
    assert tree.stats.scheduled_lengths and set(tree.stats.scheduled_lengths) == {15}
    for kwargs, message in ((dict(draft_top_k=9), r"draft_top_k must be in \[1, 8\], got 9"),
                            (dict(draft_top_k=2, tree_budget=1), r"tree_budget must be 0 .* got 1")):
        with pytest.raises(ValueError, match=message):
            dspark.generate(None, None, prompt, max_new_tokens=4, **kwargs)
        with pytest.raises(ValueError, match=message):
            dspark.LLM(**kwargs)


@pytest.mark.gpu
def test_llm_captures_every_graph_before_its_first_call(pair):
    """On a GPU ``LLM`` captures its graphs when it is built (a first call captures none, so it is no
    slower than a later one); ``enforce_eager=True`` captures none and gives the same tokens."""
    target, _, draft, greedy, _ = pair
    llm = dspark.LLM(target, draft, device="cuda", dtype=torch.float32, max_batch=4)
    engine = llm.decoder
    captured = engine.runner.captures
    assert captured > 0
    first = llm.generate([PROMPT, PROMPT[:2]], max_new_tokens=16)
    assert engine.runner.captures == captured and first[0].token_ids == greedy
    eager = dspark.LLM(target, draft, device="cuda", dtype=torch.float32, max_batch=4, enforce_eager=True)
    assert not eager.decoder.runner.use_graphs and not eager.decoder.runner.graphs
    assert eager.generate(PROMPT, max_new_tokens=16).token_ids == greedy
