"""Tensor-parallel targets: ``python -m dspark.bench.tensor_parallel --shape qwen3-8b --sizes 1,2 --out DIR``.

Per tensor-parallel size, on random-weight Qwen3-shaped targets (``bench.engine.SHAPES``; ``70b``:
Llama-3-70B's dimensions, more than one GPU holds) with the greedy margin of
``bench.replay.peaked_target`` and a random DSpark drafter (block 7, Markov rank 256: the real draft
pass's cost, drafts the target rejects), each through ``LLMEngine`` with CUDA graphs:

* B = 1: the median step of plain decoding (the target alone: the issue's "target step time") and
  of a DSpark round;
* B = ``--batch`` (64): the steady-state throughput of plain decoding and of DSpark.

Every rank builds its own shard of the random target from a seed (``random_shard``: each tensor
from its own generator, so the ranks' slices are slices of one model and no process holds it whole)
and the same drafter (``random_draft``). One tensor-parallel engine runs at a time (the ranks'
process group is the process's default one). Writes ``tensor_parallel.json``. ``--device cpu
--shape tiny`` runs the same on the CPU (gloo): the plumbing, not a measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ..model.llama import TargetLM, TensorSource
from ..model.parallel import SINGLE_RANK
from .engine import SHAPES, TINY, VOCAB, drafter_for, engine_run, qwen3_config, steady_config
from .replay import EMBED_SCALE, MARGIN

__all__ = ["RandomSource", "random_draft", "random_shard", "measure"]

STD = 0.02  # Hugging Face's initializer_range


class RandomSource(TensorSource):
    """The random weights of a Qwen3 config (``shape``: a name of ``SHAPES``, ``"tiny"`` or a shape
    dict), by name, made
    on ``device``: norms 1, every other tensor N(0, 0.02) from a generator seeded by ``seed`` and its
    name (the same tensor on every rank and device); the embedding scaled and the untied head made of
    permuted embedding rows as ``bench.replay.peaked_target`` (greedy margin ~100). A split makes the
    whole tensor, then keeps its slice (a tensor at a time: at most the embedding in f32 at once)."""

    def __init__(self, shape: str, seed: int, vocab: int, device, dtype: torch.dtype):
        from transformers import Qwen3ForCausalLM

        self.shape_dict = shape if isinstance(shape, dict) else TINY if shape == "tiny" else SHAPES[shape]
        self.config = qwen3_config(self.shape_dict, self.shape_dict.get("vocab", vocab))
        with torch.device("meta"):  # the names and shapes, no memory
            shapes = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(self.config).state_dict().items()}
        super().__init__(shapes, device)
        self.seed, self.dtype = seed, dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return self.state[key]

    def read(self, key: str, split: tuple[int, int, int] | None = None) -> torch.Tensor:
        t = self.full(key)
        if split is not None:
            t = t.narrow(split[0], split[1], split[2] - split[1])
        return t.to(self.dtype).contiguous()

    def full(self, key: str) -> torch.Tensor:
        """The whole f32 tensor ``key``."""
        if key.endswith("norm.weight"):
            return torch.ones(self.state[key], device=self.device)
        if key == "lm_head.weight":
            return self._head()
        t = self._normal(key)
        return t * EMBED_SCALE if key == "model.embed_tokens.weight" else t

    def _normal(self, key: str) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        return torch.empty(self.state[key], device=self.device).normal_(0.0, STD, generator=gen)

    def _head(self) -> torch.Tensor:
        """Output row y: the (RMS-normalised) embedding row of token perm[y], times MARGIN / hidden;
        tied: the embedding itself."""
        if self.config.tie_word_embeddings:
            return self.full("model.embed_tokens.weight")
        rows = self._normal("model.embed_tokens.weight")
        unit = rows / rows.pow(2).mean(-1, keepdim=True).sqrt()
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 1)
        perm = torch.randperm(rows.shape[0], generator=gen, device=self.device)
        return unit[perm] * (MARGIN / rows.shape[1])


def random_shard(shape, seed: int, vocab: int, dtype: str, capture_layer_ids, *, tp=SINGLE_RANK,
                 device=None) -> TargetLM:
    """A target builder (``engine.target.is_builder``): rank ``tp``'s shard of the random target."""
    source = RandomSource(shape, seed, vocab, device or "cpu", getattr(torch, dtype))
    return TargetLM.from_tensor_source(source.config, source, capture_layer_ids, tp=tp)


