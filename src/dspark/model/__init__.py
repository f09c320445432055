"""The DSpark draft model, its heads and checkpoint formats (runtime.md Part I).

* ``DSparkConfig``: configuration; ``capture_layer_ids`` are HF ``output_hidden_states`` indices.
* ``DSparkDraftModel``: ``new_cache``, ``forward_block``, ``backbone_logits``, ``markov_w1``,
  ``markov_w2_target``, ``markov_bias``, ``confidence_weight``/``confidence_bias``,
  ``confidence_logits`` -- all in the target vocabulary.
* ``load_draft`` / ``save_draft`` (speculators and DeepSpec), ``save_heads_sidecar`` /
  ``load_heads_sidecar`` (TensorRT-Edge-LLM), ``check_target_compatible``.
* The engine's target runners: ``llama.TargetLM`` (fused Llama / Qwen forward) and
  ``hf_target.HFTarget`` (any other decoder-only transformers model, its own modeling code).
"""

from .checkpoint import (
    HEADS_SIDECAR_NAME,
    check_target_compatible,
    load_draft,
    load_heads_sidecar,
    save_draft,
    save_heads_sidecar,
)
from .config import DSparkConfig
from .draft import DraftCache, DSparkDraftModel
from .heads import build_vocab_mapping

__all__ = [
    "DSparkConfig",
    "DSparkDraftModel",
    "DraftCache",
    "build_vocab_mapping",
    "load_draft",
    "save_draft",
    "save_heads_sidecar",
    "load_heads_sidecar",
    "check_target_compatible",
    "HEADS_SIDECAR_NAME",
]
