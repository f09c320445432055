"""Loading the target ("verifier"): a Hugging Face causal LM from a checkpoint directory, its EOS ids, the device.

``load_target_model`` loads a local checkpoint directory and refuses what would otherwise run as
silent garbage or fail deep inside transformers: a missing path or a file, a truncated safetensors
file, a tensor the checkpoint lacks (transformers would initialise it at random) or has with the
wrong shape, and pickle-only weights (``pytorch_model.bin``: unpickling can run arbitrary code, so it
needs ``allow_pickle=True``, the CLI's ``--allow-pickle``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..kernels._validate import Checker

__all__ = ["eos_token_ids", "load_target_model", "check_target_checkpoint", "check_target_directory",
           "resolve_device", "default_dtype", "load_models", "check_parallel_target", "is_builder"]

PICKLE_HINT = ("; convert them to safetensors, or, only for a checkpoint you trust (unpickling can run code), "
               "pass allow_pickle=True (dspark: --allow-pickle)")


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

    from ..model.safetensors_io import pickle_files

    c = Checker("load_target")
    directory = check_target_directory(path)
    pickled = not any(directory.glob("*.safetensors")) and bool(pickle_files(directory))
    if not (pickled and allow_pickle):
        check_target_checkpoint(directory)
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


def check_target_checkpoint(path) -> Path:
    """``check_target_directory``, then its safetensors files' headers: ValueError for pickle-only
    weights, a truncated file or a broken index, before any loader reads them."""
    from ..model.safetensors_io import checkpoint_shapes

    directory = check_target_directory(path)
    checkpoint_shapes(Checker("load_target"), directory, pickle_hint=PICKLE_HINT)
    return directory


def default_dtype(device: torch.device, target=None) -> torch.dtype:
    """The dtype a target directory runs in when none is given (the CLI's ``--dtype auto``): on a GPU
    the checkpoint's half precision (``torch_dtype`` / ``dtype`` in its config.json; bf16 when it
    names none or a full precision); on a CPU float32, where half precision is slow and rounds greedy
    near-ties differently from one batch to another."""
    from ..model.checkpoint import CONFIG_NAME, read_json_object

    if device.type != "cuda":
        return torch.float32
    file = None if target is None else Path(target) / CONFIG_NAME
    config = read_json_object(file) if file is not None and file.is_file() else {}
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


# ---------------------------------------------------------------------------------- the engine's models


def check_parallel_target(c: Checker, target, size: int) -> None:
    """Under tensor parallelism (``size`` > 1) the target must be one ``TargetLM`` shards: a Llama /
    Qwen2 / Qwen3 checkpoint directory or loaded model. Any other family runs its own modeling code
    (``HFTarget``), which dspark does not shard: ValueError naming it."""
    from ..model.llama import SUPPORTED_MODEL_TYPES

    if size == 1 or is_builder(target):  # a builder makes the shard of the rank it is given
        return
    if isinstance(target, (str, Path)):
        model_type = _model_type(Path(target))
    elif isinstance(target, torch.nn.Module):
        model_type = getattr(target.config, "model_type", None)
    else:
        c.fail(f"tensor_parallel_size {size} needs the target as a checkpoint directory, a Hugging Face causal LM "
               f"or a builder (each rank makes its own shard), got {type(target).__name__}", TypeError)
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        c.fail(f"tensor_parallel_size {size} shards the fused Llama / Qwen2 / Qwen3 runner (model types "
               f"{list(SUPPORTED_MODEL_TYPES)}); a {model_type!r} target runs its own modeling code (the Hugging Face "
               "backend), which is not sharded: use tensor_parallel_size 1")


def is_builder(model) -> bool:
    """Whether ``model`` is a builder: a picklable function that makes the model where it runs --
    ``target(capture_layer_ids, tp=, device=)`` a ``TargetLM`` (this rank's shard), ``draft(device=)``
    a ``DSparkDraftModel`` (benchmarks' random models, which no rank could receive whole)."""
    return callable(model) and not isinstance(model, torch.nn.Module)


def load_models(c: Checker, target, draft, config, tp=None):
    """(TargetLM, draft model or None, EOS ids) from directories, loaded models or builders
    (``is_builder``); under tensor parallelism (``tp``: a ``TensorParallel`` of size > 1) the target
    is rank ``tp``'s shard and a loaded draft is copied to this rank's device."""
    from ..model import check_target_compatible, load_draft
    from ..model.hf_target import HFTarget
    from ..model.llama import SUPPORTED_MODEL_TYPES, TargetLM
    from ..model.parallel import SINGLE_RANK

    tp = tp or SINGLE_RANK
    if not (isinstance(target, TargetLM) and target.tp == tp):  # this rank's shard already (a rank's second engine)
        check_parallel_target(c, target, tp.size)
    device = torch.device(config.device) if config.device is not None else None
    # where a target directory loads: the device asked for, else a loaded draft's, else the CPU (load_draft's)
    dev = device or (draft.device if isinstance(draft, torch.nn.Module) else torch.device("cpu"))
    dtype = config.dtype
    if isinstance(target, (str, Path)):
        check_target_checkpoint(target)  # missing, a file, pickle-only, truncated: said before any loader runs
        if dtype is None:  # the CLI's --dtype auto: float32 on a CPU, the checkpoint's half precision on a GPU
            dtype = default_dtype(dev, target)
    draft_model = draft
    if is_builder(draft):
        draft_model = draft(device=dev)
    elif isinstance(draft, (str, Path)):  # weights a speculators 0.9 draft leaves out come from the target
        draft_model = load_draft(draft, target=target if isinstance(target, (str, Path, torch.nn.Module)) else None,
                                 device=device, dtype=dtype)
    capture = list(draft_model.config.capture_layer_ids) if draft_model is not None else []
    # TargetLM: the fused forward of the families it knows; any other causal LM runs its own
    # modeling code through the same runner contract (HFTarget)
    if isinstance(target, (str, Path)):
        if tp.size > 1:  # this rank's slices of the checkpoint
            lm = TargetLM.from_pretrained(target, capture, device=dev, dtype=dtype, tp=tp)
        else:
            runner = TargetLM if _model_type(Path(target)) in SUPPORTED_MODEL_TYPES else HFTarget
            lm = runner.from_pretrained(target, capture, device=dev, dtype=dtype)
        eos = frozenset(_directory_eos(Path(target)) or _config_eos(lm.config))
    elif is_builder(target):
        lm = target(capture, tp=tp, device=dev)
        eos = frozenset(_config_eos(lm.config))
    elif isinstance(target, torch.nn.Module):
        fused = getattr(target.config, "model_type", None) in SUPPORTED_MODEL_TYPES
        if tp.size > 1:  # this rank's slices on this rank's device
            lm = TargetLM.from_hf_model(target, capture, tp=tp, device=device)
        else:
            lm = TargetLM.from_hf_model(target, capture) if fused else HFTarget(target, capture)
        eos = frozenset(eos_token_ids(target))
    elif isinstance(target, TargetLM):  # another engine's runner (same weights); EOS ids set by the caller
        lm = TargetLM(target.config, dict(embed=target.embed, layers=target.layers, norm=target.norm,
                                          lm_head=target.lm_head), capture, tp=target.tp)
        eos = frozenset(_config_eos(target.config))
    elif isinstance(target, HFTarget):
        lm = HFTarget(target.model, capture)
        eos = frozenset(_config_eos(target.config))
    else:
        c.fail(f"target must be a checkpoint directory or a Hugging Face causal LM, got {type(target).__name__}", TypeError)
    if draft_model is not None:
        if tp.rank > 0 and draft_model.device != lm.device:  # rank 0's loaded draft, unpickled here
            draft_model = draft_model.to(lm.device)
        check_target_compatible(draft_model.config, lm.config)
        if draft_model.device != lm.device:
            c.fail(f"the draft is on {draft_model.device} but the target on {lm.device}")
    return lm, draft_model, eos


def _model_type(path: Path) -> str | None:
    """``model_type`` of a checkpoint directory's config.json (None when it has none: the loader
    then reports the directory)."""
    from ..model.checkpoint import read_json_object

    if not (path / "config.json").is_file():
        return None
    config = read_json_object(path / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get("model_type") or config.get("model_type")


def _config_eos(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _directory_eos(path: Path) -> list[int]:
    """EOS ids of ``generation_config.json`` (what transformers' generate would stop on)."""
    import json

    file = path / "generation_config.json"
    if not file.is_file():
        return []
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except ValueError:
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
