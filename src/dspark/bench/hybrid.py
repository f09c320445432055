"""Hybrid-target benchmark (issue 39): ``python -m dspark.bench.hybrid --out DIR``.

A random-weight Qwen3.5-shaped target (gated DeltaNet layers beside full attention; bf16 on a GPU,
fp32 on the CPU) through dspark's Hugging Face backend (``HFTarget`` + ``model.hybrid``'s state
pool; fla-core's gated delta rule kernels on a GPU). Per batch size (``--batches``, default 1,64),
prompts of ``--prompt`` tokens and ``--new`` new tokens per request:

* ``hf_compiled`` / ``hf_eager``: one decode step of transformers' own model
  (``bench.engine.hf_step_ms``: ``generate``'s ``StaticCache`` + ``torch.compile(mode=
  "reduce-overhead")`` recipe, ``fullgraph=True`` first and, if that fails, ``fullgraph=False``;
  or eager with a ``DynamicCache``), each in a child process of its own (``in_child``) that builds
  the same random target (same seed, same weights) and is killed after ``--hf-timeout`` seconds (a
  compile that never finishes is recorded as ``{"error": "timed out after N s"}``); the child's
  model is never routed through dspark, and its exit gives its GPU memory back;
* ``plain``: dspark's engine decoding without a drafter (``LLMEngine``, CUDA graphs on a GPU), the
  median steady step (``bench.engine.engine_run``);
* ``dspark_random``: DSpark rounds with a random drafter of the target's hidden size (block 7,
  Markov rank 256, scheduler off: every row verifies its whole block, the drafts rejected), i.e.
  the full round's cost at one token per row;
* ``dspark_a1``: the same rounds with the drafts replaced by the target's own greedy continuation
  (``bench.oracle.OracleEngine`` at acceptance 1), the round's cost at its best tokens per round;

each with ms per step, tokens per step and ms per token, beside the weight-read floor (parameter bytes
over the measured copy ceiling; GPU only). Order: dspark's three measurements for every batch size
first, then the baselines for every batch size (the parent's model freed before them), so that a
baseline that hangs costs at most its timeout and never dspark's numbers. A measurement that fails
is recorded as its error, the others still run. Writes ``hybrid.json`` (rewritten after each
measurement) and prints a table. ``--hf none`` times dspark's engine alone;
``--no-gated-delta-checkpoints`` runs dspark's engines with a state per position instead of gated
DeltaNet checkpoints (``EngineConfig.gated_delta_checkpoints``, the engine's default).

Shapes (``SHAPES``): ``qwen3.5-9b`` is ``transformers.Qwen3_5TextConfig()``'s defaults as such
(transformers 5.25; its docstring: "the Qwen3.5-9B style configuration"): vocabulary 248,320, hidden
4096, MLP 12,288, 32 layers of which every 4th is full attention (16 query / 4 KV heads of 256, a
quarter of each head rotated) and the other 24 gated DeltaNet (16 key heads / 32 value heads of 128,
conv kernel 4), untied head: 8.95 G parameters, 17.9 GB in bf16. Its drafter captures layers 1, 8, 15,
22, 29 (five, evenly spread, as ``bench.engine``'s Qwen3-8B shape). ``tiny``: the same layout at toy
sizes (4 layers, the plumbing on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .common import measure_copy_ceiling_gbps, profile_table, record, release
from .engine import engine_run, hf_step_ms, random_drafter, steady_config, weight_floor
from .isolate import attempt, in_child

SHAPES = {
    "qwen3.5-9b": dict(config={}, capture=[1, 8, 15, 22, 29]),  # Qwen3_5TextConfig's defaults (module docstring)
    "tiny": dict(config=dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
                 capture=[0, 2]),
}
HF_STEPS = {False: 24, True: 48}  # eager, compiled: the median of the second half (compiling, warm-up first)


def random_target(shape: dict, seed: int = 0, *, device="cuda", dtype=torch.bfloat16):
    """A random-weight ``Qwen3_5ForCausalLM`` of ``shape`` (``SHAPES``; transformers' initialisation,
    cast to ``dtype``), eval mode, no gradients."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape["config"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def hf_compiled(model, batch: int, prompt: int) -> dict:
    """``hf_step_ms`` compiled, ``fullgraph=True`` first (``generate``'s setting), else with graph
    breaks (fla's Triton kernels or the hybrid cache may break the graph), the first attempt's
    compiled code dropped before the second (each baseline has a process of its own: ``in_child``)."""
    try:
        return dict(step_ms=round(hf_step_ms(model, batch, prompt, HF_STEPS[True], compiled=True), 3), fullgraph=True)
    except Exception as exc:  # noqa: BLE001 - retried with graph breaks, the first error kept
        torch._dynamo.reset()
        ms = hf_step_ms(model, batch, prompt, HF_STEPS[True], compiled=True, fullgraph=False)
        return dict(step_ms=round(ms, 3), fullgraph=False, fullgraph_error=f"{type(exc).__name__}: {exc}"[:300])


