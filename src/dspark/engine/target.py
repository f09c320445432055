"""The target ("verifier") model: a Hugging Face causal LM behind the three calls the engine needs.

``prefill`` and ``verify`` run the model over new tokens on top of its KV cache and return fp32
logits plus the captured hidden states at the draft's ``capture_layer_ids`` (Hugging Face
``output_hidden_states`` indices: 0 = embedding output, ``a`` = input of decoder layer ``a``),
concatenated along the feature axis; ``rollback`` crops the KV cache back to the accepted prefix.
Works with Qwen3 and other Llama-style models whose cache is a ``DynamicCache`` (full attention).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels._validate import Checker

__all__ = ["TargetModel", "TargetOutput", "eos_token_ids"]


@dataclass
class TargetOutput:
    """``logits`` fp32 ``[T, V]`` (only the last row after a prefill); ``hidden`` ``[T, m*H]`` in the
    model's dtype, or ``None`` when capture was not requested."""

    logits: torch.Tensor
    hidden: torch.Tensor | None


class TargetModel:
    """A Hugging Face causal LM with a KV cache for one sequence (batch 1).

    ``capture_layer_ids``: the ``output_hidden_states`` indices whose rows are concatenated into
    ``TargetOutput.hidden`` (the draft model's ``config.capture_layer_ids``). The index of the last
    entry (post final norm) is refused: drafts are trained on raw residual states.
    """

    def __init__(self, model: torch.nn.Module, capture_layer_ids: Sequence[int]):
        c = Checker("TargetModel")
        self.model = model.eval()
        self.config = model.config
        num_layers = getattr(self.config, "num_hidden_layers", None) or self.config.get_text_config().num_hidden_layers
        self.capture_layer_ids = [c.integer("capture_layer_ids[]", i, low=0, high=num_layers - 1) for i in capture_layer_ids]
        if not self.capture_layer_ids:
            c.fail("capture_layer_ids must name at least one hidden_states index, got []")
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    @classmethod
    def from_pretrained(cls, path: str, capture_layer_ids: Sequence[int], *, device=None, dtype=None) -> "TargetModel":
        """Load a causal LM from a local directory (``transformers.AutoModelForCausalLM``)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return cls(model.to(device) if device is not None else model, capture_layer_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def length(self) -> int:
        """Tokens held in the KV cache (0 before the first prefill)."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    def prefill(self, input_ids: torch.Tensor, *, capture: bool = True) -> TargetOutput:
        """Start a new sequence: run ``input_ids`` (int ``[T]``, T >= 1) on an empty cache.

        Returns the logits of the last position only (``[1, V]``) and, with ``capture``, the hidden
        states of all ``T`` positions.
        """
        c = Checker("TargetModel.prefill")
        c.tensor("input_ids", input_ids, ndim=1)
        if input_ids.numel() == 0:
            c.fail("input_ids must hold at least one token, got 0")
        c.ids_in_range("input_ids", input_ids, self.vocab_size)
        self.cache = None
        return self._forward(input_ids, last_only=True, capture=capture)

    def verify(self, token_ids: torch.Tensor, *, capture: bool = True) -> TargetOutput:
        """Run ``token_ids`` (int ``[L]``) after the cached prefix; logits of all ``L`` positions.

        Row i of ``logits`` predicts the token after ``token_ids[i]``. The cache grows by ``L``;
        ``rollback`` trims what verification rejects.
        """
        if self.cache is None:
            Checker("TargetModel.verify").fail("no sequence: call prefill first")
        return self._forward(token_ids, last_only=False, capture=capture)

    def rollback(self, length: int) -> None:
        """Crop the KV cache to its first ``length`` tokens (the accepted prefix)."""
        c = Checker("TargetModel.rollback")
        length = c.integer("length", length, low=0, high=self.length)
        removed = self.length - length
        if removed:
            self.cache.crop(-removed)  # a negative count removes tokens in every transformers 5.x

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, *, last_only: bool, capture: bool) -> TargetOutput:
        out = self.model(
            input_ids=ids.to(self.device, torch.long).view(1, -1),
            use_cache=True,
            output_hidden_states=capture,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kwarg: self.cache},
        )
        self.cache = getattr(out, self._cache_kwarg)
        hidden = None
        if capture:
            hidden = torch.cat([out.hidden_states[i][0] for i in self.capture_layer_ids], dim=-1)
        return TargetOutput(out.logits[0].float(), hidden)


def eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The model's end-of-sequence ids (generation config first, then config); may be empty."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []
