"""The options every command shares (``dspark.cli._runtime``): stop-string escapes, scheduler
names, checkpoint names -- local directories, Hugging Face Hub names from a fake cache (never the
network), the demo pair by default -- and the file modes of written checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from model_cases import write_tiny_checkpoints

import dspark
from dspark.cli import _runtime

SRC = str(Path(dspark.__file__).parent.parent)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("given, expected", [
    ("\\n\\n", "\n\n"), ("a\\tb\\r", "a\tb\r"), ("\\\\n", "\\n"), ('\\"', '"'), ("\\'", "'"),
    ("\\x41\\u00e9\\u4e2d", "A\u00e9\u4e2d"), ("\\q", "\\q"), ("end\\", "end\\"), ("plain", "plain"),
])
def test_process_escapes(given, expected):
    assert _runtime.process_escapes(given) == expected


@pytest.mark.parametrize("given, message", [
    ("\\x4", r"\\x must be followed by 2 hex digits, got '\\\\x4'"),
    ("\\u12G4", r"\\u must be followed by 4 hex digits, got '\\\\u12G4'"),
])
def test_bad_hex_escapes_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        _runtime.process_escapes(given)
    with pytest.raises(argparse.ArgumentTypeError, match="a stop string must not be empty"):
        _runtime.stop_string("")


def test_scheduler_choices_are_the_engines():
    from dspark.engine.config import ENGINE_SCHEDULERS, SCHEDULE_SIGNALS

    assert _runtime.SCHEDULER_CHOICES == ENGINE_SCHEDULERS
    assert _runtime.SCHEDULE_SIGNALS == SCHEDULE_SIGNALS


def test_the_online_signal_needs_a_scheduler_that_reads_it():
    parser = argparse.ArgumentParser()
    _runtime.add_scheduler_arguments(parser)
    for argv in (["--schedule-signal", "online"], ["--schedule-signal", "online", "--scheduler", "sps", "--draft-top-k", "2"]):
        with pytest.raises(ValueError, match="--schedule-signal online needs --scheduler threshold, sps or cost"):
            _runtime.check_scheduler_arguments(parser.parse_args(argv))
    _runtime.check_scheduler_arguments(parser.parse_args(["--schedule-signal", "online", "--scheduler", "sps"]))


def _cache(root: Path, repos: dict[str, Path]) -> Path:
    """A Hugging Face Hub cache (``models--OWNER--NAME/refs/main`` + ``snapshots/COMMIT/``) holding
    a copy of each directory under its repo id."""
    cache = root / "hub"
    for repo, directory in repos.items():
        entry = cache / f"models--{repo.replace('/', '--')}"
        (entry / "refs").mkdir(parents=True)
        (entry / "refs" / "main").write_text(COMMIT)
        shutil.copytree(directory, entry / "snapshots" / COMMIT)
    return cache


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache directory holding tiny/target and tiny/draft, the local directories they copy)."""
    root = tmp_path_factory.mktemp("hub")
    _, drafts = write_tiny_checkpoints(root)
    cache = _cache(root, {"tiny/target": root / "target", "tiny/draft": Path(drafts["speculators"])})
    return cache, root