def hf_eager(model, batch: int, prompt: int) -> dict:
    """``hf_step_ms`` eager (a ``DynamicCache``)."""
    return dict(step_ms=round(hf_step_ms(model, batch, prompt, HF_STEPS[False], compiled=False), 3))


HF_BASELINES = {"hf_compiled": hf_compiled, "hf_eager": hf_eager}  # row key -> measure(model, batch, prompt)


@dataclass(frozen=True)
class TargetRecipe:
    """What a child process needs to rebuild the parent's random target: ``random_target`` is
    seeded, so the same shape, seed, device and dtype give the same weights. ``threads``: the
    parent's intra-op thread count (a spawned child starts with torch's default)."""

    shape: str
    device: str
    dtype: torch.dtype
    seed: int
    threads: int

    def build(self):
        torch.set_num_threads(self.threads)
        return random_target(SHAPES[self.shape], self.seed, device=self.device, dtype=self.dtype)


def hf_baseline(measure, recipe: TargetRecipe, batch: int, prompt: int) -> dict:
    """In a child process (``in_child``): ``measure(model, batch, prompt)`` (``HF_BASELINES``) of a
    fresh copy of the target, transformers' own code (no engine ever routes it)."""
    return measure(recipe.build(), batch, prompt)


def timed(engine, prompts: list[list[int]], new: int, oracle=None) -> dict:
    """``engine_run``'s steady step, with ms per committed token; the outputs kept under ``outputs``."""
    result = engine_run(engine, prompts, new, oracle)
    result["ms_per_token"] = round(result["step_ms"] / result["tokens_per_step"], 4)
    return result


def hf_baselines(recipe: TargetRecipe, row: dict, args, save) -> None:
    """transformers' decode step at ``row["batch"]`` rows (``args.hf``: compiled, eager) into ``row``,
    each in a child process bounded by ``args.hf_timeout`` seconds (``in_child``), ``save()`` after each."""
    for name, measure in HF_BASELINES.items():
        if name[3:] in args.hf:
            row[name] = attempt(lambda: in_child(hf_baseline, measure, recipe, row["batch"], args.prompt,
                                                 timeout=args.hf_timeout))
            save()


def dspark_runs(model, drafter, row: dict, args, generator: torch.Generator, save) -> None:
    """dspark's engines at ``row["batch"]`` rows (module docstring: plain, dspark_random, dspark_a1)
    into ``row``, each engine sized for the batch and freed after its run; ``save()`` after each."""
    from ..engine import LLMEngine
    from .oracle import OracleEngine

    batch, vocab = row["batch"], model.config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (args.prompt,), generator=generator).tolist() for _ in range(batch)]

    def steady(draft):  # the engine's config, with or without gated DeltaNet checkpoints
        return replace(steady_config(batch, args.prompt, args.new, draft),
                       gated_delta_checkpoints=args.gated_delta_checkpoints)

    config = steady(drafter)
    pad = [0] * (drafter.config.num_draft_tokens + 1)  # room for the last round's drafts past the continuation

    def plain() -> dict:
        return timed(LLMEngine(model, None, steady(None)), prompts, args.new)

    def oracle_rounds() -> dict:
        # the oracle is the DSpark runner's own greedy continuation: in bf16 a verify window and a
        # one-token step round differently, so plain decoding's tokens seed a first run whose outputs
        # are the oracle (as bench.engine.run_shape)
        engine = OracleEngine(model, drafter, config, acceptance=1.0)
        first = engine_run(engine, prompts, args.new, [o + pad for o in plain_outputs])["outputs"]
        return timed(engine, prompts, args.new, [o + pad for o in first])

    def random_rounds() -> dict:
        engine = LLMEngine(model, drafter, config)
        result = timed(engine, prompts, args.new)
        if batch in args.profile:  # the same requests once more, profiled
            (Path(args.out) / f"profile-dspark_random-b{batch}.txt").write_text(
                profile_table(lambda: engine_run(engine, prompts, args.new), model.device))
        return result

    plain_outputs = record(row, "plain", plain, model.device, save)
    record(row, "dspark_random", random_rounds, model.device, save)
    if plain_outputs is not None:  # else plain decoding failed: its error is in the row
        record(row, "dspark_a1", oracle_rounds, model.device, save)


