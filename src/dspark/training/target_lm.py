"""Training a small Qwen3-architecture target from scratch (the demo pair's target).

``python -m dspark.training.target_lm --corpus stdlib:train --output DIR`` trains a byte-level BPE
tokenizer on the corpus (``data.train_tokenizer``), saves it to DIR at once, then trains
transformers' ``Qwen3ForCausalLM`` (shape from a preset) on packed rows of the corpus with the
next-token cross-entropy, and saves it to DIR (safetensors, bf16 by default) with its generation
config (EOS = ``<|endoftext|>``). DIR is then an ordinary Hugging Face model directory:
``AutoModelForCausalLM`` / ``AutoTokenizer`` load it, ``dspark train`` trains a drafter for it.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..kernels._validate import Checker
from .data import pack_sequences, read_corpus, save_tokenizer, tokenize, train_tokenizer
from .trainer import TrainOptions, adamw, optimize

__all__ = ["TargetShape", "PRESETS", "tokenizer_sample", "target_config", "new_target", "lm_loss", "train_target", "save_target", "main"]


@dataclass(frozen=True)
class TargetShape:
    """Qwen3 sizes: vocabulary (also the BPE tokenizer's size), hidden size, decoder layers,
    attention heads / KV heads of ``head_dim``, SwiGLU width."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


# "demo": 11.4 M parameters (22.8 MB in bf16), ten layers of width 320: wide enough that on a CPU a
# forward of 8 tokens costs little more than one (weight reads, not op overheads, dominate), small
# enough for a laptop; "demo-v1": the first shipped pair's 6.7 M (deep and narrow); "tiny": a CPU smoke test.
PRESETS = {
    "demo": TargetShape(vocab_size=2048, hidden_size=320, num_layers=10, num_heads=5, num_kv_heads=1, head_dim=64,
                        intermediate_size=864),
    "demo-v1": TargetShape(vocab_size=2048, hidden_size=192, num_layers=16, num_heads=3, num_kv_heads=1, head_dim=64,
                           intermediate_size=512),
    "tiny": TargetShape(vocab_size=320, hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                        intermediate_size=128),
}


def target_config(shape: TargetShape, tokenizer, max_position_embeddings: int):
    """A ``Qwen3Config`` of ``shape`` for ``tokenizer`` (tied embeddings, full attention, RoPE θ 10⁴,
    EOS = pad = the tokenizer's EOS, no BOS)."""
    from transformers import Qwen3Config

    c = Checker("target_config")
    if len(tokenizer) > shape.vocab_size:
        c.fail(f"the tokenizer has {len(tokenizer)} tokens, more than vocab_size={shape.vocab_size}")
    eos = tokenizer.eos_token_id
    return Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
    )


def new_target(config, seed: int = 0):
    """A randomly initialised fp32 ``Qwen3ForCausalLM`` (transformers' own initialisation)."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on token rows ``batch`` ``[B, S]``."""
    return model(input_ids=batch, labels=batch).loss


def train_target(model, sequences: torch.Tensor, options: TrainOptions, *, device, save=None,
                 stream=None) -> list[float]:
    """Train ``model`` (moved to ``device``) on token rows ``sequences`` int64 ``[N, S]``; returns
    the logged losses. ``save(step)`` as in ``optimize``."""
    model.to(device).train()

    def step(batch: torch.Tensor):
        return lm_loss(model, batch), {}

    losses = optimize(adamw(model.parameters(), options), step, sequences, options, device=device, name="target train",
                      describe=lambda stats: f"ppl {float(stats['loss'].exp()):.2f} |", save=save, stream=stream)
    model.eval()
    return losses


def save_target(model, tokenizer, path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` (weights in ``dtype``; the model itself is untouched) and ``tokenizer`` to
    ``path`` as a Hugging Face directory."""
    from ..model.safetensors_io import normal_mode

    path = Path(path)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(path)
    for weights in path.glob("*.safetensors"):  # save_pretrained leaves them 0600 (safetensors' save_file)
        normal_mode(weights)
    save_tokenizer(tokenizer, path)
    return path


def tokenizer_sample(texts: list[str], max_chars: int) -> list[str]:
    """Every k-th document, k = ceil(total characters / ``max_chars``): a sample of about ``max_chars`` (BPE
    training time grows with the text; its merges settle long before a corpus of 10^8 characters)."""
    total = sum(len(t) for t in texts)
    step = max(1, -(-total // max_chars))
    return texts[::step]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.training.target_lm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="stdlib:train", help="corpus spec (see dspark.training.data)")
    parser.add_argument("--output", required=True, help="model directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--max-docs", type=int, default=0, help="use only the first N documents (0 = all)")
    parser.add_argument("--tokenizer-chars", type=int, default=32_000_000,
                        help="train the tokenizer on evenly spaced documents of about this many characters")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokenizer_chars < 1:
        parser.error(f"--tokenizer-chars must be >= 1, got {args.tokenizer_chars}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = PRESETS[args.preset]
    started = time.perf_counter()
    texts = read_corpus(args.corpus)
    if args.max_docs:
        texts = texts[: args.max_docs]
    tokenizer = train_tokenizer(tokenizer_sample(texts, args.tokenizer_chars), shape.vocab_size)
    save_tokenizer(tokenizer, args.output)
    sequences = pack_sequences(tokenize(tokenizer, texts), args.seq_len, tokenizer.eos_token_id)
    print(f"tokenizer: {len(tokenizer)} tokens, corpus {args.corpus}: {len(texts)} documents, "
          f"{sequences.numel()} tokens in {sequences.shape[0]} rows of {args.seq_len} "
          f"({time.perf_counter() - started:.0f}s)", flush=True)

    model = new_target(target_config(shape, tokenizer, max_position_embeddings=4 * args.seq_len), args.seed)
    print(f"target: Qwen3 {asdict(shape)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters",
          flush=True)
    options = TrainOptions(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                           time_budget=args.time_budget, save_every=args.save_every, seed=args.seed)
    save_dtype = getattr(torch, args.save_dtype)
    train_target(model, sequences, options, device=device,
                 save=lambda _step: save_target(model, tokenizer, args.output, save_dtype))
    print(f"saved the target to {args.output} ({time.perf_counter() - started:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
