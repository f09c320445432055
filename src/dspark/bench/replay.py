"""Acceptance replay: serve an 8B-shaped random target whose drafts are accepted as the shipped demo
pair's were, so that tau and the confidence-acceptance relation are real while the verify cost is an
8B model's (the frontier benchmark of ``dspark serve``, ``python -m dspark.bench.frontier``).

* ``record_traces``: the demo pair (target + DSpark drafter, STS-calibrated confidences) decodes its
  held-out prompts greedily, verifying every draft; each round gives ``[accepted drafts,
  confidence_1 .. confidence_P]``. ``python -m dspark.bench.replay --out FILE`` writes them (the
  package ships them as ``dspark/data/demo/replay_traces.json``).
* ``peaked_target``: a random-weight Qwen3 target of a benchmark shape (``bench.engine.SHAPES``) whose
  greedy next token is decided by a wide margin. A plain random target's logits have near-ties that
  bf16 batching rounds differently, so its greedy continuation depends on the batch and no known
  continuation stays valid; here the embeddings are scaled up (the residual stream is then mostly the
  current token's embedding) and output row y is the (normalised) embedding of token perm[y], so the
  logit of the permuted token is about 100 and the others' ~N(0, 100 / sqrt(hidden)) (1.6 at the 8B
  shape's 4096). Shapes, dtypes and kernels -- the cost -- are those of the random target.
* ``ReplayEngine``: an ``OracleEngine`` (``bench.oracle``, ``replay=True``) that knows the
  benchmark's prompts: it computes their greedy continuations once (plain decoding on its own
  runner; under tensor parallelism on every rank, each knowing them) and gives each request that
  continuation as ``oracle_ids`` and a recorded trace (prompt i -> trace i mod traces) as
  ``oracle_trace``. A round then drafts the continuation's first ``accepted`` tokens and a rejected one,
  with the recorded confidences; the real drafter's forward, Markov chain and confidence head still
  run (their cost), the target verifies for real, and the output is the target's own greedy output.
  When a scheduler verifies fewer drafts than the trace accepted, the round accepts that many; the
  next round replays the next recorded one.
* ``plain_engine`` / ``replay_engine`` / ``random_engine`` (a random drafter drafting for real):
  ``dspark serve --engine-factory`` functions; their settings come from the JSON in
  ``$DSPARK_REPLAY`` (written by ``bench.frontier``). With ``tensor_parallel_size`` in it (``bench.frontier
  --tensor-parallel-size N``) the target and drafter are builders (``bench.tensor_parallel``: each
  rank makes its shard of the same peaked random model, which no process holds whole) at every
  size, 1 included, so sizes give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ..engine import EngineConfig, LLMEngine, Request
from .oracle import OracleEngine

__all__ = ["ReplayEngine", "TRACES", "load_traces", "peaked_target", "plain_engine", "random_engine", "record_traces",
           "replay_engine"]

TRACES = Path(__file__).resolve().parents[1] / "data" / "demo" / "replay_traces.json"
EMBED_SCALE = 1e4  # embeddings of std 0.02 * 1e4 = 200 against a residual stream of order 10 from the layers
MARGIN = 100.0  # the greedy token's logit; the others' are ~N(0, MARGIN / sqrt(hidden))
LEARN_ROWS = 64  # the most rows the engine that learns the continuations decodes at once


# ------------------------------------------------------------------------------ recording


@torch.inference_mode()
def record_traces(max_new_tokens: int = 320, *, device: str = "cpu", pair_dir=None) -> dict:
    """Greedy rounds of the demo pair (``pair_dir``: one ``scripts/build_demo_pair.sh`` wrote; default
    the package's) on its held-out prompts, every draft verified (the drafter's threshold scheduler
    at 0 computes the calibrated confidences and schedules all P)."""
    from ..engine import load_tokenizer
    from ..training.data import demo_pair, read_prompts

    pair = demo_pair() if pair_dir is None else demo_pair(pair_dir)
    tokenizer = load_tokenizer(pair.target)
    records = read_prompts(str(pair.prompts))
    engine = LLMEngine(str(pair.target), str(pair.draft),
                       EngineConfig(max_batch=len(records), scheduler="threshold", threshold=0.0, device=device,
                                    gpu_memory_utilization=None,
                                    dtype=torch.float32))
    p = engine.num_drafts
    ids = {engine.add_request(Request(tokenizer(r["text"])["input_ids"], max_new_tokens)): i
           for i, r in enumerate(records)}
    traces: list[list[list[float]]] = [[] for _ in records]
    while engine.has_unfinished():
        pending = {s.request_id: s.confidence for s in engine.scheduler.running}  # this round's drafts' confidences
        engine.step()
        for rid, confidence in pending.items():
            seq = engine.sequences[rid]
            # a request's first round (the host has not seen its confidences yet) and its last ones,
            # which verify fewer drafts than remain before max_new_tokens, are not recorded
            if confidence is not None and seq.stats.scheduled_lengths[-1] == p:
                traces[ids[rid]].append([seq.stats.accept_lengths[-1] - 1] + [round(float(c), 6) for c in confidence])
    # a prompt answered within its first round (e.g. an immediate end of text) leaves no full round
    kept = [i for i, trace in enumerate(traces) if trace]
    traces = [traces[i] for i in kept]
    rounds = [entry for trace in traces for entry in trace]
    return {"source": "the demo pair (dspark/data/demo: target + draft) on its held-out prompts, greedy, fp32, "
                      f"every draft verified, {max_new_tokens} new tokens per prompt",
            "command": f"python -m dspark.bench.replay --out FILE --max-new-tokens {max_new_tokens}",
            "num_drafts": p, "files": [records[i].get("file") for i in kept],
            "tau": round(1 + sum(e[0] for e in rounds) / len(rounds), 4), "rounds": len(rounds), "traces": traces}


def load_traces(path=TRACES) -> dict:
    """Recorded rounds (``record_traces``' JSON); ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"traces {str(path)!r}: not a readable JSON file of recorded rounds ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("num_drafts"), int) or not data.get("traces") \
            or not all(data["traces"]):
        raise ValueError(f"traces {str(path)!r}: expected num_drafts and a non-empty list of traces per prompt, "
                         "as python -m dspark.bench.replay writes")
    return data


# ------------------------------------------------------------------------------ the target


@torch.no_grad()
def peaked_target(shape: dict, seed: int = 0, **settings):
    """``bench.engine.random_target(shape, seed, **settings)`` with a wide greedy margin (module
    docstring)."""
    from .engine import random_target

    model = random_target(shape, seed, **settings)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    gen = torch.Generator(device=embed.device).manual_seed(seed + 1)
    if head.data_ptr() != embed.data_ptr():  # untied: output row y is the embedding of perm[y], rescaled
        rows = embed.float()
        unit = rows / rows.pow(2).mean(-1, keepdim=True).sqrt()  # what the final RMSNorm makes of it
        perm = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
        head.copy_(unit[perm] * (MARGIN / embed.shape[1]))
    embed.mul_(EMBED_SCALE)  # tied: the next token is the current one
    return model


# ------------------------------------------------------------------------------ the engine


class ReplayEngine(OracleEngine):
    """``OracleEngine`` replaying recorded rounds for a known set of prompts (module docstring)."""

    def __init__(self, target, draft, config: EngineConfig, prompts: list[list[int]], traces: list, max_tokens: int,
                 *, rank=None, known: dict | None = None):
        self._replay_args = dict(prompts=prompts, traces=traces, max_tokens=max_tokens)
        super().__init__(target, draft, config, replay=True, rank=rank)
        # ``known``: another ReplayEngine's of the same target, prompts and traces (learnt once)
        self.known: dict[tuple[int, ...], tuple[list[int], list]] = known or {}
        if rank is None and known is None:  # rank 0 (or the only one): every rank learns them at once
            self.on_every_rank("_learn_continuations")

    def _rank_engine(self):
        return partial(type(self), **self._replay_args)

    def _learn_continuations(self) -> None:
        """``known``: each prompt's greedy continuation (plain decoding on a twin of this engine's
        target runner, every rank's twin in step with the others) and its trace."""
        prompts, traces, max_tokens = (self._replay_args[k] for k in ("prompts", "traces", "max_tokens"))
        # a rank's device by its type: the twin's rank places it (cuda:r) as it placed this engine
        device = self.config.device if self.tp.size == 1 else torch.device(self.config.device).type
        # at most LEARN_ROWS rows: its KV cache sits beside this engine's (a 256-row twin of an 8B
        # target's would not fit an 80 GB card); the continuations are shared across batch sizes anyway
        rows = min(self.config.max_batch, len(prompts), LEARN_ROWS)
        plain = LLMEngine(self.target, None, replace(self.config, scheduler="off", schedule_signal="confidence",
                                                     gpu_memory_utilization=None, device=device, max_batch=rows),
                          rank=self.tp)
        plain.eos_ids = self.eos_ids
        continuation = max_tokens + self.num_drafts + 1  # the last round may draft past max_tokens
        results = plain.generate([Request(ids, continuation, ignore_eos=True) for ids in prompts])
        self.known = {tuple(ids): (r.token_ids, traces[i % len(traces)]) for i, (ids, r) in
                      enumerate(zip(prompts, results))}
        del plain  # its KV cache is not needed any more
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()

    def add_request(self, request: Request, oracle_ids=None, oracle_trace=None) -> int:
        if oracle_ids is None and isinstance(request, Request):
            known = self.known.get(tuple(request.prompt_ids))
            if known is None:
                raise ValueError("this replay benchmark engine serves only its prepared prompts "
                                 f"({len(self.known)} of them); got another prompt of {len(request.prompt_ids)} tokens")
            oracle_ids, oracle_trace = known
        return super().add_request(request, oracle_ids, oracle_trace)


def _spec() -> dict:
    text = os.environ.get("DSPARK_REPLAY")
    if not text:
        raise ValueError("the replay engine factories read their settings from $DSPARK_REPLAY "
                         "(JSON, written by python -m dspark.bench.frontier)")
    return json.loads(text)


def _shape(spec: dict) -> dict:
    """The spec's target shape: a name of ``bench.engine.SHAPES`` or the shape itself."""
    from .engine import SHAPES

    shape = spec.get("shape", "qwen3-8b")
    return SHAPES[shape] if isinstance(shape, str) else shape


def _target(spec: dict):
    from .engine import VOCAB

    return peaked_target(_shape(spec), spec.get("seed", 0), vocab=spec.get("vocab", VOCAB),
                         device=spec.get("device", "cuda"), dtype=getattr(torch, spec.get("dtype", "bfloat16")))


def _models(spec: dict, config: EngineConfig, draft: bool):
    """The engine's target and (``draft``) random drafter: loaded models, or under
    ``tensor_parallel_size`` builders of the same peaked model on every rank (``bench.tensor_parallel``)."""
    if spec.get("tensor_parallel_size") is not None:
        from .engine import VOCAB
        from .tensor_parallel import random_draft, random_shard

        if config.tensor_parallel_size != spec["tensor_parallel_size"]:
            raise ValueError(f"the server's tensor_parallel_size {config.tensor_parallel_size} is not the "
                             f"benchmark's {spec['tensor_parallel_size']}")
        models = (spec.get("shape", "qwen3-8b"), spec.get("seed", 0), spec.get("vocab", VOCAB),
                  spec.get("dtype", "bfloat16"))
        return partial(random_shard, *models), partial(random_draft, *models, spec.get("draft_rank", 256)) \
            if draft else None
    from .engine import random_drafter

    target = _target(spec)
    return target, random_drafter(target, _shape(spec), rank=spec.get("draft_rank", 256)) if draft else None


def plain_engine(config: EngineConfig) -> LLMEngine:
    """``--engine-factory dspark.bench.replay:plain_engine``: the peaked target, plain decoding."""
    return LLMEngine(_models(_spec(), config, draft=False)[0], None, config)


def random_engine(config: EngineConfig) -> LLMEngine:
    """``--engine-factory dspark.bench.replay:random_engine``: the peaked target and a random DSpark
    drafter of its shape, drafting for real (nearly every draft rejected, tau ~ 1): DSpark's
    mechanics and cost under any request settings, greedy and sampled (the mixed-settings workload
    of ``bench.frontier``; acceptance replay serves greedy requests only)."""
    return LLMEngine(*_models(_spec(), config, draft=True), config)


def replay_engine(config: EngineConfig) -> ReplayEngine:
    """``--engine-factory dspark.bench.replay:replay_engine``: the peaked target and a random DSpark
    drafter of its shape (``bench.engine.random_drafter``, Markov rank ``draft_rank``) under
    acceptance replay."""
    spec = _spec()
    target, draft = _models(spec, config, draft=True)
    traces = load_traces(spec.get("traces", TRACES))
    engine = ReplayEngine(target, draft, config, _prompts(spec), traces["traces"], spec["max_tokens"])
    if traces["num_drafts"] != engine.num_drafts:
        engine.close()
        raise ValueError(f"the traces have {traces['num_drafts']} drafts per round, the drafter {engine.num_drafts}")
    return engine


def _prompts(spec: dict) -> list[list[int]]:
    """The benchmark's prompts (``bench.serve.random_prompts`` of the spec's vocabulary)."""
    from .engine import VOCAB
    from .serve import random_prompts

    return random_prompts(spec["num_prompts"], spec["prompt_tokens"], spec.get("vocab", VOCAB),
                          spec.get("prompt_tokens_max"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.replay",
                                     description="Record the demo pair's rounds for acceptance replay.")
    parser.add_argument("--out", default=str(TRACES), help="JSON file to write (default: the package's)")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pair", default=None, help="a demo pair's directory (default: the package's)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        data = record_traces(args.max_new_tokens, device=args.device, pair_dir=args.pair)
    except ValueError as exc:  # an incomplete pair directory: say which, no traceback
        parser.error(str(exc))
    Path(args.out).write_text(json.dumps(data, separators=(",", ":")))
    print(f"wrote {args.out}: {data['rounds']} rounds of {len(data['traces'])} prompts, tau {data['tau']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
