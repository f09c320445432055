"""Prefill time of one prompt on tiny random hybrid targets (tests/test_hf_target.py's configs, fp32,
one CPU thread): prompt chunks scanned position by position (``hybrid.CHUNKED_PROMPTS = False``)
against scanned whole, the prompt in one chunk, no prefix cache (each run scans it all).

    PYTHONPATH=src python scripts/hybrid_prefill_bench.py [families ...]   # default: bamba jamba

Each engine generates one token after the prompt; the median of 10 runs per setting, the settings
interleaved (a shared machine's load drifts), and both settings' tokens asserted equal.
"""
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]
from test_hf_target import COMMON, _model  # noqa: E402

from dspark.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dspark.engine.request import Request  # noqa: E402
from dspark.model import hybrid  # noqa: E402

LENGTH, REPEATS = 512, 5


def prefill_seconds(model, prompt: list[int], chunked: bool) -> tuple[list[float], list[int]]:
    """``REPEATS`` timed runs of ``prompt`` (after one warm-up) and the token each gave."""
    hybrid.CHUNKED_PROMPTS = chunked
    try:
        config = EngineConfig(max_batch=1, max_model_len=len(prompt) + 8, max_num_batched_tokens=len(prompt) + 8,
                              cuda_graphs=False, enable_prefix_caching=False)
        engine = LLMEngine(model, None, config)
        engine.generate([Request(prompt, 1)])
        times, tokens = [], None
        for _ in range(REPEATS):
            start = time.perf_counter()
            tokens = engine.generate([Request(prompt, 1)])[0].token_ids
            times.append(time.perf_counter() - start)
        return times, tokens
    finally:
        hybrid.CHUNKED_PROMPTS = True


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    prompt = [(7 * i + 3) % 90 for i in range(LENGTH)]
    for name in names:
        model = _model(name, {**COMMON, "max_position_embeddings": 2 * LENGTH})
        times, tokens = {False: [], True: []}, {}
        for chunked in (False, True, False, True):
            runs, tokens[chunked] = prefill_seconds(model, prompt, chunked)
            times[chunked] += runs
        assert tokens[False] == tokens[True], (name, tokens)
        sequential, whole = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name}: {LENGTH}-token prompt, median of {2 * REPEATS}: sequential {sequential * 1e3:.0f} ms, "
              f"chunked {whole * 1e3:.0f} ms ({sequential / whole:.1f}x)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bamba", "jamba"])
