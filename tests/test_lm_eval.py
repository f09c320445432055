"""lm-evaluation-harness against ``dspark serve``: its ``local-completions`` model (the OpenAI client
lm-eval ships, its defaults: token-id prompts, echo + logprobs for loglikelihoods) on the demo pair,
served as ``dspark serve`` runs it (the engine in its own process, a real loopback port).

Oracle: lm-eval's own ``hf`` model (transformers, float32 on the CPU) on the same two local tasks --
a multiple-choice task (loglikelihood requests) and a ``generate_until`` one (greedy): the
per-sample loglikelihoods and greediness, the accuracy and the generated texts must be the same.
Everything is local (task files written here, the hub and datasets offline).
"""

import functools
import json

import pytest
import torch

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

from test_serve import MODEL, TIMEOUT, ServerThread  # noqa: E402

from dspark.engine import EngineConfig, LLMEngine  # noqa: E402
from dspark.serve import create_app  # noqa: E402
from dspark.serve.engine_process import EngineClient  # noqa: E402
from dspark.training.data import demo_pair  # noqa: E402

TOL = 1e-4  # float32: the engine's kernels and transformers' round apart by ~1e-5 over a continuation
MULTIPLE_CHOICE = [  # lm-eval puts its target_delimiter, a space, between question and choice
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a river"], "answer": 0},
    {"question": "Water is made of hydrogen and", "choices": ["oxygen", "gold", "music"], "answer": 0},
    {"question": "Once upon a time there was a", "choices": ["little girl", "theorem", "blue"], "answer": 0},
    {"question": "She opened the door and", "choices": ["walked in", "seven", "the the"], "answer": 0},
    # the demo target's greedy continuation (lm-eval's is_greedy: True) against two that are not
    {"question": "Once upon a time,", "choices": ["they are not", "we", "blue"], "answer": 1},
]
GENERATE = [{"prompt": "Once upon a time,", "target": ""}, {"prompt": "The little dog", "target": ""},
            {"prompt": "Tom and Lily went to the park.", "target": ""}]


def served_engine(target: str, draft: str) -> LLMEngine:
    """The engine process's engine (one intra-op thread: two ran 10-20x slower on a busy 2-core box)."""
    torch.set_num_threads(1)
    return LLMEngine(target, draft, EngineConfig(max_batch=4, max_num_batched_tokens=4 * 8 + 8))


def _task(directory, name: str, docs: list[dict], body: str) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {directory / 'cache'}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """lm-eval's ``TaskManager`` of the two local tasks alone (indexing its built-in ones takes 30 s)."""
    from lm_eval.tasks import TaskManager

    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    _task(directory, "dspark_mc", MULTIPLE_CHOICE, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
          "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    _task(directory, "dspark_gen", GENERATE, "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
          "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n\\n', '.']\n  max_gen_toks: 10\n"
          "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return TaskManager(include_path=str(directory), include_defaults=False)


@pytest.fixture
def offline(monkeypatch):
    """No network: the hub and datasets offline (the variables, and the flags already read from them)."""
    import datasets
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _evaluate(model: str, model_args: str, tasks) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["dspark_mc", "dspark_gen"],
                                   task_manager=tasks, batch_size=1, bootstrap_iters=0, log_samples=True)


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_local_completions_against_dspark_serve_equals_its_hf_model(tasks, offline):
    pair = demo_pair()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    client = EngineClient(functools.partial(served_engine, str(pair.target), str(pair.draft)))
    try:
        from transformers import AutoTokenizer

        app = create_app(client, AutoTokenizer.from_pretrained(str(pair.target)), MODEL)
        with ServerThread(app) as server:
            served = _evaluate("local-completions", f"model={MODEL},base_url={server.url}/v1/completions,"
                                                    f"tokenizer={pair.target},max_retries=1", tasks)
        hf = _evaluate("hf", f"pretrained={pair.target},dtype=float32,device=cpu", tasks)
    finally:
        client.stop(TIMEOUT)  # the server's shutdown stopped it already, unless it never started
        torch.set_num_threads(threads)
    mine, theirs = _responses(served, "dspark_mc"), _responses(hf, "dspark_mc")
    assert len(mine) == len(MULTIPLE_CHOICE)
    for doc, (ours, oracle) in enumerate(zip(mine, theirs)):
        assert len(ours) == len(MULTIPLE_CHOICE[doc]["choices"])
        for (ll, greedy), (expected, expected_greedy) in zip((r[0] for r in ours), (r[0] for r in oracle)):
            assert ll == pytest.approx(expected, abs=TOL) and greedy == expected_greedy
    assert {r[0][1] for ours in mine for r in ours} == {True, False}  # both kinds compared
    assert served["results"]["dspark_mc"]["acc,none"] == hf["results"]["dspark_mc"]["acc,none"]
    generated = _responses(served, "dspark_gen")
    assert generated == _responses(hf, "dspark_gen") and any(r[0][0].strip() for r in generated)
