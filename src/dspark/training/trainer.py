"""Training a DSpark drafter for a Hugging Face target (runtime.md Part IV §5, §2.5).

One step on a batch of token rows ``[B, S]``:

1. the frozen target runs once (``output_hidden_states``): the captured layers give the draft's
   context ``[B, S, m*H]``, the final (post-norm) hidden state through the target's ``lm_head``
   gives the target distributions;
2. ``num_anchors`` anchor positions p per row are sampled; each block ``[x_p, mask, ...]`` sits at
   positions ``p .. p+N-1`` (``block_hidden``): one batched pass of the draft's inference forward
   (``model.draft_runner``) whose attention sees what the engine's does (the training mask of §2.5)
   -- block-sparse on a GPU (FlexAttention's ``BlockMask``), a dense mask with SDPA on the CPU;
3. slot logits = ``lm_head`` + Markov bias with teacher-forced previous tokens (the token at the
   row whose target logits the slot is trained on; without ``sample_from_anchor`` slot 0, which
   drafts nothing, gets the anchor, so an rnn head's state steps through it as speculators'
   does), confidence logits from ``[h ; W1[prev]]``;
4. ``dspark_loss`` (0.1 CE + 0.9 TV + 1.0 BCE, weights exp(-k/γ)); AdamW, linear warm-up then
   cosine decay; the embedding and ``lm_head`` are frozen copies of the target's.

Deliberate difference: by default the BCE trains the confidence head only (its inputs ``h`` and
``W1[prev]`` are detached, as speculators #848 briefly did). With the gradient flowing into the
backbone and W1 (the paper, DeepSpec, speculators today) short runs lose drafting accuracy: a
1-layer draft of a 6-layer stdlib target, 180 s of CPU training each, reached greedy τ 1.59 on 8
held-out files with the gradient, 2.28 with detached inputs, 2.46 without a confidence head (DFlash
ablation: 1.88). ``confidence_backprop=True`` (``dspark train --confidence-backprop``) restores the
paper's path.

``markov_rank=0`` trains the DFlash ablation: no Markov head (``markov_rank`` 0 in the checkpoint,
as speculators and DeepSpec write it) and no confidence head, like DeepSpec's DFlash baselines.

Data parallel (``distributed``): under torchrun every rank runs the frozen target on its shard of
each global batch; the draft's side of a step is ``DraftStep.forward``, which DDP or FSDP2 wraps.
Checkpoints and the resumable state (``state``) are gathered to rank 0 and written by it alone.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels as K
from ..kernels._validate import Checker
from ..model import DSparkConfig, DSparkDraftModel, load_draft, save_draft
from ..model.config import target_field
from ..model.draft_runner import layer_weights, run_block, write_context
from ..model.layers import rope_inv_freq
from .distributed import SINGLE, World, wrap
from .objective import DSparkLoss, dspark_loss, expected_accepted_length, position_weights
from .state import LoopState, gather_state, load_optimizer_state, read_training_state, write_training_state

__all__ = [
    "TrainOptions", "optimize", "Progress", "default_capture_layer_ids", "resolve_mask_token_id",
    "draft_config", "new_draft", "target_states", "greedy_continuation", "regenerate", "target_head_logits",
    "sample_anchors", "training_mask", "training_block_mask", "block_hidden", "markov_logits", "target_batch", "draft_objective", "draft_loss",
    "DraftStep", "adamw", "train_draft", "save_checkpoint",
]


# ---- generic optimisation loop (shared with target_lm) -------------------------------------------


@dataclass
class TrainOptions:
    """Optimisation settings. Training stops after ``steps`` steps or ``time_budget`` seconds,
    whichever comes first; the learning-rate schedule (linear warm-up over the first ``warmup``
    fraction, then cosine decay to 0) runs on that same progress fraction, so a time-limited run
    still ends with a fully decayed rate. ``save_every`` steps (0 = only at the end) the caller's
    ``save`` runs, so an interrupted run leaves a checkpoint."""

    steps: int = 2000
    batch_size: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    time_budget: float | None = None
    log_every: int = 20
    save_every: int = 0
    seed: int = 0

    def __post_init__(self):
        c = Checker("TrainOptions")
        for name in ("steps", "batch_size", "log_every"):
            c.integer(name, getattr(self, name), low=1)
        c.integer("save_every", self.save_every, low=0)
        c.real("lr", self.lr, low=0.0)
        c.real("warmup", self.warmup, low=0.0, high=1.0)
        c.real("weight_decay", self.weight_decay, low=0.0)
        c.real("grad_clip", self.grad_clip, low=0.0)
        if self.time_budget is not None:
            c.real("time_budget", self.time_budget, low=1e-3)

    def progress(self, step: int, elapsed: float) -> float:
        """Fraction of the run done after ``step`` steps and ``elapsed`` seconds (>= 1: stop)."""
        return max(step / self.steps, elapsed / self.time_budget if self.time_budget else 0.0)

    def lr_factor(self, progress: float) -> float:
        """Learning-rate multiplier at ``progress`` in [0, 1]."""
        if progress < self.warmup:
            return (progress + 1e-9) / self.warmup
        return 0.5 * (1.0 + math.cos(math.pi * (progress - self.warmup) / max(1e-9, 1.0 - self.warmup)))


class Progress:
    """A one-line progress bar: redrawn in place on a terminal, one line per update otherwise.
    ``elapsed``: seconds already trained (a resumed run), counted in the time and the ETA."""

    def __init__(self, name: str, stream=None, elapsed: float = 0.0):
        self.name = name
        self.stream = sys.stderr if stream is None else stream
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter() - elapsed

    def update(self, progress: float, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        eta = f"{elapsed * (1.0 - progress) / progress:.0f}s" if progress > 0 else "?"
        bar = "#" * int(20 * min(progress, 1.0))
        line = f"{self.name} [{bar:<20}] {100 * min(progress, 1.0):3.0f}% {text} | {elapsed:.0f}s eta {eta}"
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def adamw(parameters, options: TrainOptions) -> torch.optim.AdamW:
    """AdamW (betas 0.9 / 0.95) over the trainable ones of ``parameters``."""
    return torch.optim.AdamW([p for p in parameters if p.requires_grad], lr=options.lr, betas=(0.9, 0.95),
                             weight_decay=options.weight_decay)


def optimize(optimizer: torch.optim.Optimizer, loss_fn: Callable, sequences: torch.Tensor, options: TrainOptions, *,
             device, name: str = "train", describe: Callable[[dict], str] | None = None,
             save: Callable[[LoopState], None] | None = None, stream=None, world: World = SINGLE,
             state: LoopState | None = None, log: list[dict] | None = None) -> list[float]:
    """Minimise ``loss_fn(batch)`` with ``optimizer`` over shuffled batches of ``sequences`` (int64 ``[N, S]``).

    ``loss_fn(batch [b, S] on device) -> (loss, stats)``: the scalar loss and a dict of detached
    statistics tensors; at logging steps ``describe(stats)`` (``stats["loss"]`` included, all
    averaged over the ranks) is the progress bar's text. CUDA steps run under bf16 autocast.
    Returns the losses logged (every ``options.log_every`` steps, the first and the last step);
    raises RuntimeError when the loss stops being finite.

    Data parallel (``world``): every step draws a global batch of ``options.batch_size`` rows,
    the same on every rank, and passes this rank's shard to ``loss_fn``; rank 0's clock decides
    the progress (learning rate, stop) for all; rank 0 alone shows progress. ``state``: where to
    start (default: a fresh run seeded with ``options.seed``), advanced in place, so that
    ``save(state)`` -- every ``options.save_every`` steps and at the end -- can record it.
    ``log``: gets ``{"step", "loss", "seconds"}`` (seconds since this call began) at every logging step.
    """
    device = torch.device(device)
    state = LoopState.fresh(options.seed) if state is None else state
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    progress = Progress(name, stream, state.elapsed) if world.is_main else None
    session = time.perf_counter()
    start = session - state.elapsed
    sync_clock = world.distributed and options.time_budget is not None
    losses: list[float] = []

    def report(loss: torch.Tensor, stats: dict) -> None:
        stats = world.mean_all({"loss": loss, **stats})
        losses.append(float(stats["loss"]))  # reading it waits for the GPU: the time below is exact
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{name}: the loss became {losses[-1]} at step {state.step}")
        if log is not None:
            log.append({"step": state.step, "loss": losses[-1], "seconds": time.perf_counter() - session})
        if progress is not None:
            lr = optimizer.param_groups[0]["lr"]
            text = f" {describe(stats)}" if describe is not None else ""
            progress.update(options.progress(state.step, state.elapsed),
                            f"step {state.step} loss {losses[-1]:.4f}{text} lr {lr:.2e}")

    first, logged, saved, last = state.step + 1, -1, -1, None  # a session logs its first and last steps
    while True:
        fraction = options.progress(state.step, time.perf_counter() - start)
        if sync_clock:
            fraction = float(world.broadcast(torch.tensor([fraction], dtype=torch.float64, device=device)))
        if fraction >= 1.0:
            break
        if state.order.numel() < options.batch_size:  # a new epoch
            state.order = torch.randperm(sequences.shape[0], generator=state.generators["data"])
        rows, state.order = state.order[:options.batch_size], state.order[options.batch_size:]
        batch = world.shard(sequences[rows])
        for group in optimizer.param_groups:  # the rate of the step being taken, hence one step ahead
            group["lr"] = options.lr * options.lr_factor(min(1.0, fraction + 1.0 / options.steps))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, stats = loss_fn(batch.to(device, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(parameters, options.grad_clip)
        optimizer.step()
        state.step += 1
        state.elapsed = time.perf_counter() - start
        last = (loss.detach(), stats)
        if state.step % options.log_every == 0 or state.step == first:
            report(*last)
            logged = state.step
        if save is not None and options.save_every and state.step % options.save_every == 0:
            save(state)
            saved = state.step
    if last is not None and logged != state.step:
        report(*last)
    if progress is not None:
        progress.close()
    if save is not None and saved != state.step:
        save(state)
    return losses


# ---- draft configuration and initialisation -------------------------------------------------------


def default_capture_layer_ids(num_target_layers: int) -> list[int]:
    """speculators' default capture ids ``[2, L//2, L-3]`` (HF ``hidden_states`` indices); for
    targets too shallow for three distinct ids there, ``[1, L//2, L-1]`` without repeats."""
    c = Checker("default_capture_layer_ids")
    layers = c.integer("num_target_layers", num_target_layers, low=2)
    ids = [2, layers // 2, layers - 3]
    if len(set(ids)) == 3 and ids[0] < ids[1] < ids[2]:
        return ids
    return sorted({1, layers // 2, layers - 1})


def resolve_mask_token_id(tokenizer, vocab_size: int, explicit: int | None = None) -> int:
    """The block's mask token, in speculators' order: ``explicit`` -> the tokenizer's mask token ->
    the first unused embedding row (``len(tokenizer) < vocab_size``) -> pad / eos / unk."""
    c = Checker("resolve_mask_token_id")
    if explicit is not None:
        return c.integer("mask_token_id", explicit, low=0, high=vocab_size - 1)
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
            if getattr(tokenizer, name, None) is not None:
                return int(getattr(tokenizer, name))
    c.fail("no mask token: pass mask_token_id (the tokenizer has no mask/pad/eos/unk token and no unused row)")


def draft_config(target_config, *, mask_token_id: int, block_size: int = 7, num_layers: int = 1,
                 markov_rank: int = 64, markov_head_type: str = "vanilla", confidence: bool = True,
                 capture_layer_ids: list[int] | None = None, layer_type: str = "full_attention",
                 sliding_window: int | None = None, sample_from_anchor: bool = True,
                 verifier: dict | None = None) -> DSparkConfig:
    """A ``DSparkConfig`` whose layers copy the target's (a transformers config of any family):
    hidden size, heads, head_dim, MLP width, norm eps, RoPE θ -- each under the names families give
    it (``model.config.TARGET_FIELD_NAMES``; ValueError naming a field the config lacks);
    ``num_layers`` draft layers of ``layer_type``. ``markov_rank=0`` is the DFlash ablation (see the
    module docstring)."""
    c = Checker("draft_config")
    c.integer("markov_rank", markov_rank, low=0)
    target_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers = target_config.num_hidden_layers
    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {}
    return DSparkConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=target_field(c, target_config, "num_key_value_heads", heads),
        head_dim=target_field(c, target_config, "head_dim", target_config.hidden_size // heads),
        intermediate_size=target_field(c, target_config, "intermediate_size"),
        vocab_size=target_config.vocab_size,
        capture_layer_ids=list(capture_layer_ids or default_capture_layer_ids(layers)),
        num_target_layers=layers,
        mask_token_id=mask_token_id,
        block_size=block_size,
        sample_from_anchor=sample_from_anchor,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type if markov_rank else "vanilla",  # rank 0: no head, as the peers write it
        enable_confidence_head=confidence and markov_rank > 0,
        confidence_head_with_markov=True,
        layer_types=[layer_type] * num_layers,
        sliding_window=sliding_window if layer_type == "sliding_attention" else None,
        rms_norm_eps=float(target_field(c, target_config, "rms_norm_eps")),
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        dtype="float32",
        verifier=dict(verifier or {}),
    )


# config keys that do not shape a draft's weights or what they compute (where it came from, its
# saved dtype, its calibration): a warm start may differ in them
_PROVENANCE_KEYS = ("dtype", "sts_temperatures", "speculators_config", "speculators_version", "auto_map")


def warm_start(model: DSparkDraftModel, path, target) -> None:
    """Load the weights of the draft checkpoint at ``path`` into ``model`` (a fresh ``new_draft``)
    to train on from them: the same architecture (every config key but ``_PROVENANCE_KEYS``) and
    frozen embedding / head rows, else ValueError naming ``--init-from`` and what differs."""
    c = Checker("train_draft")
    try:
        start = load_draft(path, target=target, dtype=torch.float32)
    except (ValueError, OSError) as exc:
        c.fail(f"--init-from {path}: {exc}")
    ours, theirs = (m.config.to_speculators_dict() for m in (model, start))
    differ = sorted(k for k in set(ours) | set(theirs) if k not in _PROVENANCE_KEYS and ours.get(k) != theirs.get(k))
    if differ:
        what = ", ".join(f"{k} {theirs.get(k)!r} (this run: {ours.get(k)!r})" for k in differ)
        c.fail(f"--init-from {path} is a draft of another shape: {what}")
    state, frozen = start.state_dict(), ("embed_tokens.weight", "lm_head.weight")
    for name in frozen:  # the target's own rows stay (the checkpoint's may be rounded to its dtype)
        own = model.state_dict()[name]
        if not torch.allclose(state.pop(name), own, rtol=1e-2, atol=1e-2 * float(own.abs().max())):
            c.fail(f"--init-from {path}: its {name} is not this target's (a draft of another target)")
    model.load_state_dict(state, strict=False)


@torch.no_grad()
def new_draft(target, config: DSparkConfig, *, seed: int = 0) -> DSparkDraftModel:
    """A freshly initialised fp32 draft for ``target``: projections ~ N(0, 0.02), norms 1, biases 0,
    ``markov_w1`` ~ N(0, 1) and ``markov_w2`` = 0 (the Markov bias starts at 0); ``embed_tokens``
    and ``lm_head`` are frozen copies of the target's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkDraftModel(config)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
        if model.markov_head is not None:
            model.markov_head.markov_w1.weight.normal_(0.0, 1.0)
            model.markov_head.markov_w2.weight.zero_()
    model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    model.lm_head.weight.copy_(target.get_output_embeddings().weight)
    for module in (model.embed_tokens, model.lm_head):
        module.requires_grad_(False)
    return model


# ---- one training step -----------------------------------------------------------------------------


@torch.no_grad()
def target_states(target, input_ids: torch.Tensor, capture_layer_ids: list[int]):
    """Run the target on ``input_ids`` ``[B, S]``: ``(context [B, S, m*H], final [B, S, H])`` --
    the concatenated captured ``hidden_states`` and the final post-norm hidden state."""
    out = target(input_ids=input_ids, output_hidden_states=True, logits_to_keep=1)
    context = torch.cat([out.hidden_states[i] for i in capture_layer_ids], dim=-1)
    return context, out.hidden_states[-1]


@torch.no_grad()
def greedy_continuation(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompts`` int64 ``[B, S0]`` followed by ``new_tokens`` greedy tokens of ``target`` (EOS does
    not stop it): ``[B, S0 + new_tokens]``. Batched, with a KV cache."""
    from transformers import DynamicCache

    # transformers renamed ``past_key_values`` to ``cache`` (5.2x): pass whichever this version takes
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    kwargs = {name: DynamicCache(config=target.config), "use_cache": True}
    logits = target(input_ids=prompts, logits_to_keep=1, **kwargs).logits[:, -1]
    tokens = [prompts]
    for i in range(new_tokens):
        tokens.append(logits.argmax(-1, keepdim=True))
        if i + 1 < new_tokens:
            logits = target(input_ids=tokens[-1], **kwargs).logits[:, -1]
    return torch.cat(tokens, dim=1)


def regenerate(target, sequences: torch.Tensor, count: int, *, prompt_tokens: int, batch_size: int = 256,
               seed: int = 0, world: World = SINGLE) -> torch.Tensor:
    """``count`` rows in the target's own words (the paper trains on target-regenerated responses):
    the first ``prompt_tokens`` tokens of randomly chosen rows of ``sequences`` (int64 ``[N, S]``)
    followed by the target's greedy continuation to length S. Returns int64 ``[count, S]`` on the
    target's device. Data parallel: the ranks generate every ``world_size``-th chunk of
    ``batch_size`` rows and broadcast them, so every rank gets all rows, the same as one process."""
    c = Checker("regenerate")
    seq_len = sequences.shape[1]
    c.integer("prompt_tokens", prompt_tokens, low=1, high=seq_len - 1)
    pick = torch.randint(0, sequences.shape[0], (c.integer("count", count, low=1),),
                         generator=torch.Generator().manual_seed(seed))
    device = target.get_input_embeddings().weight.device
    chunks = sequences[pick, :prompt_tokens].to(device).split(batch_size)
    mine = {i: greedy_continuation(target, chunk, seq_len - prompt_tokens)
            for i, chunk in enumerate(chunks) if i % world.world_size == world.rank}
    rows = [mine.get(i, chunk.new_empty(chunk.shape[0], seq_len)) for i, chunk in enumerate(chunks)]
    return torch.cat([world.broadcast(row, src=i % world.world_size) for i, row in enumerate(rows)])


@torch.no_grad()
def target_head_logits(target, final: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 target logits ``[B, ..., V]`` at positions ``rows`` (int64 ``[B, ...]``) of ``final``."""
    b, s, h = final.shape
    picked = final.gather(1, rows.reshape(b, -1, 1).expand(-1, -1, h))
    return target.get_output_embeddings()(picked).float().reshape(*rows.shape, -1)


def sample_anchors(batch: int, seq_len: int, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted distinct anchor positions int64 ``[batch, A]`` in ``[1, seq_len - block_size]`` (so a
    block and the target rows it is trained on fit in the row; A = ``min(num_anchors, that many)``)."""
    c = Checker("sample_anchors")
    candidates = c.integer("seq_len", seq_len, low=block_size + 1) - block_size
    count = min(c.integer("num_anchors", num_anchors, low=1), candidates)
    order = torch.rand(batch, candidates, generator=generator).argsort(dim=-1)[:, :count]
    return order.sort(dim=-1).values + 1


def _visible(anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool, window: int | None):
    """The training mask of runtime.md §2.5 for anchors ``[B, A]`` as a FlexAttention ``mask_mod``:
    whether block query q (block ``q // N``, slot ``q % N``) of row ``batch`` sees key kv (context
    positions ``0..S-1``, then the A blocks' slots)."""
    n = block_size

    def visible(batch, head, q, kv):  # no in-place ops: inductor cannot lower them in a mask_mod
        p = anchors[batch, q // n]
        context = (kv < seq_len) & (kv < p)
        if window is not None:
            context = context & (kv >= p - window)
        slot = kv - seq_len
        same = (kv >= seq_len) & (slot // n == q // n)
        if causal:
            same = same & (slot % n <= q % n)
        return context | same

    return visible


def training_mask(anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool,
                  window: int | None) -> torch.Tensor:
    """bool ``[B, A*N, S + A*N]``: the training mask (``_visible``) as a tensor, for SDPA."""
    b, a = anchors.shape
    batch, q, kv = (torch.arange(size, device=anchors.device) for size in (b, a * block_size, seq_len + a * block_size))
    return _visible(anchors, seq_len, block_size, causal, window)(batch[:, None, None], None, q[:, None], kv)


def training_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool, window: int | None):
    """The training mask (``_visible``) as FlexAttention's block-sparse ``BlockMask`` (no ``[Q, K]``
    tensor): whole 128 x 128 tiles that no query sees are skipped -- most of the context keys past a
    block's anchor and every other block's slots."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, a = anchors.shape
    return create_block_mask(_visible(anchors, seq_len, block_size, causal, window), b, None, a * block_size,
                             seq_len + a * block_size, device=anchors.device, _compile=anchors.device.type == "cuda")


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled once (uncompiled, it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_hidden(model: DSparkDraftModel, context_hidden: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor, *, attention: str = "auto") -> torch.Tensor:
    """Final-norm hidden states ``[B, A, N, H]`` of A blocks per row in one batched pass.

    context_hidden: ``[B, S, m*H]`` captured target states of positions ``0..S-1``;
    block_ids: int64 ``[B, A, N]`` (anchor token, then mask tokens); anchors: int64 ``[B, A]``,
    the anchor positions p (slot k at ``p+k``). The draft's one forward (``model.draft_runner``) over
    one K/V line per row (its context, then its blocks), gradients flowing; only the attention is
    training's: ``"flex"`` (block-sparse FlexAttention over ``training_block_mask``, compiled;
    ``"auto"`` on a GPU) or ``"dense"`` (SDPA with the ``training_mask`` tensor; ``"auto"`` on the
    CPU, where FlexAttention has no backward).
    """
    if attention not in ("auto", "flex", "dense"):
        Checker("block_hidden").fail(f"attention must be 'auto', 'flex' or 'dense', got {attention!r}")
    flex = attention == "flex" or (attention == "auto" and context_hidden.device.type == "cuda")
    if flex and context_hidden.device.type != "cuda" and torch.is_grad_enabled():
        Checker("block_hidden").fail("attention 'flex' trains on a GPU only (FlexAttention has no backward on the "
                                     "CPU): use 'dense' there")
    cfg = model.config
    b, s, _ = context_hidden.shape
    a, n = block_ids.shape[1:]
    device = context_hidden.device
    # the K/V dtype: the GEMMs' (bf16 under a GPU step's autocast), one tensor per layer so autograd
    # sees each layer's writes apart
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.dtype
    shape = (b, s + a * n, cfg.num_key_value_heads, cfg.head_dim)
    k_lines, v_lines = ([torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers] for _ in range(2))
    cos_sin = K.rope_cos_sin_table(rope_inv_freq(cfg.head_dim, cfg.rope_theta, device), s)
    weights = [layer_weights(layer, layer.mlp) for layer in model.layers]
    lines = torch.arange(b, device=device)  # row b's line
    write_context(model, weights, context_hidden.reshape(b * s, -1), torch.arange(s, device=device).repeat(b),
                  lines.repeat_interleave(s), k_lines, v_lines, cos_sin)
    make_mask = training_block_mask if flex else training_mask
    masks: dict[tuple, torch.Tensor] = {}

    def attend(i, q, k_line, v_line):  # [R, n_q, d] over the rows' lines [B, L, n_kv, d]
        kind = (cfg.layer_is_causal(i), cfg.layer_window(i))
        if kind not in masks:
            masks[kind] = make_mask(anchors, s, n, *kind)
        out = _training_attention(q.view(b, a * n, *q.shape[1:]).transpose(1, 2), k_line.transpose(1, 2),
                                  v_line.transpose(1, 2), masks[kind])
        return out.transpose(1, 2).reshape(q.shape)

    positions = (anchors[:, :, None] + torch.arange(n, device=device)).reshape(-1)
    hidden = run_block(model, weights, block_ids.reshape(-1), positions, lines.repeat_interleave(a * n),
                       k_lines, v_lines, cos_sin, attend, rows=(s + torch.arange(a * n, device=device)).repeat(b))
    return hidden.view(b, a, n, -1)


def _training_attention(q, k, v, mask) -> torch.Tensor:
    """Queries ``[B, n_q, Q, d]`` over keys / values ``[B, n_kv, L, d]`` under ``mask`` (bool
    ``[B, Q, L]``: SDPA; a ``BlockMask``: FlexAttention) -> ``[B, n_q, Q, d]``."""
    rep = q.shape[1] // k.shape[1]
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                              attn_mask=mask[:, None])
    from torch.nn.attention.flex_attention import flex_attention

    # the CPU runs it uncompiled (forward only there: the tests compare it with the dense mask)
    flex = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return flex(q, k, v, block_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=rep > 1)


def markov_logits(model: DSparkDraftModel, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Markov-corrected slot logits fp32 ``[R, N, V]`` from hidden ``[R, N, H]`` and the previous
    token of every slot ``[R, N]`` (the rnn head carries its state along the slots)."""
    base = model.lm_head(hidden).float()
    if model.markov_head is None:
        return base
    state, biases = None, []
    for k in range(hidden.shape[1]):
        bias, state = model.markov_head(hidden[:, k], prev_tokens[:, k], state)
        biases.append(bias)
    return base + torch.stack(biases, dim=1)


def target_batch(target, config: DSparkConfig, input_ids: torch.Tensor, anchors: torch.Tensor) -> tuple:
    """What the frozen target gives one step on rows ``[B, S]`` with anchors int64 ``[B, A]``
    (steps 1-2 of the module docstring): ``(context [B, S, m*H], block_ids [B, A, N], anchors,
    prev [B*A, N], target_logits fp32 [B*A, N, V])``, the inputs of ``draft_objective``.

    Slot k of the block at p is trained on target row ``r = p + k - offset`` (``offset`` 1 without
    ``sample_from_anchor``, else 0) and its previous token is ``input_ids[max(r, p)]`` (slot 0: the
    anchor).
    """
    b, n = input_ids.shape[0], config.block_size
    context, final = target_states(target, input_ids, config.capture_layer_ids)
    block_ids = torch.full((b, anchors.shape[1], n), config.mask_token_id, dtype=torch.int64, device=input_ids.device)
    block_ids[..., 0] = input_ids.gather(1, anchors)
    offset = 0 if config.sample_from_anchor else 1
    rows = (anchors[:, :, None] + torch.arange(n, device=input_ids.device) - offset).clamp(min=0)
    prev = input_ids.gather(1, torch.maximum(rows, anchors[:, :, None]).reshape(b, -1)).view(-1, n)
    target_logits = target_head_logits(target, final, rows)
    return context, block_ids, anchors, prev, target_logits.reshape(prev.shape[0], n, -1)


def draft_objective(model: DSparkDraftModel, context: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor,
                    prev: torch.Tensor, target_logits: torch.Tensor, weights: torch.Tensor, *,
                    confidence_backprop: bool = False, greedy_confidence: bool = False,
                    mean_over_ranks: Callable | None = None, attention: str = "auto") -> DSparkLoss:
    """The draft's side of the objective on ``target_batch``'s tensors (steps 2-4 of the module
    docstring). The confidence head reads detached ``[h ; W1[prev]]`` unless
    ``confidence_backprop`` (see the module docstring); ``greedy_confidence`` and
    ``mean_over_ranks`` as in ``dspark_loss``; ``attention`` as in ``block_hidden``."""
    n = model.config.block_size
    hidden = block_hidden(model, context, block_ids, anchors, attention=attention)
    flat_hidden = hidden.reshape(-1, n, hidden.shape[-1])
    logits = markov_logits(model, flat_hidden, prev)
    confidence = None
    if model.confidence_head is not None:
        inputs = [flat_hidden, model.markov_head.markov_w1(prev) if model.confidence_with_markov else None]
        if not confidence_backprop:
            inputs = [None if x is None else x.detach() for x in inputs]
        confidence = model.confidence_head(*inputs)
    return dspark_loss(logits, target_logits, confidence, weights, greedy_confidence=greedy_confidence,
                       mean_over_ranks=mean_over_ranks)


def draft_loss(model: DSparkDraftModel, target, input_ids: torch.Tensor, num_anchors: int,
               weights: torch.Tensor, generator: torch.Generator | None = None, *,
               confidence_backprop: bool = False, greedy_confidence: bool = False) -> DSparkLoss:
    """The objective on one batch of rows ``[B, S]``: ``num_anchors`` anchors per row drawn with
    ``generator``, then ``target_batch`` and ``draft_objective``."""
    b, s = input_ids.shape
    anchors = sample_anchors(b, s, num_anchors, model.config.block_size, generator).to(input_ids.device)
    return draft_objective(model, *target_batch(target, model.config, input_ids, anchors), weights,
                           confidence_backprop=confidence_backprop, greedy_confidence=greedy_confidence)


class DraftStep(torch.nn.Module):
    """``draft_objective`` as a module's ``forward``, so that DDP and FSDP2 can wrap the draft (its
    only submodule, hence state-dict names ``draft.<checkpoint name>``). Under data parallelism
    the loss is normalised over the global batch (``World.mean``)."""

    def __init__(self, draft: DSparkDraftModel, weights: torch.Tensor, *, confidence_backprop: bool = False,
                 greedy_confidence: bool = False, world: World = SINGLE, attention: str = "auto"):
        super().__init__()
        self.draft = draft
        self.weights = weights  # a plain attribute: DDP would broadcast a buffer every step
        self.options = dict(confidence_backprop=confidence_backprop, greedy_confidence=greedy_confidence,
                            mean_over_ranks=world.mean if world.distributed else None, attention=attention)

    def forward(self, context, block_ids, anchors, prev, target_logits) -> DSparkLoss:
        return draft_objective(self.draft, context, block_ids, anchors, prev, target_logits, self.weights,
                               **self.options)


# ---- the training run ------------------------------------------------------------------------------

TRAINING_LOG = "training_log.json"


def save_checkpoint(model: DSparkDraftModel, path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save ``model`` as a speculators checkpoint with weights in ``dtype`` (the model is untouched)."""
    clone = copy.deepcopy(model).to("cpu", dtype)
    return save_draft(clone, path, format="speculators")


def _write_checkpoint(config: DSparkConfig, state: dict[str, torch.Tensor], path, dtype: torch.dtype) -> None:
    """``save_checkpoint`` of the draft whose full state is ``state``, written into a temporary
    directory first and moved file by file, so readers never see a half-written file."""
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    model.load_state_dict(state, assign=True)
    path = Path(path)
    partial = path / ".checkpoint.tmp"
    save_checkpoint(model, partial, dtype)
    for name in sorted(p.name for p in partial.iterdir()):
        (partial / name).replace(path / name)
    partial.rmdir()


def train_draft(target, sequences: torch.Tensor, config: DSparkConfig, options: TrainOptions, *,
                device, num_anchors: int = 64, gamma: float = 4.0,
                confidence_backprop: bool = False, greedy_confidence: bool = False, output=None,
                save_dtype: torch.dtype = torch.bfloat16, stream=None, world: World = SINGLE, fsdp: bool = False,
                resume: bool = False, attention: str = "auto", init_from=None) -> tuple[DSparkDraftModel, list[float]]:
    """Train a draft for ``target`` (a Hugging Face causal LM, frozen, already on ``device``) on
    token rows ``sequences`` int64 ``[N, S]``. ``output``: checkpoint directory (speculators format,
    ``save_dtype`` weights, plus the resumable ``training_state/``), written by rank 0 every
    ``options.save_every`` steps and at the end, and ``training_log.json`` (``_write_log``);
    ``resume``: continue the run saved there (weights, optimizer, data position, generators; the
    same options and data, except ``options.steps`` / ``time_budget``, which may extend the run: the
    learning-rate schedule is then stretched over the new length from the step reached);
    ``init_from``: a draft checkpoint of the same architecture to start from (``warm_start``: its
    weights, a new optimizer and schedule -- a longer training in several runs, or fine-tuning a
    published draft); ``attention``: the draft's training attention (``block_hidden``). Returns the fp32 model (under ``fsdp`` its parameters are this rank's
    DTensor shards) and the logged losses.

    Data parallel over ``world`` (every rank holds the target and all of ``sequences``): each step's
    global batch of ``options.batch_size`` rows and its anchors are drawn on every rank alike and
    split across the ranks; DDP (or FSDP2 with ``fsdp``) averages the gradients, so the run equals
    the one-process run up to float rounding. The progress bar shows the loss terms, the
    per-position acceptance estimate ``1 - TV`` (teacher-forced) and the τ it implies, and the τ
    implied by the per-position greedy agreement."""
    device = torch.device(device)
    target.eval().requires_grad_(False)
    model = new_draft(target, config, seed=options.seed)
    if init_from is not None:
        if resume:
            Checker("train_draft").fail("--init-from starts a new run from a draft's weights; --resume continues "
                                        "a run with its optimizer: give one of them")
        warm_start(model, init_from, target)
    # what the resumed run must share; how long it runs (steps, time budget) may grow on resuming
    fingerprint = {"options": {k: v for k, v in vars(options).items()
                               if k not in ("log_every", "save_every", "steps", "time_budget")},
                   "rows": list(sequences.shape), "num_anchors": num_anchors, "gamma": gamma,
                   "confidence_backprop": confidence_backprop, "greedy_confidence": greedy_confidence,
                   "draft": {k: v for k, v in config.to_speculators_dict().items() if k not in ("verifier", "dtype")}}
    state = LoopState.fresh(options.seed, ("data", "anchors"))
    if resume:
        if output is None:
            Checker("train_draft").fail("resume needs output, the directory of the run to continue")
        resumed = read_training_state(output, fingerprint)
        if options.progress(resumed.loop.step, resumed.loop.elapsed) >= 1.0:
            Checker("resume").fail(f"the run in {str(output)!r} is complete ({resumed.loop.step} steps, "
                                   f"{resumed.loop.elapsed:.0f} s): nothing to resume; to extend it, give more "
                                   f"steps (--steps N > {resumed.loop.step}) or a longer --time-budget")
        model.load_state_dict(resumed.model)
        state = resumed.loop
    model.to(device)
    weights = position_weights(config.block_size, gamma, config.sample_from_anchor, device=device)
    step_module = DraftStep(model, weights, confidence_backprop=confidence_backprop,
                            greedy_confidence=greedy_confidence, world=world, attention=attention)
    # FSDP units: the big modules the step calls through their forward (the rest is the root unit)
    units = [model.embed_tokens, model.lm_head, *(layer.mlp for layer in model.layers)]
    module = wrap(step_module, world, fsdp=fsdp, shard_units=units)
    optimizer = adamw(module.parameters(), options)
    if resume:
        load_optimizer_state(module, optimizer, resumed.optimizer)

    def step(batch: torch.Tensor):
        anchors = sample_anchors(options.batch_size, batch.shape[1], num_anchors, config.block_size,
                                 state.generators["anchors"])
        result = module(*target_batch(target, config, batch, world.shard(anchors).to(device)))
        return result.loss, {"ce": result.ce, "tv": result.tv, "bce": result.bce, "accept": result.acceptance,
                             "greedy": result.greedy_acceptance}

    def describe(stats) -> str:
        accept = " ".join(f"{a:.2f}" for a in stats["accept"].tolist())
        return (f"ce {float(stats['ce']):.3f} tv {float(stats['tv']):.3f} bce {float(stats['bce']):.3f} | "
                f"accept/pos {accept} tau~{expected_accepted_length(stats['accept']):.2f} "
                f"(greedy ~{expected_accepted_length(stats['greedy']):.2f}) |")

    def save(loop: LoopState) -> None:
        model_state, optimizer_state = gather_state(module, optimizer)  # a collective: every rank
        if world.is_main:
            draft_state = {name.removeprefix("draft."): t for name, t in model_state.items()}
            _write_checkpoint(config, draft_state, output, save_dtype)
            write_training_state(output, draft_state, optimizer_state, loop, fingerprint)

    log: list[dict] = []
    losses = optimize(optimizer, step, sequences, options, device=device, name="dspark train", describe=describe,
                      save=None if output is None else save, stream=stream, world=world, state=state, log=log)
    if output is not None and world.is_main and log:
        _write_log(Path(output) / TRAINING_LOG, log, world, fsdp, device, options.batch_size * sequences.shape[1])
    return model, losses


def _write_log(path: Path, log: list[dict], world: World, fsdp: bool, device, tokens_per_step: int) -> None:
    """``training_log.json``: this session's logged steps, its throughput in target tokens per
    second (global batch x row length per step), timed from the first logged step to the last
    (start-up and the first step's warm-up left out, checkpoint writes in between counted), and
    rank 0's peak GPU memory."""
    first, last = log[0], log[-1]
    seconds = last["seconds"] - first["seconds"]
    throughput = (last["step"] - first["step"]) * tokens_per_step / seconds if seconds > 0 else None
    device = torch.device(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    summary = {"world_size": world.world_size, "parallel": "fsdp" if fsdp else "ddp" if world.distributed else None,
               "device": device.type, "tokens_per_step": tokens_per_step, "steps": last["step"],
               "tokens_per_second": throughput, "peak_gpu_memory_bytes": peak, "log": log}
    path.write_text(json.dumps(summary, indent=1) + "\n")
