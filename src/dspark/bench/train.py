"""The drafter's trainer at target scale: tokens/s, peak memory and the share of the GPU's bf16 peak.

    python -m dspark.bench.train --out DIR [--shape qwen3-8b] [--seq-lens 2048,4096] [--anchors 256] \
        [--attention flex,dense] [--steps 8]

Per sequence length and training attention (``block_hidden``'s ``flex``: block-sparse FlexAttention,
or ``dense``: SDPA over the ``training_mask`` tensor, the trainer's path before), one row of
``seq_len`` random tokens per step through exactly the trainer's step (``trainer.target_batch``, then
``DraftStep`` forward and backward under bf16 autocast, AdamW): a random-weight target of ``--shape``
(``bench.engine.SHAPES`` or a shape as JSON; frozen, no gradients) and a fresh 1-layer drafter
(``trainer.draft_config`` / ``new_draft``: fp32 master weights). The first two steps (compilation)
are not timed; the rest are, with the device synchronised around each. A configuration that runs
out of memory is reported as such.

FLOPs per step, counted as 2 per multiply-add of the matrix products (norms, softmax and the loss
not counted): the target's forward over ``S`` tokens (its linear layers and causal attention); the
draft's forward over the ``A * N`` block tokens (its layer, the projection of the captured context
over ``S`` positions, attention as the mask allows on average: ``p + N`` keys for an anchor at
``p``, and the target head for ``A * N`` rows, computed once for the draft and once for the target
distributions) and its backward (twice the forward's, except the frozen heads' input-gradient
only). ``bf16 peak``: achieved FLOPs/s over ``--peak-tflops`` (989: the H200's dense bf16 figure).
Writes ``DIR/train.json`` and ``train.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..training import trainer
from ..training.objective import position_weights

__all__ = ["main", "step_flops"]


def step_flops(tc, dc, seq_len: int, anchors: torch.Tensor) -> float:
    """Matrix-product FLOPs of one training step (module docstring); ``tc`` / ``dc`` the target's
    transformers config and the draft's ``DSparkConfig``, ``anchors`` int64 ``[1, A]``."""
    h, v, s = tc.hidden_size, tc.vocab_size, seq_len
    q_heads, kv_heads, d = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim

    def layer(tokens, inter):  # the linear layers of one decoder layer
        return 2 * tokens * (h * d * (q_heads + 2 * kv_heads) + q_heads * d * h + 3 * h * inter)

    target = tc.num_hidden_layers * (layer(s, tc.intermediate_size) + 2 * 2 * q_heads * d * s * (s + 1) / 2)
    n = dc.block_size
    rows = anchors.numel() * n
    keys = float((anchors.double() + n).sum()) * n  # keys seen, summed over the block queries
    draft = dc.num_hidden_layers * (layer(rows, dc.intermediate_size) + 2 * 2 * q_heads * d * keys)
    draft += 2 * s * (len(dc.capture_layer_ids) * h) * h  # fc over the captured context
    # the draft context's K/V over S positions (per layer)
    draft += dc.num_hidden_layers * 2 * s * h * 2 * kv_heads * d
    head = 2 * rows * h * v
    return target + head + 3 * draft + 2 * head  # target head (no grad) + draft head fwd + bwd (input only)


def run_one(target, seq_len: int, num_anchors: int, attention: str, steps: int, device: torch.device) -> dict:
    cfg = trainer.draft_config(target.config, mask_token_id=target.config.vocab_size - 1, num_layers=1)
    draft = trainer.new_draft(target, cfg).to(device)
    weights = position_weights(cfg.block_size, sample_from_anchor=cfg.sample_from_anchor, device=device)
    step = trainer.DraftStep(draft, weights, attention=attention)
    optimizer = trainer.adamw(draft.parameters(), trainer.TrainOptions())
    generator = torch.Generator().manual_seed(0)
    anchors = trainer.sample_anchors(1, seq_len, num_anchors, cfg.block_size, generator).to(device)
    times = []
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(steps + 2):
            ids = torch.randint(0, target.config.vocab_size, (1, seq_len), generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = step(*trainer.target_batch(target, cfg, ids, anchors)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError as exc:
        return dict(seq_len=seq_len, anchors=int(anchors.numel()), attention=attention, error=f"out of memory: {exc}"[:200])
    seconds = sorted(times)[len(times) // 2]
    flops = step_flops(target.config, cfg, seq_len, anchors)
    row = dict(seq_len=seq_len, anchors=int(anchors.numel()), block_tokens=int(anchors.numel()) * cfg.block_size,
               attention=attention, step_s=round(seconds, 4), tokens_per_s=round(seq_len / seconds, 1),
               tflops_per_step=round(flops / 1e12, 3), achieved_tflops=round(flops / seconds / 1e12, 2))
    if device.type == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of bench.engine.SHAPES, or one as JSON")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seq-lens", default="2048,4096")
    parser.add_argument("--anchors", type=int, default=256, help="anchors per row (block size 7: 7 tokens each)")
    parser.add_argument("--attention", default="flex,dense", help="comma-separated: flex, dense")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration (after 2 untimed)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak")
    args = parser.parse_args(argv)
    from .engine import SHAPES, random_target

    try:
        seq_lens = [int(x) for x in args.seq_lens.split(",")]
    except ValueError:
        parser.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    for name, value in (("--seq-lens", min(seq_lens)), ("--anchors", args.anchors), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if set(args.attention.split(",")) - {"flex", "dense"}:
        parser.error(f"--attention must name flex and/or dense, got {args.attention!r}")
    if args.shape not in SHAPES and not args.shape.lstrip().startswith("{"):
        parser.error(f"--shape must be one of {list(SHAPES)} or a shape as JSON, got {args.shape!r}")
    device = torch.device(args.device)
    attentions = args.attention.split(",")
    if device.type != "cuda" and "flex" in attentions:
        parser.error("--attention flex needs a GPU (FlexAttention has no backward on the CPU); use --attention dense")
    shape = SHAPES[args.shape] if args.shape in SHAPES else json.loads(args.shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = random_target(shape, vocab=args.vocab, device=device, dtype=dtype)
    rows = []
    for seq_len in seq_lens:
        for attention in attentions:
            row = run_one(target, seq_len, args.anchors, attention, args.steps, device)
            if "achieved_tflops" in row:
                row["bf16_peak_fraction"] = round(row["achieved_tflops"] / args.peak_tflops, 4)
            rows.append(row)
            print(row, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    command = "python -m dspark.bench.train " + " ".join(argv if argv is not None else sys.argv[1:])
    report = dict(command=command, shape=args.shape, device=str(device), torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(report, indent=1))
    lines = ["| S | anchors | attention | step s | tokens/s | TFLOP/step | TFLOP/s | bf16 peak | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['anchors']} | {r['attention']} | {r.get('step_s', r.get('error', '-'))} | "
                     f"{r.get('tokens_per_s', '-')} | {r.get('tflops_per_step', '-')} | {r.get('achieved_tflops', '-')} | "
                     f"{r.get('bf16_peak_fraction', '-')} | {r.get('peak_memory_gib', '-')} |")
    (out / "train.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