def random_draft(shape: str, seed: int, vocab: int, dtype: str, draft_rank: int = 256, *, device=None):
    """A draft builder: the random drafter of the random target (the same on every rank; Markov rank
    ``draft_rank``)."""
    source = RandomSource(shape, seed, vocab, device or "cpu", getattr(torch, dtype))
    with torch.random.fork_rng(devices=[source.device] if source.device.type == "cuda" else []):
        torch.manual_seed(seed)
        return drafter_for(source.config, source.read("model.embed_tokens.weight"), source.read("lm_head.weight"),
                           source.shape_dict, rank=draft_rank)


def measure(shape: str, size: int, *, batch: int, prompt: int, new: int, device: str, dtype: str,
            eager: bool = False, seed: int = 0) -> dict:
    """B = 1 and B = ``batch`` (plain and DSpark) at tensor-parallel size ``size``."""
    from ..engine import LLMEngine
    # the builders by their package name, also under `python -m` (the ranks unpickle them by name)
    from .tensor_parallel import random_draft, random_shard

    vocab = (TINY if shape == "tiny" else SHAPES[shape]).get("vocab", VOCAB)
    target = partial(random_shard, shape, seed, vocab, dtype)
    draft = partial(random_draft, shape, seed, vocab, dtype)
    prompts = [torch.randint(0, vocab - 1, (prompt,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    result = {}
    for name, drafter in (("plain", None), ("dspark", draft)):
        config = steady_config(batch, prompt, new)
        config = replace(config, device=device, dtype=getattr(torch, dtype), tensor_parallel_size=size,
                         cuda_graphs=not eager,
                         # a DSpark step holds every row's verify (block 7 + 1) beside the prompt chunks
                         max_num_batched_tokens=config.max_num_batched_tokens + batch * 8)
        engine = LLMEngine(target, drafter, config)
        try:
            engine.capture_graphs()
            one, many = engine_run(engine, prompts[:1], new), engine_run(engine, prompts, new)
        finally:
            engine.close()
        result[name] = {"b1_step_ms": one["step_ms"], f"b{batch}_tok_per_s": many["tok_per_s"],
                        f"b{batch}_step_ms": many["step_ms"], "b1_outputs_head": one["outputs"][0][:8]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.tensor_parallel", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="tp-bench", help="directory for tensor_parallel.json")
    parser.add_argument("--shape", default="qwen3-8b", help="one of " + ", ".join([*SHAPES, "tiny"]))
    parser.add_argument("--sizes", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--batch", type=int, default=64, help="the large batch")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (gloo) for the plumbing")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args(argv)
    if args.shape not in SHAPES and args.shape != "tiny":
        parser.error(f"--shape takes {', '.join([*SHAPES, 'tiny'])}, got {args.shape!r}")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes comma-separated ints, got {args.sizes!r}")
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    report = {"shape": args.shape, "batch": args.batch, "prompt": args.prompt, "new": args.new, "device": args.device,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "sizes": {}}
    for size in sizes:
        report["sizes"][size] = measure(args.shape, size, batch=args.batch, prompt=args.prompt, new=args.new,
                                        device=args.device, dtype=dtype, eager=args.enforce_eager)
        print(f"tp {size}: {json.dumps(report['sizes'][size])}", flush=True)
    base = report["sizes"].get(1)
    for size, row in report["sizes"].items():
        if base is not None and size != 1:  # the issue's bar: a TP 2 target step at most 0.6x TP 1's
            row["plain_b1_step_vs_tp1"] = round(row["plain"]["b1_step_ms"] / base["plain"]["b1_step_ms"], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_parallel.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'tensor_parallel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