@pytest.fixture
def offline_cache(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub[0]


def test_hub_names_resolve_from_the_cache(offline_cache, tmp_path):
    snapshot = offline_cache / "models--tiny--target" / "snapshots" / COMMIT
    assert Path(_runtime.resolve_checkpoint("tiny/target", "--target")) == snapshot
    assert _runtime.resolve_checkpoint(str(tmp_path), "--draft") == str(tmp_path)  # a local directory wins
    assert _runtime.resolve_checkpoint("./not/here", "--draft") == "not/here"  # a path, not a Hub id: as given
    assert _runtime.resolve_checkpoint(None, "--draft") is None
    with pytest.raises(ValueError) as error:
        _runtime.resolve_checkpoint("Qwen/Qwen3-0.6B", "--target")
    message = str(error.value)
    assert message.startswith("--target Qwen/Qwen3-0.6B is not a local directory, nor a Hugging Face Hub model "
                              f"in the cache ({offline_cache})")
    assert "HF_HUB_OFFLINE=1" in message and "hf download Qwen/Qwen3-0.6B" in message and "\n" not in message


def test_hub_names_not_cached_are_downloaded_when_online(offline_cache, monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []
    real = huggingface_hub.snapshot_download

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)  # the cache lookup itself: a miss for an uncached name
        if repo_id == "gone/model":  # what a missing network raises, on two lines
            raise ConnectionError("Connection refused.\nMax retries exceeded")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert _runtime.resolve_checkpoint("org/model", "--draft", allow_pickle=True) == str(tmp_path)
    assert calls[0] == ("org/model", {"local_files_only": True})
    assert calls[1][0] == "org/model" and "*.safetensors" in calls[1][1]["allow_patterns"]
    assert "*.bin" in calls[1][1]["allow_patterns"]  # pickled weights only when allowed
    with pytest.raises(ValueError, match=r"^--draft gone/model is not a local directory, and downloading it from the "
                                         r"Hugging Face Hub failed \(ConnectionError: Connection refused.\)"):
        _runtime.resolve_checkpoint("gone/model", "--draft")


def _namespace(**values):
    return argparse.Namespace(**{"target": None, "draft": None, "allow_pickle": False, **values})


def test_resolve_pair_defaults_to_the_demo_pair_and_refuses_half_a_pair(offline_cache):
    from dspark.training.data import demo_pair

    pair = demo_pair()
    args = _namespace()
    _runtime.resolve_pair(args)
    assert (args.target, args.draft, args.target_name) == (str(pair.target), str(pair.draft), str(pair.target))
    args = _namespace()
    _runtime.resolve_pair(args, drafts="several")
    assert args.draft == [str(pair.draft)]
    args = _namespace(target="tiny/target", draft=["tiny/draft"])
    _runtime.resolve_pair(args, drafts="several")
    assert args.target_name == "tiny/target" and args.draft[0].endswith(f"models--tiny--draft/snapshots/{COMMIT}")
    for values, options, message in [
        (dict(draft="tiny/draft"), {}, "--draft needs --target"),
        (dict(target="tiny/target"), {}, r"--target needs --draft, a DSpark draft trained for it \(or neither"),
        (dict(target="tiny/target"), dict(no_draft=False), "or --no-draft for plain decoding"),
        (dict(target="tiny/target", draft="tiny/draft"), dict(no_draft=True), "--no-draft and --draft exclude"),
    ]:
        with pytest.raises(ValueError, match=message):
            _runtime.resolve_pair(_namespace(**values), **options)


def _draft_naming(source: Path, directory: Path, verifier: str) -> Path:
    """A copy of the speculators draft ``source`` in ``directory`` whose config names ``verifier``."""
    draft = shutil.copytree(source, directory)
    config = json.loads((draft / "config.json").read_text())
    config["speculators_config"]["verifier"] = {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]}
    (draft / "config.json").write_text(json.dumps(config))
    return draft


def test_a_draft_alone_takes_the_verifier_its_config_names(hub, offline_cache, tmp_path, monkeypatch):
    """``--draft D`` without ``--target``: the verifier of D's config (speculators_config.verifier.
    name_or_path) -- an absolute directory, one relative to the draft (or beside it, as peers lay
    drafts out), a Hub id from the local cache; a missing one or none is an error naming what to do."""
    _, root = hub
    source, target, snapshot = root / "speculators", str(root / "target"), offline_cache / "models--tiny--target"
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "target").symlink_to(target)
    monkeypatch.chdir(tmp_path / "drafts")
    for i, (verifier, directory, name) in enumerate([
            (target, target, target), ("target", str(tmp_path / "drafts" / "target"), None),
            ("tiny/target", str(snapshot / "snapshots" / COMMIT), "tiny/target")]):
        draft = _draft_naming(source, tmp_path / "drafts" / f"d{i}", verifier)
        args = _namespace(draft=str(draft))
        _runtime.resolve_pair(args)
        assert (args.target, args.draft, args.target_name) == (directory, str(draft), name or directory), verifier
    missing = _draft_naming(source, tmp_path / "missing", "nowhere/model")
    with pytest.raises(ValueError) as error:
        _runtime.resolve_pair(_namespace(draft=str(missing)))
    assert str(error.value) == (
        f"--draft {missing} names its verifier 'nowhere/model' (speculators_config.verifier.name_or_path), but it "
        f"is not a directory (looked in {missing / 'nowhere/model'}, {tmp_path / 'nowhere/model'}, "
        f"{tmp_path / 'drafts' / 'nowhere/model'}), nor a Hugging Face Hub model in the local cache "
        f"({offline_cache}): give --target, the model it drafts for")
    with pytest.raises(ValueError, match="the drafts name different verifiers"):
        _runtime.resolve_pair(_namespace(draft=[str(tmp_path / "drafts" / "d0"), str(tmp_path / "drafts" / "d2")]),
                              drafts="several")
    with pytest.raises(ValueError, match=r"--draft needs --target: --draft \S+ names no verifier in its config.json"):
        _runtime.resolve_pair(_namespace(draft=str(source)))


