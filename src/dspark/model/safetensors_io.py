"""Checked reading of safetensors checkpoint directories: every problem is an error naming the file.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
``dtype``, ``shape``, ``data_offsets``) and the data. ``read_header`` checks that all the data the
header describes is in the file, so a truncated download fails up front with the file's name rather
than deep inside a load. A directory's weights are ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` (``checkpoint_files``; every shard must exist and hold the tensors
the index assigns it). Pickled weights (``.bin`` / ``.pt`` / ``.pth``) are never read here:
``pickle_files`` names them so that callers can refuse them. ``save_tensors`` writes a file with the
permissions of any other file (safetensors alone leaves it private).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..kernels._validate import Checker

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "PICKLE_SUFFIXES", "read_header", "checkpoint_files",
           "checkpoint_shapes", "load_tensors", "pickle_files", "save_tensors", "normal_mode"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def read_header(c: Checker, file) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one safetensors ``file``; ValueError naming the file when it is
    missing, not safetensors, or shorter than its header says (truncated)."""
    file = Path(file)
    if not file.is_file():
        c.fail(f"weights file {str(file)!r} does not exist")
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
            c.fail(f"{str(file)!r} is not a safetensors file, or is truncated ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            c.fail(f"{str(file)!r} has a corrupt safetensors header")
    if not isinstance(header, dict):
        c.fail(f"{str(file)!r} has a corrupt safetensors header")
    header.pop("__metadata__", None)
    shapes, end = {}, 0
    for name, entry in header.items():
        try:
            shapes[name] = tuple(int(d) for d in entry["shape"])
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            c.fail(f"{str(file)!r} has a corrupt safetensors header entry for tensor {name!r}")
    if 8 + length + end > size:
        c.fail(f"{str(file)!r} is truncated: its header describes {8 + length + end} bytes, the file has {size}")
    return shapes


def checkpoint_files(c: Checker, directory, *, pickle_hint: str = "") -> list[Path]:
    """The safetensors files of a checkpoint ``directory``: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json``. ValueError when there is none (naming pickled files found
    instead, followed by ``pickle_hint``) or when a shard the index names is missing."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = _weight_map(c, index)
        files = [directory / shard for shard in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            c.fail(f"{str(index)!r} names shard(s) {missing} that are not in the directory")
        return files
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    pickled = pickle_files(directory)
    found = f"; refusing to unpickle {pickled}{pickle_hint}" if pickled else ""
    c.fail(f"no {WEIGHTS_NAME} (or {INDEX_NAME}) in {str(directory)!r}: safetensors only{found}")


def checkpoint_shapes(c: Checker, directory, *, pickle_hint: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over all safetensors files of ``directory`` (headers only, no data read);
    every file is checked by ``read_header``, and with an index every tensor it maps must be in its
    shard. ``pickle_hint``: as for ``checkpoint_files``."""
    directory = Path(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    by_file = {f: read_header(c, f) for f in checkpoint_files(c, directory, pickle_hint=pickle_hint)}
    for found in by_file.values():
        shapes.update(found)
    if (directory / INDEX_NAME).is_file():
        for name, shard in _weight_map(c, directory / INDEX_NAME).items():
            if name not in by_file[directory / shard]:
                c.fail(f"{INDEX_NAME} maps tensor {name!r} to {shard!r}, which does not hold it")
    return shapes


def load_tensors(c: Checker, directory) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint ``directory`` (CPU), after the ``checkpoint_shapes`` checks."""
    checkpoint_shapes(c, directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(c, directory):
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own SafetensorError (not a ValueError)
            c.fail(f"cannot read {str(file)!r}: {exc}")
    return tensors


def pickle_files(directory) -> list[str]:
    """Names of the pickled weight files (``.bin`` / ``.pt`` / ``.pth``) in ``directory``."""
    directory = Path(directory)
    return sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES) if directory.is_dir() else []


def _weight_map(c: Checker, index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        c.fail(f"{str(index)!r} is not a safetensors index (JSON with a 'weight_map')")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        c.fail(f"{str(index)!r}: 'weight_map' must map tensor names to shard file names")
    return weight_map


def save_tensors(tensors: dict[str, torch.Tensor], file, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, the file then given the mode a newly created file gets (0666 less
    the umask, 0644 by default): safetensors writes through a private temporary file (0600), which
    would leave a checkpoint unreadable to everyone else (a serving account, a shared cluster)."""
    save_file(tensors, str(file), metadata=metadata)
    normal_mode(file)


def normal_mode(file) -> None:
    """Give ``file`` the mode a newly created file gets (0666 less the umask): for safetensors
    files written by safetensors' ``save_file``, ours or transformers' ``save_pretrained``."""
    os.chmod(file, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask
