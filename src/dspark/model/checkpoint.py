"""DSpark draft checkpoints: speculators and DeepSpec directories, the TensorRT-Edge-LLM heads
sidecar, and draft/target compatibility checks (runtime.md §5.1 Part II, §6).

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or safetensors shards with
``model.safetensors.index.json``). Both formats use the same tensor names (the module tree of
``DSparkDraftModel``); they differ only in ``config.json``. Weights are read with safetensors only:
pickled ``.bin``/``.pt`` files are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..kernels._validate import Checker
from .config import CHECKPOINT_FORMATS, DSparkConfig
from .draft import DSparkDraftModel
from .heads import check_vocab_mapping
from .safetensors_io import load_tensors, save_tensors

__all__ = ["load_draft", "save_draft", "save_heads_sidecar", "load_heads_sidecar", "check_target_compatible",
           "read_json_object", "check_config_files", "CONFIG_NAME", "WEIGHTS_NAME", "HEADS_SIDECAR_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
HEADS_SIDECAR_NAME = "dspark_heads.safetensors"
_INTEGER_TENSORS = {"d2t": torch.int64, "t2d": torch.bool}
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")
_SIDECAR_MARKOV = ("markov_w1", "markov_w2")
_SIDECAR_CONFIDENCE = ("confidence_weight", "confidence_bias")


def load_draft(path, *, target=None, device=None, dtype: torch.dtype | None = None) -> DSparkDraftModel:
    """Load a speculators (``dspark`` or ``dflash``) or DeepSpec draft directory (format detected
    from ``config.json``).

    target: the target ("verifier") as a Hugging Face model or its directory. speculators 0.9 does
    not save the weights a draft shares with its target: a checkpoint without ``embed_tokens.weight``
    takes the target's input embedding, one without ``lm_head.weight`` the target's output head
    (for a reduced vocabulary its rows at the draft's target ids). Needed only then; a directory is
    loaded with transformers only then. Rows taken from a model on the same device in the same dtype
    are shared with it, not copied. device: where the weights go (default CPU). dtype: floating
    dtype of the model (default: the checkpoint's). Raises ValueError naming a missing, unexpected
    or mis-shaped tensor, an unknown format, an inconsistent ``d2t``/``t2d`` pair, or a target that
    is needed but not given or does not fit. Returns the model in eval mode, no grads.
    """
    c = Checker("load_draft")
    directory = _directory(c, path)
    if target is not None and not isinstance(target, (str, os.PathLike)) and not hasattr(target, "get_input_embeddings"):
        c.fail(f"target must be a Hugging Face model or its directory, got {type(target).__name__}", TypeError)
    config = DSparkConfig.from_dict(_read_json(c, directory / CONFIG_NAME))
    tensors = _read_weights(c, directory)
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    expected = model.state_dict()
    omitted = [name for name in TARGET_OWNED if name not in tensors]
    _check_names_and_shapes(c, {k: v for k, v in expected.items() if k not in omitted}, tensors)
    if config.reduced_vocab:
        check_vocab_mapping("load_draft", tensors["d2t"], tensors["t2d"], config.vocab_size)
    if omitted:
        tensors.update(_target_owned_tensors(c, directory, config, expected, tensors, omitted, target))
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        c.fail(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}", TypeError)
    device = torch.device("cpu") if device is None else torch.device(device)
    state = {name: t.to(device, _INTEGER_TENSORS.get(name, dtype)) for name, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    config.dtype = str(dtype).removeprefix("torch.")
    return model.eval().requires_grad_(False)


def _target_owned_tensors(c: Checker, directory: Path, config: DSparkConfig, expected: dict, tensors: dict,
                          omitted: list[str], target) -> dict[str, torch.Tensor]:
    """The target's rows for the ``omitted`` ones of ``embed_tokens.weight`` / ``lm_head.weight``
    (speculators 0.9: "verifier-owned weights are reconstructed on load")."""
    if target is None:
        verifier = config.verifier.get("name_or_path")
        recorded = f" (its config names the verifier {verifier!r})" if verifier else ""
        c.fail(f"checkpoint {str(directory)!r} omits {omitted}, the weights a draft shares with its target, as "
               f"speculators 0.9 saves drafts: pass target= (the target model or its directory){recorded} "
               f"to take them from it")
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target, dtype="auto")
    check_target_compatible(config, target.config)
    modules = {"embed_tokens.weight": ("input embedding", target.get_input_embeddings()),
               "lm_head.weight": ("output head", target.get_output_embeddings())}
    out = {}
    for name in omitted:
        what, module = modules[name]
        if module is None:
            c.fail(f"target {type(target).__name__} has no {what} to take {name!r} from")
        rows = module.weight.detach()
        if name == "lm_head.weight" and config.reduced_vocab:  # the draft vocabulary's rows
            rows = rows[(torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()).to(rows.device)]
        if rows.shape != expected[name].shape:
            c.fail(f"the target's {what} has shape {list(rows.shape)}, the draft's {name!r} needs "
                   f"{list(expected[name].shape)}")
        out[name] = rows
    return out


def save_draft(model: DSparkDraftModel, path, *, format: str = "speculators") -> Path:
    """Write ``config.json`` + ``model.safetensors`` of ``model`` in ``format`` ("speculators" or
    "deepspec"; DeepSpec refuses reduced vocabularies). Weights keep the model's dtype. Returns the
    directory."""
    c = Checker("save_draft")
    if format not in CHECKPOINT_FORMATS:
        c.fail(f"format must be one of {list(CHECKPOINT_FORMATS)}, got {format!r}")
    if not isinstance(model, DSparkDraftModel):
        c.fail(f"model must be a DSparkDraftModel, got {type(model).__name__}", TypeError)
    config = dataclasses.replace(model.config, checkpoint_format=format,
                                 dtype=str(model.dtype).removeprefix("torch."))
    config_dict = config.to_speculators_dict() if format == "speculators" else config.to_deepspec_dict()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_tensors(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2) + "\n")
    return directory


def save_heads_sidecar(model: DSparkDraftModel, path) -> Path:
    """Write TensorRT-Edge-LLM's ``dspark_heads.safetensors`` (fp16): ``markov_w1 [V,R]``,
    ``markov_w2 [V,R]`` and, with a confidence head, ``confidence_weight [H(+R)]`` and
    ``confidence_bias [1]``. ``path`` is a directory (file name ``dspark_heads.safetensors``) or a
    ``.safetensors`` file. TensorRT-Edge-LLM accepts only full-vocabulary vanilla heads, so others
    raise ValueError. Returns the file path."""
    c = Checker("save_heads_sidecar")
    cfg = model.config
    if cfg.reduced_vocab:
        c.fail(f"the heads sidecar needs a full-vocabulary draft, got draft_vocab_size={cfg.draft_vocab_size} "
               f"< vocab_size={cfg.vocab_size}")
    if cfg.markov_rank == 0:
        c.fail("the heads sidecar holds a Markov head, but this draft has none (markov_rank 0)")
    if cfg.markov_head_type != "vanilla":
        c.fail(f"the heads sidecar holds a vanilla Markov head only, got markov_head_type={cfg.markov_head_type!r}")
    tensors = {"markov_w1": model.markov_w1, "markov_w2": model.markov_w2_target}
    if model.confidence_head is not None:
        tensors.update(confidence_weight=model.confidence_weight, confidence_bias=model.confidence_bias)
    file = _sidecar_file(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in tensors.items()}, file)
    return file


def load_heads_sidecar(path) -> dict[str, torch.Tensor]:
    """Read and validate a ``dspark_heads.safetensors`` (file or its directory) -> dict of fp16
    CPU tensors ``markov_w1 [V,R]``, ``markov_w2 [V,R]`` and optionally ``confidence_weight``
    (1-D) + ``confidence_bias [1]``, as TensorRT-Edge-LLM's loader requires."""
    c = Checker("load_heads_sidecar")
    file = _sidecar_file(path)
    if not file.is_file():
        c.fail(f"no heads sidecar at {file}")
    tensors = load_file(str(file))
    names = set(tensors)
    allowed = set(_SIDECAR_MARKOV + _SIDECAR_CONFIDENCE)
    if names - allowed:
        c.fail(f"unexpected tensor {sorted(names - allowed)[0]!r} in {file.name}; allowed: {sorted(allowed)}")
    for name in _SIDECAR_MARKOV:
        if name not in tensors:
            c.fail(f"missing tensor {name!r} in {file.name}")
    confidence = [n for n in _SIDECAR_CONFIDENCE if n in tensors]
    if len(confidence) == 1:
        c.fail(f"confidence_weight and confidence_bias must be given together; {file.name} holds only {confidence[0]}")
    for name, t in tensors.items():
        c.tensor(name, t, dtype=torch.float16)
    w1 = c.tensor("markov_w1", tensors["markov_w1"], ndim=2)
    c.tensor("markov_w2", tensors["markov_w2"], shape=list(w1.shape))
    if confidence:
        c.tensor("confidence_weight", tensors["confidence_weight"], ndim=1)
        c.tensor("confidence_bias", tensors["confidence_bias"], shape=[1])
    return tensors


def check_target_compatible(draft_config: DSparkConfig, target_hf_config) -> None:
    """Raise ValueError if a draft cannot serve a target (a transformers config or a dict):
    hidden size, vocabulary size, layer count, or a capture layer id outside ``[0, L_t - 1]``
    (HF ``hidden_states[L_t]`` is post-final-norm and never a draft input)."""
    c = Checker("check_target_compatible")
    if hasattr(target_hf_config, "get_text_config"):
        target_hf_config = target_hf_config.get_text_config()
    get = target_hf_config.get if isinstance(target_hf_config, dict) else lambda k: getattr(target_hf_config, k, None)
    hidden, vocab, layers = get("hidden_size"), get("vocab_size"), get("num_hidden_layers")
    if hidden != draft_config.hidden_size:
        c.fail(f"hidden size mismatch: draft hidden_size={draft_config.hidden_size}, target hidden_size={hidden}")
    if vocab != draft_config.vocab_size:
        c.fail(f"vocabulary mismatch: draft vocab_size={draft_config.vocab_size}, target vocab_size={vocab}")
    if draft_config.num_target_layers is not None and draft_config.num_target_layers != layers:
        c.fail(f"layer count mismatch: draft num_target_layers={draft_config.num_target_layers}, "
               f"target num_hidden_layers={layers}")
    bad = [i for i in draft_config.capture_layer_ids if i >= layers]
    if bad:
        c.fail(f"capture layer id(s) {bad} out of range for a {layers}-layer target: HF hidden_states "
               f"indices must be in [0, {layers - 1}] (capture_layer_ids={draft_config.capture_layer_ids})")


# ---- helpers ------------------------------------------------------------------------------------


def _directory(c: Checker, path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        c.fail(f"path must be a checkpoint directory, got {str(path)!r}")
    return directory


def _read_json(c: Checker, file: Path) -> dict:
    if not file.is_file():
        c.fail(f"no {file.name} in {str(file.parent)!r}")
    try:
        return read_json_object(file)
    except ValueError as exc:
        c.fail(str(exc))


def read_json_object(file) -> dict:
    """The JSON object in ``file`` (a checkpoint's ``config.json``: every reader of one goes through
    here). ValueError naming the file and what is wrong: not UTF-8, not valid JSON (the parser's
    message, with the line and column), or JSON that is not an object."""
    try:
        value = json.loads(Path(file).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(file)!r} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(file)!r} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def check_config_files(directories, c: Checker | None = None) -> None:
    """``read_json_object`` of each checkpoint directory's ``config.json`` that exists (None entries
    skipped), its ValueError prefixed by ``c``'s function name when given: run before loaders whose
    own JSON errors name no file (transformers')."""
    for directory in directories:
        if directory is not None and (Path(directory) / CONFIG_NAME).is_file():
            try:
                read_json_object(Path(directory) / CONFIG_NAME)
            except ValueError as exc:
                if c is None:
                    raise
                c.fail(str(exc))


def _read_weights(c: Checker, directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in the index (checked: a missing
    shard, a truncated or corrupt file is a ValueError naming it)."""
    return load_tensors(c, directory)


def _check_names_and_shapes(c: Checker, expected: dict, found: dict) -> None:
    """Missing / unexpected / mis-shaped / wrongly typed tensors, each named in the error."""
    missing = sorted(set(expected) - set(found))
    if missing:
        c.fail(f"checkpoint is missing tensor {missing[0]!r} (expected shape {list(expected[missing[0]].shape)})"
               + (f" and {len(missing) - 1} more: {missing[1:6]}" if len(missing) > 1 else ""))
    extra = sorted(set(found) - set(expected))
    if extra:
        c.fail(f"checkpoint has unexpected tensor {extra[0]!r} (shape {list(found[extra[0]].shape)}) that this "
               f"config does not use" + (f", and {len(extra) - 1} more: {extra[1:6]}" if len(extra) > 1 else ""))
    for name, want in expected.items():
        got = found[name]
        if got.shape != want.shape:
            c.fail(f"tensor {name!r} has shape {list(got.shape)} in the checkpoint, expected {list(want.shape)}")
        if got.dtype.is_floating_point != want.dtype.is_floating_point:
            c.fail(f"tensor {name!r} has dtype {got.dtype} in the checkpoint, expected {want.dtype}", TypeError)


def _sidecar_file(path) -> Path:
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / HEADS_SIDECAR_NAME
