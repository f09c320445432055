"""The fused greedy Markov step with W2 resident in L2 ("hot") and from HBM ("cold"), on a GPU.

    python scripts/hot_markov_steps.py

Hot: 20 back-to-back launches captured in one CUDA graph, median over 50 replays of the time per
launch (the harness of the issue's 11.3 µs / NVIDIA's 10.1 µs FP8 number at B = 1, R = 64). Cold:
``bench.common.graph_us`` (L2 flushed before every replay, one launch per graph), as in the greedy
benchmark.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from dspark.bench import greedy as bg  # noqa: E402
from dspark.bench.common import capture_graph, graph_us, median_us  # noqa: E402
from dspark.kernels.triton import markov as tmarkov  # noqa: E402

LAUNCHES = 20


def hot_us(fn) -> float:
    graph = capture_graph(lambda: [fn() for _ in range(LAUNCHES)])
    return median_us(graph.replay) / LAUNCHES


for rank in (64, 256):
    for batch in (1, 8, 64):
        step = bg._Step(batch, rank, torch.float16)
        for fp8 in (False, True):
            fn = bg._launch(step, fp8, False, tmarkov.markov_config(batch, rank, fp8, False))
            print(f"B={batch} R={rank} W2={'fp8_e4m3' if fp8 else 'float16'}: hot {hot_us(fn):6.2f} us  "
                  f"cold {graph_us(fn):6.2f} us", flush=True)
        del step
