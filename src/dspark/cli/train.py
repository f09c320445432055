"""Train a DSpark drafter for a Hugging Face target on a text or JSON Lines corpus.

The target (frozen) provides the hidden states the draft reads and the distributions it learns;
the draft backbone, Markov head and confidence head train with 0.1 CE + 0.9 TV + 1.0 BCE(confidence,
1 - TV), position weights exp(-k/gamma); embedding and lm_head are frozen copies of the target's.
Checkpoints are written in the speculators format (loaded by ``dspark generate`` / ``dspark eval``)
every --save-every steps and at the end, with the state that --resume continues from. GPU for
real runs; the CPU works for tiny smoke runs. Data parallel on N GPUs (or nodes) through torchrun:
``torchrun --nproc-per-node N -m dspark train ...`` (--batch-size is the global batch; --fsdp
shards the draft with FSDP2). Without --target the demo pair's target is trained for; --target may
be a Hugging Face Hub name (from the cache, else downloaded unless HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ._runtime import DTYPES, add_runtime_arguments, load_target, resolve_pair, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM (with its tokenizer): a directory or a Hub name "
                                         "(default: the demo pair's target)")
    parser.add_argument("--data", default="stdlib:train",
                        help="corpus: stdlib:train|valid|test, a text file, a directory, or a .jsonl file")
    parser.add_argument("--output", required=True, help="draft checkpoint directory to write")
    parser.add_argument("--overwrite", action="store_true", help="write into --output even if it is not empty")
    model = parser.add_argument_group("draft model")
    model.add_argument("--block-size", type=int, default=7, help="tokens per draft block (the anchor + block-1 drafts)")
    model.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    model.add_argument("--markov-rank", type=int, default=64, help="0 = DFlash ablation (no Markov head)")
    model.add_argument("--head-type", choices=("vanilla", "gated", "rnn"), default="vanilla", help="Markov head type")
    model.add_argument("--no-confidence", action="store_true", help="train no confidence head")
    model.add_argument("--confidence-target", choices=("tv", "greedy"), default="tv",
                       help="what the confidence head learns: 1 - TV at temperature 1 (the paper) or the greedy "
                            "acceptance 1[draft argmax = target argmax] (for greedy decoding)")
    model.add_argument("--confidence-backprop", action="store_true",
                       help="let the confidence loss train the backbone and W1 too (the paper; default: head only)")
    model.add_argument("--attention", choices=("auto", "flex", "dense"), default="auto",
                       help="the draft's training attention: block-sparse FlexAttention or a dense mask with SDPA "
                            "(default: auto, FlexAttention on a GPU and the dense mask on the CPU)")
    model.add_argument("--capture-layers", default=None,
                       help="target hidden_states indices, comma-separated (default: speculators' [2, L//2, L-3])")
    model.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token, ...")
    model.add_argument("--layer-type", choices=("full_attention", "sliding_attention"), default="full_attention", help="attention of the draft layers")
    model.add_argument("--sliding-window", type=int, default=2048, help="context window of sliding layers")
    model.add_argument("--no-sample-from-anchor", action="store_true", help="DFlash convention: slot 0 drafts nothing")
    train = parser.add_argument_group("training")
    train.add_argument("--seq-len", type=int, default=512, help="tokens per training row")
    train.add_argument("--max-docs", type=int, default=0, help="use only the first N documents (0 = all)")
    train.add_argument("--corpus-rows", type=int, default=0,
                       help="keep a random subset of N corpus rows (0 = all), e.g. to weight --regenerate rows")
    train.add_argument("--regenerate", type=int, default=0,
                       help="add N rows in the target's own words: a corpus row's first quarter + the target's "
                            "greedy continuation (the paper trains on target-regenerated text)")
    train.add_argument("--regenerate-batch", type=int, default=256, help="rows generated at once")
    train.add_argument("--steps", type=int, default=2000,
                       help="optimizer steps in all (with --resume: more than the run has taken extends it)")
    train.add_argument("--batch-size", type=int, default=16, help="rows per step")
    train.add_argument("--anchors", type=int, default=64, help="blocks per row")
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    train.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the run")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    train.add_argument("--gamma", type=float, default=4.0, help="position weight decay exp(-k/gamma)")
    train.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    train.add_argument("--save-every", type=int, default=500, help="write a checkpoint every N steps (0 = only at the end)")
    train.add_argument("--seed", type=int, default=0, help="seed of the data order, anchors and initialisation")
    train.add_argument("--init-from", default=None, metavar="DRAFT",
                       help="start from this draft checkpoint's weights (same architecture; a new optimizer and "
                            "schedule): a longer training in several runs, or fine-tuning a published draft")
    train.add_argument("--resume", action="store_true",
                       help="continue the run saved in --output (weights, optimizer, data position): the same "
                            "options, except --steps / --time-budget, which may extend it")
    parallel = parser.add_argument_group("data parallel (under torchrun)")
    parallel.add_argument("--fsdp", action="store_true",
                          help="shard the draft's parameters, gradients and optimizer state with FSDP2 (default: DDP)")
    parallel.add_argument("--dist-timeout", type=float, default=600.0,
                          help="seconds a rank waits for the others in a collective before the job fails")
    add_runtime_arguments(parser)
    parser.add_argument("--save-dtype", choices=DTYPES[1:], default="bfloat16", help="dtype of the saved weights")


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.training.data import pack_sequences, read_corpus, tokenize
    from dspark.training.distributed import SINGLE, close_world, describe_failure, init_world
    from dspark.training.trainer import TrainOptions, draft_config, regenerate, resolve_mask_token_id, train_draft

    world = SINGLE
    try:
        _check_output(args)
        if args.init_from is not None and not (Path(args.init_from) / "config.json").is_file():
            # said before the corpus is read and regenerated (minutes), not after
            raise ValueError(f"--init-from {args.init_from}: expected a draft checkpoint directory (with a "
                             f"config.json), got {'a file' if Path(args.init_from).is_file() else 'no such directory'}")
        resolve_pair(args, drafts="none")
        device, dtype = runtime(args)
        world, device = init_world(device, args.dist_timeout)
        if args.fsdp and not world.distributed:
            raise ValueError("--fsdp shards the draft over the processes of a torchrun launch: "
                             "torchrun --nproc-per-node N -m dspark train ... --fsdp")
        if args.batch_size % world.world_size:
            raise ValueError(f"--batch-size (the global batch) must be a multiple of the {world.world_size} "
                             f"processes, got {args.batch_size}")
        target, tokenizer = load_target(args, device, dtype)
        texts = read_corpus(args.data)
        texts = texts[: args.max_docs] if args.max_docs else texts
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {args.target_name} has no EOS token to separate documents")
        sequences = pack_sequences(tokenize(tokenizer, texts), args.seq_len, tokenizer.eos_token_id)
        if 0 < args.corpus_rows < sequences.shape[0]:
            keep = torch.randperm(sequences.shape[0], generator=torch.Generator().manual_seed(args.seed))
            sequences = sequences[keep[: args.corpus_rows]]
        if args.regenerate:
            generated = regenerate(target, sequences, args.regenerate, prompt_tokens=args.seq_len // 4,
                                   batch_size=args.regenerate_batch, seed=args.seed, world=world)
            sequences = torch.cat([sequences, generated.cpu()])
        capture = [int(i) for i in args.capture_layers.split(",")] if args.capture_layers else None
        config = draft_config(
            target.config, mask_token_id=resolve_mask_token_id(tokenizer, target.config.vocab_size, args.mask_token_id),
            block_size=args.block_size, num_layers=args.layers, markov_rank=args.markov_rank,
            markov_head_type=args.head_type, confidence=not args.no_confidence, capture_layer_ids=capture,
            layer_type=args.layer_type, sliding_window=args.sliding_window,
            sample_from_anchor=not args.no_sample_from_anchor,
            verifier={"name_or_path": args.target_name, "architectures": list(target.config.architectures or [])})
        options = TrainOptions(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                               weight_decay=args.weight_decay, time_budget=args.time_budget,
                               save_every=args.save_every, seed=args.seed)
        if world.is_main:
            parallel = (f"; {world.world_size} processes ({'FSDP2' if args.fsdp else 'DDP'}), "
                        f"{args.batch_size // world.world_size} rows each per step" if world.distributed else "")
            print(f"corpus {args.data}: {len(texts)} documents; with {args.regenerate} regenerated rows "
                  f"{sequences.numel()} tokens in {sequences.shape[0]} rows of {args.seq_len}; "
                  f"draft: {config.num_hidden_layers} layer(s), block {config.block_size}, "
                  f"Markov rank {args.markov_rank} ({config.markov_head_type}), capture {config.capture_layer_ids}, "
                  f"mask token {config.mask_token_id}{parallel}"
                  + (f"; starting from the weights of {args.init_from}" if args.init_from else ""), flush=True)
        model, losses = train_draft(target, sequences, config, options, device=device,
                                    num_anchors=args.anchors, gamma=args.gamma,
                                    confidence_backprop=args.confidence_backprop,
                                    greedy_confidence=args.confidence_target == "greedy", output=args.output,
                                    save_dtype=getattr(torch, args.save_dtype), world=world, fsdp=args.fsdp,
                                    resume=args.resume, attention=args.attention, init_from=args.init_from,
                                    stream=open(os.devnull, "w") if args.quiet and world.is_main else None)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:  # RuntimeError: a diverged loss, out of memory,
        print(f"dspark train: {describe_failure(exc, world)}", file=sys.stderr)  # a failed collective
        return 2
    close_world(world)
    if not world.is_main:
        return 0
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"saved the draft to {args.output}: {trained / 1e6:.2f} M trained parameters, "
          f"loss of the last step {losses[-1]:.4f}")
    return 0


def _check_output(args: argparse.Namespace) -> None:
    """Refuse to write a checkpoint into a file or a non-empty directory unless ``--overwrite`` (or
    ``--resume``, which continues the run saved there)."""
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {args.output} is a file, not a directory")
    if output.is_dir() and any(output.iterdir()) and not (args.overwrite or args.resume):
        raise ValueError(f"--output {args.output} exists and is not empty: pass --overwrite to write the draft into it")
