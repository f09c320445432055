"""Every command runs without --target / --draft: the demo pair shipped with the package (eval,
calibrate, train here; generate, profile and serve in their own tests) -- and never changes it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dspark.cli import main
from dspark.model import load_draft
from dspark.training.data import demo_pair


def _digest(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir()) if f.is_file()}


def test_eval_defaults_to_the_demo_pair_and_takes_the_cost_scheduler(tmp_path, capsys):
    from dspark.engine import SPSCostTable

    pair = demo_pair()
    table = tmp_path / "cost.json"
    SPSCostTable((1, 8, 64), (1.0, 1.1, 2.0)).write_json(table)
    common = ["eval", "--prompts", str(pair.prompts), "--num-prompts", "1", "--max-new-tokens", "8", "--device", "cpu",
              "--quiet"]
    assert main([*common, "--json", str(tmp_path / "off.json")]) == 0
    assert main([*common, "--scheduler", "cost", "--cost-table", str(table),  # auto on the CPU: reference
                 "--json", str(tmp_path / "cost.json.report")]) == 0
    for name in ("off.json", "cost.json.report"):
        report = json.loads((tmp_path / name).read_text())
        assert report["target"] == str(pair.target) and report["drafts"][0]["identical"] == 1  # greedy: lossless
    assert main([*common, "--target", str(pair.target)]) == 2
    assert "--target needs --draft" in capsys.readouterr().err


def test_calibrate_defaults_to_the_demo_pair_and_writes_only_a_copy(tmp_path, capsys):
    pair = demo_pair()
    before = _digest(pair.draft)
    common = ["calibrate", "--data", "stdlib:valid", "--num-prompts", "2", "--prompt-tokens", "16", "--new-tokens", "8",
              "--device", "cpu", "--quiet"]
    assert main(common) == 0
    assert "left as it is; pass --output DIR to write a calibrated copy" in capsys.readouterr().out
    assert main([*common, "--output", str(tmp_path / "calibrated")]) == 0
    assert f"wrote {tmp_path / 'calibrated' / 'dspark_calibration.json'}" in capsys.readouterr().out
    assert _digest(pair.draft) == before  # the shipped draft is untouched
    temperatures = json.loads((tmp_path / "calibrated" / "dspark_calibration.json").read_text())["sts_temperatures"]
    assert load_draft(tmp_path / "calibrated").config.sts_temperatures == temperatures
    assert main([*common, "--output", str(tmp_path / "calibrated")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_train_defaults_to_the_demo_target(tmp_path, capsys):
    pair = demo_pair()
    assert main(["train", "--output", str(tmp_path / "draft"), "--max-docs", "2", "--steps", "2", "--batch-size", "1",
                 "--seq-len", "32", "--anchors", "2", "--block-size", "3", "--markov-rank", "4", "--device", "cpu",
                 "--quiet"]) == 0
    assert "corpus stdlib:train: 2 documents" in capsys.readouterr().out
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(pair.target)
