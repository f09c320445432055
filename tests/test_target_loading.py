"""Checked loading of target checkpoints (``load_target_model``), the safetensors checks the draft
loader shares (``dspark.model.safetensors_io``), and ``resolve_device``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_cases import tiny_qwen3_target, write_tiny_draft
from safetensors.torch import load_file, save_file

from dspark.engine import load_target_model, resolve_device
from dspark.model import load_draft


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    model = tiny_qwen3_target()
    model.save_pretrained(root / "good")
    return root, model


def _variant(saved, tmp_path, edit):
    """A copy of the saved target with ``edit(directory, tensors)`` applied to its weights."""
    root, _ = saved
    directory = shutil.copytree(root / "good", tmp_path / "variant")
    tensors = load_file(str(directory / "model.safetensors"))
    edit(directory, tensors)
    return directory


def _rewrite(directory, tensors):
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_a_good_checkpoint_loads_with_its_weights(saved):
    root, model = saved
    loaded = load_target_model(root / "good", dtype=torch.float32)
    assert not loaded.training
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_paths_that_are_not_checkpoint_directories(saved, tmp_path):
    root, _ = saved
    with pytest.raises(ValueError, match=r"load_target: target directory '.*nowhere' does not exist"):
        load_target_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"load_target: target path '.*config.json' is a file; give its checkpoint directory"):
        load_target_model(root / "good" / "config.json")
    with pytest.raises(ValueError, match="no config.json in"):
        load_target_model(tmp_path)
    with pytest.raises(TypeError, match="path must be a checkpoint directory"):
        load_target_model(3)


def test_missing_and_misshaped_tensors_are_refused(saved, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    missing = _variant(saved, tmp_path, lambda d, t: (t.pop(name), _rewrite(d, t)))
    with pytest.raises(ValueError, match=f"lacks tensor '{name}': refusing to run with randomly initialised weights"):
        load_target_model(missing)
    shutil.rmtree(missing)
    misshaped = _variant(saved, tmp_path, lambda d, t: (t.update({name: torch.zeros(3, 3)}), _rewrite(d, t)))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[3, 3\] in .*, the config needs \[64, 32\]"):
        load_target_model(misshaped)


def test_truncated_and_corrupt_files_name_the_file(saved, tmp_path):
    def truncate(directory, _tensors):
        data = (directory / "model.safetensors").read_bytes()
        (directory / "model.safetensors").write_bytes(data[: len(data) // 2])

    truncated = _variant(saved, tmp_path, truncate)
    with pytest.raises(ValueError, match=r"model.safetensors' is truncated: its header describes \d+ bytes, the file has \d+"):
        load_target_model(truncated)
    (truncated / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="is not a safetensors file, or is truncated"):
        load_target_model(truncated)


def test_sharded_index_problems(saved, tmp_path):
    def shard(directory, tensors):
        names = sorted(tensors)
        halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
        (directory / "model.safetensors").unlink()
        weight_map = {n: file for file, part in halves.items() for n in part}
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))

    sharded = _variant(saved, tmp_path, shard)
    _, model = saved
    torch.testing.assert_close(load_target_model(sharded).lm_head.weight, model.lm_head.weight)
    (sharded / "b.safetensors").unlink()
    with pytest.raises(ValueError, match=r"names shard\(s\) \['b.safetensors'\] that are not in the directory"):
        load_target_model(sharded)


def test_pickle_only_targets_need_an_explicit_opt_in(saved, tmp_path):
    def to_pickle(directory, tensors):
        (directory / "model.safetensors").unlink()
        torch.save(tensors, directory / "pytorch_model.bin")

    pickled = _variant(saved, tmp_path, to_pickle)
    with pytest.raises(ValueError, match=r"safetensors only; refusing to unpickle \['pytorch_model.bin'\].*allow_pickle=True"):
        load_target_model(pickled)
    _, model = saved
    loaded = load_target_model(pickled, allow_pickle=True)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_a_truncated_draft_names_the_file(saved, tmp_path):
    _, model = saved
    directory = write_tiny_draft(model, tmp_path / "draft", format="speculators")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"load_draft: '.*model.safetensors' is truncated"):
        load_draft(directory)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"--device: 'bogus' is not a device: use cpu, cuda or cuda:N"):
        resolve_device("bogus", name="--device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' asked for, but CUDA is not available on this machine"):
            resolve_device("cuda")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