def _env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_commands_take_hub_names_from_the_cache(hub, tmp_path):
    """``dspark generate`` / ``profile`` with Hub names (HF_HUB_CACHE, offline) run as with the
    directories; an uncached name is one line naming the flag, no traceback. (The three commands are
    processes forked from one that imported torch and dspark under this environment: ``forking``.)"""
    from forking import Forker

    cache, root = hub
    forker = Forker(Path.cwd(), tmp_path, _env(cache))
    try:
        common = ["--device", "cpu", "--quiet"]
        generate = ["-m", "dspark", "generate", "--target", "tiny/target", "--draft", "tiny/draft",
                    "--prompt-ids", "3,17,42", "--max-new-tokens", "6", "--json", *common]
        done = forker.run(generate, timeout=300)
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["generated_ids"]) == 6
        profile = ["-m", "dspark", "profile", "--target", "tiny/target", "--draft", "tiny/draft",
                   "--max-tokens", "2", "--context", "4", "--out", str(tmp_path / "cost.json"), *common]
        done = forker.run(profile, timeout=300)
        assert done.returncode == 0, done.stderr
        table = json.loads((tmp_path / "cost.json").read_text())
        assert table["target"] == "tiny/target" and table["draft_rows"] == [1] and table["draft_time_ms"][0] > 0
        assert table["decode_rows"] == [1] and table["decode_time_ms"][0] > 0 and table["tokens_per_row"] == 8
        missing = [*generate[:3], "--target", "nobody/nothing", "--draft", "tiny/draft", *generate[7:]]
        done = forker.run(missing, timeout=300)
    finally:
        forker.close()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("dspark generate: --target nobody/nothing is not a local directory, nor a "
                                          "Hugging Face Hub model in the cache")
    assert len(done.stderr.strip().splitlines()) == 1


def test_written_checkpoints_are_readable_by_all(tmp_path):
    """safetensors writes 0600; our files get the mode of any new file (0666 less the umask)."""
    from model_cases import tiny_qwen3_target, write_tiny_draft

    from dspark.model.safetensors_io import save_tensors
    from dspark.training.state import LoopState, write_training_state

    old = os.umask(0o022)
    try:
        save_tensors({"x": torch.zeros(2)}, tmp_path / "x.safetensors")
        directory = Path(write_tiny_draft(tiny_qwen3_target(), tmp_path / "draft", format="speculators"))
        write_training_state(tmp_path / "draft", {"w": torch.ones(2)}, {"state": {}, "param_groups": []},
                             LoopState.fresh(0), {"options": {}})
        files = [tmp_path / "x.safetensors", directory / "model.safetensors", directory / "config.json",
                 directory / "training_state" / "state.safetensors", directory / "training_state" / "state.json"]
        assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o644" for f in files}
        os.umask(0o027)
        save_tensors({"x": torch.zeros(2)}, tmp_path / "y.safetensors")
        assert (tmp_path / "y.safetensors").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_serve_passes_its_draft_candidates_to_the_engine(monkeypatch):
    """``dspark serve --draft-candidates C --draft-successors M`` reach the engine's config (the
    engine factory sees them), and a negative one is refused naming the flag."""
    from dspark.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    seen = []

    class Built(Exception):
        pass

    def factory(config):
        seen.append(config)
        raise Built

    monkeypatch.setattr(serve, "_factory", lambda spec: factory)
    args = parser.parse_args(["--engine-factory", "x:y", "--draft-candidates", "64", "--draft-successors", "8",
                              "--device", "cpu"])
    with pytest.raises(Built):
        serve.build_engine(args)
    assert (seen[0].draft_candidates, seen[0].draft_successors) == (64, 8)
    with pytest.raises(ValueError, match="--draft-candidates must be >= 0"):
        serve._check(parser.parse_args(["--engine-factory", "x:y", "--draft-candidates", "-1"]))
