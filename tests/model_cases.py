"""Tiny random-weight models for tests (no downloads): a Qwen3 target and DSpark drafts for it.

``tiny_qwen3_target`` builds a Hugging Face ``Qwen3ForCausalLM`` from a config; ``write_tiny_draft``
writes a matching DSpark draft checkpoint (speculators or DeepSpec format) whose embedding and
``lm_head`` are the target's, so its drafts are related to the target's tokens without being
correct. ``tiny_draft_config`` and ``random_draft`` expose the two steps for tests that need the
model without a checkpoint.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark.model import DSparkConfig, DSparkDraftModel, build_vocab_mapping, save_draft

DEFAULT_LAYER_TYPES = ("full_attention", "sliding_attention")
TINY_SLIDING_WINDOW = 8


def tiny_qwen3_target(seed: int = 0, vocab_size: int = 96, num_layers: int = 4, **overrides) -> Qwen3ForCausalLM:
    """A random Qwen3 causal LM: H=32, 4 heads (2 KV) of 8 dims, float32, eval mode.

    ``initializer_range`` 0.1 (HF default 0.02) makes next-token distributions peaked enough that
    greedy choices are not decided by float rounding. ``overrides`` go to ``Qwen3Config``.
    """
    settings = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    settings.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**settings))
    return model.eval()


def tiny_draft_config(target_config, *, markov_head_type: str = "vanilla", markov_rank: int = 8,
                      block_size: int = 4, sample_from_anchor: bool = True, draft_vocab_size: int | None = None,
                      confidence: bool = True, layer_types=None, checkpoint_format: str = "speculators",
                      **overrides) -> DSparkConfig:
    """A DSpark config matching ``target_config`` (a Qwen3Config): capture ids ``[1, L/2, L-1]``
    (HF indices), mask id ``V-1``, layers ``full_attention`` + ``sliding_attention`` (window 8)."""
    layers = target_config.num_hidden_layers
    layer_types = list(DEFAULT_LAYER_TYPES if layer_types is None else layer_types)
    settings = dict(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.head_dim,
        intermediate_size=target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        capture_layer_ids=sorted({1, layers // 2, layers - 1}),
        num_target_layers=layers,
        mask_token_id=target_config.vocab_size - 1,
        block_size=block_size,
        sample_from_anchor=sample_from_anchor,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=confidence,
        confidence_head_with_markov=True,
        layer_types=layer_types,
        sliding_window=TINY_SLIDING_WINDOW if "sliding_attention" in layer_types else None,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=target_config.rope_parameters["rope_theta"],
        checkpoint_format=checkpoint_format,
        dtype="float32",
    )
    settings.update(overrides)
    return DSparkConfig(**settings)


@torch.no_grad()
def random_draft(config: DSparkConfig, seed: int = 0, target: Qwen3ForCausalLM | None = None) -> DSparkDraftModel:
    """A float32 draft with random weights (std 0.1, norm scales 1 +- 0.1, Markov weights std 0.5
    so the head visibly changes the argmax). With ``target``, ``embed_tokens`` and ``lm_head`` rows
    are copied from it. A reduced vocabulary keeps a random set of ``draft_vocab_size`` target ids."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkDraftModel(config)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if name.startswith("markov_head.markov_w") else 0.1)
        keep = torch.arange(config.vocab_size)
        if config.reduced_vocab:
            keep = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
            model.d2t, model.t2d = build_vocab_mapping(keep, config.vocab_size)
    if target is not None:
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight[keep])
    return model.eval().requires_grad_(False)


def write_tiny_draft(target: Qwen3ForCausalLM, directory, *, format: str, markov_head_type: str = "vanilla",
                     markov_rank: int = 8, block_size: int = 4, sample_from_anchor: bool = True,
                     draft_vocab_size: int | None = None, confidence: bool = True, layer_types=None,
                     seed: int = 0):
    """Write a random draft for ``target`` to ``directory`` in ``format``; returns the directory."""
    config = tiny_draft_config(target.config, markov_head_type=markov_head_type, markov_rank=markov_rank,
                               block_size=block_size, sample_from_anchor=sample_from_anchor,
                               draft_vocab_size=draft_vocab_size, confidence=confidence,
                               layer_types=layer_types, checkpoint_format=format)
    return save_draft(random_draft(config, seed, target), directory, format=format)


def write_tiny_checkpoints(root):
    """``root/target`` (``tiny_qwen3_target()`` with a word-level tokenizer: token i is "t<i>"),
    ``root/bare`` (the same weights, no tokenizer) and a draft for it in each format
    (``root/speculators``, ``root/deepspec``). Returns ``(target model, {format: draft directory})``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tiny_qwen3_target()
    target.save_pretrained(root / "target")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(target.config.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(root / "target")
    target.save_pretrained(root / "bare")
    drafts = {fmt: str(write_tiny_draft(target, root / fmt, format=fmt)) for fmt in ("speculators", "deepspec")}
    return target, drafts
