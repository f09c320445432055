"""The target ("verifier") model: a Hugging Face causal LM behind the three calls the engine needs.

``prefill`` and ``verify`` run the model over new tokens on top of its KV cache and return fp32
logits plus the captured hidden states at the draft's ``capture_layer_ids`` (Hugging Face
``output_hidden_states`` indices: 0 = embedding output, ``a`` = input of decoder layer ``a``),
concatenated along the feature axis; ``rollback`` crops the KV cache back to the accepted prefix.
Works with Qwen3 and other Llama-style models whose cache is a ``DynamicCache`` (full attention).

``load_target_model`` loads a local checkpoint directory and refuses what would otherwise run as
silent garbage or fail deep inside transformers: a missing path or a file, a truncated safetensors
file, a tensor the checkpoint lacks (transformers would initialise it at random) or has with the
wrong shape, and pickle-only weights (``pytorch_model.bin``: unpickling can run arbitrary code, so it
needs ``allow_pickle=True``, the CLI's ``--allow-pickle``). ``TargetModel.max_model_len`` is the
context the engine may fill: the config's ``max_position_embeddings``, optionally lowered.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..kernels._validate import Checker

__all__ = ["TargetModel", "TargetOutput", "eos_token_ids", "load_target_model", "check_target_directory",
           "resolve_device"]

PICKLE_HINT = ("; convert them to safetensors, or, only for a checkpoint you trust (unpickling can run code), "
               "pass allow_pickle=True (dspark: --allow-pickle)")


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
    ``max_model_len``: lowers the context (prompt + generated tokens) below the config's
    ``max_position_embeddings``; ``self.max_model_len`` is the result (None: no known limit).
    """

    def __init__(self, model: torch.nn.Module, capture_layer_ids: Sequence[int], *, max_model_len: int | None = None):
        c = Checker("TargetModel")
        self.model = model.eval()
        self.config = model.config
        num_layers = getattr(self.config, "num_hidden_layers", None) or self.config.get_text_config().num_hidden_layers
        self.capture_layer_ids = [c.integer("capture_layer_ids[]", i, low=0, high=num_layers - 1) for i in capture_layer_ids]
        if not self.capture_layer_ids:
            c.fail("capture_layer_ids must name at least one hidden_states index, got []")
        self.max_model_len = _context_length(c, self.config, max_model_len)
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    @classmethod
    def from_pretrained(cls, path, capture_layer_ids: Sequence[int], *, device=None, dtype=None,
                        max_model_len: int | None = None, allow_pickle: bool = False) -> "TargetModel":
        """Load a causal LM from a local directory (``load_target_model``)."""
        model = load_target_model(path, device=device, dtype=dtype, allow_pickle=allow_pickle)
        return cls(model, capture_layer_ids, max_model_len=max_model_len)

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


def load_target_model(path, *, device=None, dtype=None, allow_pickle: bool = False) -> torch.nn.Module:
    """A Hugging Face causal LM from the local checkpoint directory ``path`` (``config.json`` +
    ``model.safetensors`` or its shards), in eval mode, on ``device`` (default: where transformers
    puts it), in ``dtype`` (default: transformers' choice).

    ValueError naming the problem for a path that does not exist or is a file, a truncated or
    corrupt safetensors file, a tensor the model needs that the checkpoint lacks or holds with
    another shape, and pickle-only weights unless ``allow_pickle`` (unpickling runs code from the
    file: allow it only for a checkpoint you trust).
    """
    from transformers import AutoModelForCausalLM

    from ..model.safetensors_io import checkpoint_shapes, pickle_files

    c = Checker("load_target")
    directory = check_target_directory(path)
    pickled = not any(directory.glob("*.safetensors")) and bool(pickle_files(directory))
    if not (pickled and allow_pickle):
        # refuses pickle-only weights, truncated files and broken indexes before transformers reads them
        checkpoint_shapes(c, directory, pickle_hint=PICKLE_HINT)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, use_safetensors=not pickled, output_loading_info=True,
            ignore_mismatched_sizes=True)  # mismatches are reported below, naming the tensor
    except (OSError, ValueError, KeyError) as exc:
        c.fail(f"cannot load the target from {str(directory)!r}: {exc}")
    if info["mismatched_keys"]:
        name, found, wanted = sorted(info["mismatched_keys"])[0]
        c.fail(f"tensor {name!r} has shape {list(found)} in {str(directory)!r}, the config needs {list(wanted)}")
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        c.fail(f"the checkpoint in {str(directory)!r} lacks tensor {missing[0]!r}{more}: refusing to run with "
               f"randomly initialised weights")
    model = model.eval()
    return model.to(device) if device is not None else model


def resolve_device(device, *, name: str = "device") -> torch.device:
    """``device`` (a string or ``torch.device``; None: cuda when available, else cpu) as a
    ``torch.device`` that exists on this machine; ValueError naming ``name`` otherwise."""
    c = Checker(name)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        c.fail(f"{device!r} is not a device: use cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            c.fail(f"{str(device)!r} asked for, but CUDA is not available on this machine "
                   f"(torch {torch.__version__}); use cpu")
        if device.index is not None and device.index >= count:
            c.fail(f"{str(device)!r} asked for, but this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if not getattr(backend, "is_available", lambda: False)():
            c.fail(f"{str(device)!r} is not available on this machine: use cpu or cuda")
    return device


def check_target_directory(path) -> Path:
    """``path`` as a ``Path`` if it is a directory with a ``config.json``; ValueError saying what it is
    instead (missing, a file, not a checkpoint)."""
    c = Checker("load_target")
    if not isinstance(path, (str, os.PathLike)):
        c.fail(f"path must be a checkpoint directory (str or os.PathLike), got {type(path).__name__}", TypeError)
    directory = Path(path)
    if not directory.exists():
        c.fail(f"target directory {str(path)!r} does not exist (a local Hugging Face checkpoint directory: "
               f"config.json + model.safetensors)")
    if not directory.is_dir():
        c.fail(f"target path {str(path)!r} is a file; give its checkpoint directory (config.json + model.safetensors)")
    if not (directory / "config.json").is_file():
        c.fail(f"no config.json in {str(path)!r}: not a Hugging Face checkpoint directory")
    return directory


def _context_length(c: Checker, config, max_model_len: int | None) -> int | None:
    """The config's ``max_position_embeddings``, lowered to ``max_model_len`` when given."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if max_model_len is None:
        return limit
    max_model_len = c.integer("max_model_len", max_model_len, low=2)
    if limit is not None and max_model_len > limit:
        c.fail(f"max_model_len={max_model_len} exceeds the target's context of {limit} tokens (max_position_embeddings)")
    return max_model_len
