"""τ (tokens per round) of the demo pair with and without a structured output, on the CPU:
six held-out prompts, 64 new tokens, greedy and sampled (T = 1); docs/structured-outputs.md's table.

    PYTHONPATH=src python scripts/structured_tau.py                               # chain drafting
    PYTHONPATH=src python scripts/structured_tau.py --draft-top-k 4 --tree-budget 16   # tree mode
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams, StructuredOutputs
from dspark.training.data import demo_pair, read_prompts

SCHEMA = {"type": "object", "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4}}}
SPECS = {"free": None, "json schema": StructuredOutputs(json=SCHEMA),
         "regex": StructuredOutputs(regex=r"def [a-z_]+\((self)?\):\n    return [a-z_.]+\n"),
         "ebnf grammar": StructuredOutputs(grammar='root ::= ("import " [a-z]+ "\\n")+')}


def tau(engine: LLMEngine, prompts: list[list[int]], spec: StructuredOutputs | None, temperature: float) -> float:
    out = engine.generate([Request(p, 64, SamplingParams(temperature, seed=i, structured_outputs=spec))
                           for i, p in enumerate(prompts)])
    return sum(sum(o.stats.accept_lengths) for o in out) / sum(len(o.stats.accept_lengths) for o in out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-top-k", type=int, default=1, help="> 1: tree mode, top-k candidates per depth")
    parser.add_argument("--tree-budget", type=int, default=0, help="tree nodes with the root (0: block size + 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [tokenizer(r["text"][:200])["input_ids"] for r in read_prompts(str(pair.prompts))[:6]]
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=8, max_model_len=512,
                                                                       draft_top_k=args.draft_top_k,
                                                                       tree_budget=args.tree_budget))
    free = {t: tau(engine, prompts, None, t) for t in (0.0, 1.0)}
    for name, spec in SPECS.items():
        cells = [(tau(engine, prompts, spec, t) if spec else free[t], free[t]) for t in (0.0, 1.0)]
        print(f"{name:13s} greedy {cells[0][0]:.2f} ({cells[0][0] / cells[0][1]:.2f}x)   "
              f"sampled {cells[1][0]:.2f} ({cells[1][0] / cells[1][1]:.2f}x)")


if __name__ == "__main__":
    main()
