"""Resumable training state: where a run is, and everything needed to continue it exactly.

A draft checkpoint directory written by ``dspark train`` holds the speculators checkpoint
(``config.json`` + ``model.safetensors``, what vLLM and ``dspark generate`` load) and a
``training_state/`` subdirectory (outside the top-level ``*.safetensors`` that loaders read):

* ``state.safetensors`` -- the fp32 weights (``model/<name>``), the optimizer state
  (``optimizer/<parameter>/<key>``), the random generators (``generator/<name>``) and the rest of
  the current epoch's data order (``data/order``); safetensors, never pickle;
* ``state.json`` -- the step, the seconds trained, the optimizer's parameter groups and the
  run's *fingerprint* (options, data shape, draft shape): ``--resume`` refuses a different run.

The states are full (not sharded), gathered to rank 0 and written by it alone, so a run may resume
on another number of processes; every rank reads them back (on several nodes the output directory
must be on a filesystem they share).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..kernels._validate import Checker

__all__ = ["STATE_DIR", "LoopState", "ResumeState", "gather_state", "write_training_state", "read_training_state",
           "load_optimizer_state"]

STATE_DIR = "training_state"
_TENSORS, _JSON = "state.safetensors", "state.json"


@dataclass
class LoopState:
    """Where a run is: ``step`` steps taken, ``elapsed`` seconds trained, its random generators
    (``"data"``: the epoch orders; others for the caller) and ``order``, the global row indices
    of the current epoch not yet used (int64)."""

    step: int = 0
    elapsed: float = 0.0
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    order: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @classmethod
    def fresh(cls, seed: int, names: tuple[str, ...] = ("data",)) -> LoopState:
        """A new run: generator ``names[i]`` seeded with ``seed + i``."""
        return cls(generators={name: torch.Generator().manual_seed(seed + i) for i, name in enumerate(names)})


@dataclass
class ResumeState:
    """A training state read back: the fp32 model state (the draft's names), the full optimizer
    state (``get_optimizer_state_dict`` layout), the loop state and the run's fingerprint."""

    model: dict[str, torch.Tensor]
    optimizer: dict
    loop: LoopState
    fingerprint: dict


def gather_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full CPU model and optimizer state dicts of a plain, DDP or FSDP2 ``module`` on rank 0
    (a collective under FSDP: every rank calls it; other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options), get_optimizer_state_dict(module, optimizer, options=options)


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimizer state (from ``read_training_state``) into the optimizer of a plain,
    DDP or FSDP2 ``module`` (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def write_training_state(directory, model_state: dict[str, torch.Tensor], optimizer_state: dict, loop: LoopState,
                         fingerprint: dict) -> Path:
    """Write ``directory/training_state/`` (see the module docstring). Each file is written under
    a temporary name and renamed, the JSON last, so an interrupted write leaves the previous state."""
    directory = Path(directory) / STATE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"model/{name}": t.float() if t.is_floating_point() else t for name, t in model_state.items()}
    for parameter, values in optimizer_state["state"].items():
        tensors.update({f"optimizer/{parameter}/{key}": torch.as_tensor(v) for key, v in values.items()})
    tensors.update({f"generator/{name}": g.get_state() for name, g in loop.generators.items()})
    tensors["data/order"] = loop.order
    meta = {"step": loop.step, "elapsed": loop.elapsed, "param_groups": optimizer_state["param_groups"],
            "fingerprint": fingerprint}
    from ..model.safetensors_io import save_tensors

    _replace(directory / _TENSORS, lambda tmp: save_tensors({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                                         metadata={"step": str(loop.step)}))
    _replace(directory / _JSON, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1) + "\n"))
    return directory


def _replace(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


_MISSING = object()  # a fingerprint entry the saved run did not have


def _leaves(tree: dict, prefix: str = "") -> dict:
    """``{path: value}`` of a nested fingerprint's leaves; the ``options`` group is left out of the
    paths, so that a training option reads as its name (``lr``, not ``options.lr``)."""
    leaves = {}
    for key, value in tree.items():
        path = key if prefix in ("", "options.") else prefix + key
        if isinstance(value, dict):
            leaves.update(_leaves(value, path + "."))
        else:
            leaves[path] = value
    return leaves


def _shown(value) -> str:
    return "(none)" if value is _MISSING else repr(value)


def read_training_state(directory, fingerprint: dict) -> ResumeState:
    """Read ``directory/training_state/``; ValueError when it is missing, torn, or from a run whose
    fingerprint differs from ``fingerprint``: only the differing entries are named, each by its
    path (``lr``, ``draft.block_size``) with its saved and given values. Entries saved but absent
    from ``fingerprint`` are not compared (what a caller may change on resuming, e.g. the steps)."""
    from safetensors import safe_open

    c = Checker("resume")
    directory = Path(directory) / STATE_DIR
    if not (directory / _JSON).is_file() or not (directory / _TENSORS).is_file():
        c.fail(f"no training state in {str(directory)!r} to resume from (written with the checkpoints: "
               f"--save-every steps and at the end)")
    meta = json.loads((directory / _JSON).read_text())
    saved, given = _leaves(meta["fingerprint"]), _leaves(json.loads(json.dumps(fingerprint)))  # tuples as lists
    differ = [key for key, value in given.items() if saved.get(key, _MISSING) != value]
    if differ:
        listed = "; ".join(f"{key}: saved {_shown(saved.get(key, _MISSING))}, given {_shown(given[key])}"
                           for key in differ)
        c.fail(f"the training state in {str(directory)!r} is from a different run ({listed})")
    with safe_open(str(directory / _TENSORS), framework="pt") as f:
        if f.metadata().get("step") != str(meta["step"]):
            c.fail(f"{str(directory)!r} is torn: {_TENSORS} is from step {f.metadata().get('step')}, "
                   f"{_JSON} from step {meta['step']}")
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    model, state, generators = {}, {}, {}
    for key, t in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "model":
            model[rest] = t
        elif kind == "optimizer":
            parameter, _, name = rest.rpartition("/")
            state.setdefault(parameter, {})[name] = t
        elif kind == "generator":
            generators[rest] = torch.Generator()
            generators[rest].set_state(t)
    loop = LoopState(meta["step"], meta["elapsed"], generators, tensors["data/order"])
    return ResumeState(model, {"state": state, "param_groups": meta["param_groups"]}, loop, meta["fingerprint"])