def markdown(report: dict) -> str:
    """The report as a table: ms per step (and per token for the engine's runs) per batch size."""
    floor = f"{report['floor_ms']} ms" if report["floor_ms"] is not None else "not measured (CPU)"
    lines = [f"### {report['shape']} ({report['dtype']}, {report['device']}): prompt {report['prompt']}, "
             f"{report['new']} new tokens; weight-read floor {floor} ({report['parameter_bytes']:,} parameter "
             "bytes)", "",
             "| B | HF compiled ms/step | HF eager ms/step | plain ms/step | plain ms/token | DSpark round ms "
             "(random drafts) | ms/token | DSpark round ms (acceptance 1) | tokens/round/row | ms/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(result: dict | None, key: str):
        if result is None:
            return "–"
        return "error" if "error" in result else result[key]

    for r in report["rows"]:
        a1 = r.get("dspark_a1")
        per_row = "–" if a1 is None else "error" if "error" in a1 else round(a1["tokens_per_step"] / r["batch"], 2)
        lines.append(f"| {r['batch']} | {cell(r.get('hf_compiled'), 'step_ms')} | "
                     f"{cell(r.get('hf_eager'), 'step_ms')} | "
                     f"{cell(r['plain'], 'step_ms')} | {cell(r['plain'], 'ms_per_token')} | "
                     f"{cell(r['dspark_random'], 'step_ms')} | {cell(r['dspark_random'], 'ms_per_token')} | "
                     f"{cell(a1, 'step_ms')} | {per_row} | {cell(a1, 'ms_per_token')} |")
    errors = [f"- B = {r['batch']} {k}: {v['error']}" for r in report["rows"] for k, v in r.items()
              if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + ([""] + errors if errors else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.hybrid", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="hybrid-bench", help="directory for hybrid.json")
    parser.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--hf", default="compiled",
                        help="comma-separated transformers baselines: compiled, eager, none")
    parser.add_argument("--hf-timeout", type=float, default=180,
                        help="seconds each transformers baseline (a child process) may take before it is killed "
                             "and recorded as timed out")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: fp32, the plumbing (--shape tiny)")
    parser.add_argument("--profile", default="", help="comma-separated batch sizes whose random-draft DSpark "
                        "requests run once more under the PyTorch profiler (OUT/profile-dspark_random-b<B>.txt)")
    parser.add_argument("--gated-delta-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                        help="dspark's engines keep gated DeltaNet checkpoints (the engine's default), or with "
                             "--no-gated-delta-checkpoints a state per position (EngineConfig.gated_delta_checkpoints)")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.profile = [int(b) for b in args.profile.split(",") if b]
    except ValueError:
        parser.error(f"--batches and --profile take comma-separated integers, got {args.batches!r} / {args.profile!r}")
    if any(b not in args.batches for b in args.profile):
        parser.error(f"--profile must name batch sizes of --batches {args.batches}, got {args.profile}")
    args.hf = [h for h in args.hf.split(",") if h != "none"]
    if any(h not in ("compiled", "eager") for h in args.hf):
        parser.error(f"--hf takes a comma-separated subset of compiled, eager (or none), got {','.join(args.hf)!r}")
    if not 0 < args.hf_timeout < math.inf:
        parser.error(f"--hf-timeout takes a positive, finite number of seconds, got {args.hf_timeout:g}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m dspark.bench.hybrid: needs a CUDA device (--device cpu --shape tiny runs on the CPU)",
              file=sys.stderr)
        return 2
    import transformers

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    recipe = TargetRecipe(args.shape, args.device, dtype, seed=0, threads=torch.get_num_threads())
    model = recipe.build()
    drafter = random_drafter(model, SHAPES[args.shape])
    ceiling = measure_copy_ceiling_gbps() if cuda else None
    params, floor_ms = weight_floor(model, ceiling) if cuda else (weight_floor(model, 1.0)[0], None)
    command = "python -m dspark.bench.hybrid " + " ".join(argv if argv is not None else sys.argv[1:])
    report = dict(shape=args.shape, device=torch.cuda.get_device_name() if cuda else "cpu",
                  dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
                  transformers=transformers.__version__,
                  copy_ceiling_gbps=None if ceiling is None else round(ceiling, 1), parameter_bytes=params,
                  floor_ms=floor_ms, prompt=args.prompt, new=args.new, hf_timeout_s=args.hf_timeout,
                  gated_delta_checkpoints=args.gated_delta_checkpoints,
                  command=command,
                  drafts_per_round=drafter.config.num_draft_tokens, rows=[])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    def save() -> None:
        (out / "hybrid.json").write_text(json.dumps(report, indent=1))

    report["rows"] = [dict(batch=batch) for batch in args.batches]
    for row in report["rows"]:
        dspark_runs(model, drafter, row, args, generator, save)
        print(args.shape, json.dumps(row), flush=True)
    # the baselines' children build their own copies (the same weights): this one's memory is theirs
    del model, drafter
    release(torch.device(args.device))
    if args.hf:
        for row in report["rows"]:
            hf_baselines(recipe, row, args, save)
            print(args.shape, json.dumps(row), flush=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
