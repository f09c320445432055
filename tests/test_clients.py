"""Third-party clients against ``dspark serve`` (the demo pair on the CPU), as a user calls them.

litellm (``hosted_vllm/`` and ``openai/`` providers: chat and text completion, streamed and not) and
the ``openai`` client's chat stream with ``stream_options.include_usage``. Greedy answers must equal
the engine's offline greedy output (``LLMEngine.generate`` before the server starts), their
``usage`` the prompt's and the output's token counts; with litellm's defaults (OpenAI's temperature 1)
the answers must still be well formed and a ``seed`` must repeat. guidellm's time-bounded sweep is
run by ``scripts/guidellm_sweep.sh`` (docs/serving.md, "Clients"): minutes, not a unit test.
"""

import os
from typing import NamedTuple

import pytest

# litellm fetches its model-price map from GitHub at import unless told to use its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("fastapi")
litellm = pytest.importorskip("litellm")
openai = pytest.importorskip("openai")

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.training.data import demo_pair, read_prompts  # noqa: E402
from test_serve import TIMEOUT, ServerThread  # noqa: E402

MODEL = "demo"
NEW = 8
PROVIDERS = ("hosted_vllm", "openai")  # litellm's vLLM provider and its generic OpenAI-compatible one


class Greedy(NamedTuple):
    """A prompt's offline greedy answer, as the server must report it."""

    prompt_tokens: int
    completion_tokens: int
    text: str
    finish_reason: str


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_pair().target))


@pytest.fixture(scope="module")
def prompt():
    return read_prompts(str(demo_pair().prompts))[0]["text"][:120]


@pytest.fixture(scope="module")
def messages(prompt):
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def served(tokenizer, prompt, messages):
    """(the server's /v1 URL, {"text" | "chat": Greedy})."""
    pair = demo_pair()
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=4, max_model_len=256))
    prompts = {"text": tokenizer(prompt)["input_ids"],  # as the server tokenises each endpoint's prompt
               "chat": tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False)["input_ids"]}
    outputs = engine.generate([Request(ids, NEW, SamplingParams()) for ids in prompts.values()])
    reference = {kind: Greedy(len(ids), len(out.token_ids), tokenizer.decode(out.token_ids, skip_special_tokens=True),
                              "length" if len(out.token_ids) == NEW else "stop")
                 for (kind, ids), out in zip(prompts.items(), outputs)}
    assert all(greedy.text for greedy in reference.values()), "the comparison needs a non-empty greedy output"
    with ServerThread(create_app(engine, tokenizer, MODEL)) as server:
        yield server.url + "/v1", reference


def _litellm_args(url: str, provider: str, **kw) -> dict:
    return dict(model=f"{provider}/{MODEL}", api_base=url, api_key="unused", max_tokens=NEW, timeout=TIMEOUT,
                num_retries=0, **kw)


def _assert_usage(usage, greedy: Greedy):
    assert (usage.prompt_tokens, usage.completion_tokens) == (greedy.prompt_tokens, greedy.completion_tokens)
    assert usage.total_tokens == greedy.prompt_tokens + greedy.completion_tokens


def _assert_choices(choices, text: str, greedy: Greedy):
    """``text``: the choices' text joined; one finish_reason, the last choice's."""
    assert text == greedy.text
    assert [c.finish_reason for c in choices][-1] == greedy.finish_reason
    assert all(c.finish_reason is None for c in choices[:-1])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_litellm_chat_equals_offline_greedy(served, messages, provider):
    url, reference = served
    greedy = reference["chat"]
    response = litellm.completion(**_litellm_args(url, provider, messages=messages, temperature=0))
    assert response.choices[0].message.role == "assistant"
    _assert_choices(response.choices, response.choices[0].message.content, greedy)
    _assert_usage(response.usage, greedy)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_litellm_chat_stream_equals_offline_greedy(served, messages, provider):
    url, reference = served
    greedy = reference["chat"]
    chunks = list(litellm.completion(**_litellm_args(url, provider, messages=messages, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})))
    choices = [c.choices[0] for c in chunks if c.choices]
    _assert_choices(choices, "".join(c.delta.content or "" for c in choices), greedy)
    _assert_usage(chunks[-1].usage, greedy)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_litellm_text_completion_equals_offline_greedy(served, prompt, provider, stream):
    url, reference = served
    greedy = reference["text"]
    response = litellm.text_completion(**_litellm_args(url, provider, prompt=prompt, temperature=0, stream=stream))
    chunks = list(response) if stream else [response]
    choices = [c.choices[0] for c in chunks if c.choices]
    _assert_choices(choices, "".join(c.text or "" for c in choices), greedy)
    if not stream:
        _assert_usage(response.usage, greedy)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_litellm_default_sampling_is_well_formed_and_a_seed_repeats(served, messages, provider):
    """No temperature: OpenAI's default 1 (sampled); the same seed gives the same answer."""
    url, reference = served
    answers = [litellm.completion(**_litellm_args(url, provider, messages=messages, seed=7)) for _ in range(2)]
    for response in answers:
        choice = response.choices[0]
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
        assert response.usage.prompt_tokens == reference["chat"].prompt_tokens
        assert 0 < response.usage.completion_tokens <= NEW
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_openai_chat_stream_includes_usage(served, messages):
    url, reference = served
    greedy = reference["chat"]
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=TIMEOUT, max_retries=0)
    *chunks, last = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    choices = [c.choices[0] for c in chunks]
    _assert_choices(choices, "".join(c.delta.content or "" for c in choices), greedy)
    assert last.choices == []
    _assert_usage(last.usage, greedy)
