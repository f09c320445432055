"""End-to-end speed of the engine on a Qwen3-0.6B-shaped target: ``python -m dspark.bench.e2e``.

Builds a random-weight target (28 layers, H = 1024, V = 151 936, Qwen3-0.6B's shape) and random DSpark
drafts (speculators format, block 7, ``--draft-layers``) in a temporary directory, loads them back
and times greedy generation of one request on ``LLMEngine`` against plain target decoding on its
runner (``dspark generate --compare``'s timing: wall clock; one warm-up run, then the median of
``--reps`` runs).

Random weights make the random draft's proposals almost always wrong, so two drafters are timed:
``random`` (the real draft; tau near 1, the engine's overhead) and ``oracle_tokens`` (the real draft
runs -- same cost -- but its tokens are replaced by the target's own greedy continuation,
``bench.oracle.OracleEngine`` at acceptance 1: the speed at tau = P + 1). Prints one JSON object
(and writes it with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engine import EngineConfig, GenerationResult, LLMEngine, Request
from .oracle import OracleEngine

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                  max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=True)
QUICK = dict(QWEN3_0_6B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def build_target(directory: Path, shape: dict, seed: int = 0) -> None:
    """Save a random-weight Qwen3 causal LM of ``shape`` to ``directory``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(directory)


def build_draft(directory: Path, target_dir: Path, shape: dict, num_layers: int, seed: int = 0) -> None:
    """Save a random speculators-format DSpark draft for the target (its embedding and lm_head copied,
    aux layers ``[2, L/2, L-3]``, block 7, Markov rank 256, confidence head, sliding-window layers)."""
    from safetensors.torch import load_file

    from ..model import DSparkConfig, DSparkDraftModel, save_draft

    layers = shape["num_hidden_layers"]
    config = DSparkConfig(
        hidden_size=shape["hidden_size"], num_hidden_layers=num_layers, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
        capture_layer_ids=[2, layers // 2, layers - 3], num_target_layers=layers,
        mask_token_id=shape["vocab_size"] - 1, block_size=7, markov_rank=256, rms_norm_eps=shape["rms_norm_eps"],
        rope_theta=shape["rope_parameters"]["rope_theta"], layer_types=["sliding_attention"] * num_layers,
        sliding_window=2048, dtype="bfloat16")
    torch.manual_seed(seed)
    draft = DSparkDraftModel(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.02)
        embedding = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
        draft.embed_tokens.weight.copy_(embedding)
        draft.lm_head.weight.copy_(embedding)  # tied target embeddings
    save_draft(draft, directory, format="speculators")


def _oracle_run(engine: OracleEngine, request: Request, continuation: list[int]) -> GenerationResult:
    """``request`` on ``engine`` with its drafts replaced by the known ``continuation``."""
    start = time.perf_counter()
    rid = engine.add_request(request, continuation + [0] * (engine.num_drafts + 1))
    seq = engine.sequences[rid]
    while engine.has_unfinished():
        engine.step()
    engine.sequences.pop(rid)
    seq.stats.total_time = time.perf_counter() - start
    return GenerationResult(seq.output_ids, seq.stats, seq.finish_reason)


def _row(name: str, layers: int, dtype: str, result: GenerationResult, baseline: GenerationResult) -> dict:
    stats = result.stats.as_dict()
    base = baseline.stats.as_dict()
    return {
        "drafter": name, "draft_layers": layers, "dtype": dtype,
        "tau": stats["mean_accepted_length"], "acceptance_per_position": stats["acceptance_per_position"],
        "rounds": stats["rounds"], "generated_tokens": stats["generated_tokens"],
        "tokens_per_second": stats["tokens_per_second"], "baseline_tokens_per_second": base["tokens_per_second"],
        "speedup": round(baseline.stats.total_time / result.stats.total_time, 3),
        "identical_to_baseline": result.token_ids == baseline.token_ids,
        "draft_time_s": stats["draft_time_s"], "verify_time_s": stats["verify_time_s"],
        "prefill_time_s": stats["prefill_time_s"], "total_time_s": stats["total_time_s"],
    }


def _median(generate, reps: int) -> GenerationResult:
    """The run of median total time among ``reps`` runs."""
    results = sorted((generate() for _ in range(reps)), key=lambda r: r.stats.total_time)
    return results[len(results) // 2]


def run(*, quick: bool = False, draft_layers=(1, 3), dtypes=("bfloat16", "float32"), max_new_tokens: int = 128,
        prompt_len: int = 64, reps: int = 3, device: str = "cuda") -> dict:
    from transformers import AutoModelForCausalLM

    from ..model import load_draft

    shape = QUICK if quick else QWEN3_0_6B
    prompt = torch.randint(0, shape["vocab_size"] - 1, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    request = Request(prompt, max_new_tokens, ignore_eos=True)
    config = EngineConfig(max_batch=1, gpu_memory_utilization=None)  # engines side by side
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_target(root / "target", shape)
        for layers in draft_layers:
            build_draft(root / f"draft{layers}", root / "target", shape, layers)
        for dtype in dtypes:
            target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=getattr(torch, dtype)).to(device)
            for layers in draft_layers:
                draft = load_draft(root / f"draft{layers}", device=device, dtype=getattr(torch, dtype))
                engine = LLMEngine(target, draft, config)
                oracle = OracleEngine(target, draft, config, acceptance=1.0)
                plain = lambda: engine.plain().generate_requests([request])[0]  # noqa: E731
                speculative = lambda: engine.generate_requests([request])[0]  # noqa: E731
                baseline = plain()  # warm-up: CUDA context, cuBLAS heuristics, Triton compilation, graphs
                speculative(), _oracle_run(oracle, request, baseline.token_ids)
                baseline = _median(plain, reps)
                rows.append(_row("random", layers, dtype, _median(speculative, reps), baseline))
                rows.append(_row("oracle_tokens", layers, dtype,
                                 _median(lambda: _oracle_run(oracle, request, baseline.token_ids), reps), baseline))
                print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", file=sys.stderr, flush=True)
            del target
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "target": {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
        "draft": {"format": "speculators", "block_size": 7, "markov_rank": 256},
        "prompt_tokens": prompt_len, "max_new_tokens": max_new_tokens, "mode": "greedy",
        "timing": f"median of {reps} runs after a warm-up run",
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.quick:
        print("dspark.bench.e2e: the 0.6B-shaped benchmark needs a CUDA device (or pass --quick)", file=sys.stderr)
        return 2
    report = run(quick=args.quick, draft_layers=args.draft_layers, dtypes=args.dtype,
                 max_new_tokens=args.max_new_tokens, reps=args.reps, device=args.device)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
