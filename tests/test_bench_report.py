"""``dspark.bench.report``: markdown tables printed from a benchmark JSON; ``dspark.bench.engine
--backends`` on the CPU (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from dspark.bench import engine, report
from dspark.bench.common import row


def test_tables_group_rows_by_kernel_with_their_ratios(tmp_path, capsys):
    rows = [row("step", "triton", dict(B=b, V=10, R=4), us, 4000, 4000.0, reference_us=2 * us, target="fast")
            for b, us in ((1, 2.0), (8, 4.0))]
    rows[0]["ratio_to_w2_read"] = 1.5
    rows.append(row("accept", "triton", dict(B=1, V=10), 1.0, 8000, 4000.0, compiled_us=3.0))
    data = {"device": "GPU", "torch": "2.11", "copy_ceiling_gb_per_s": 4000.0, "results": rows}
    text = report.tables(data)
    assert text.count("### ") == 2 and "Target: fast." in text
    assert "| B=1, R=4 | 2 | 2 | 0.1 | 4 (2×) | – | 1.5 |" in text
    assert "| B=8, R=4 | 4 | 1 | 0 | 8 (2×) | – |  |" in text
    assert "| B=1 | 1 | 8 | 0.2 | – | 3 (3×) |" in text
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    assert report.main([str(path)]) == 0 and "### accept" in capsys.readouterr().out
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_backend_comparison_runs_on_the_cpu(tmp_path, capsys):
    """``--backends fused,hf --device cpu --shapes tiny``: every backend, mode and batch size in
    ``backends.json`` and the printed table, both backends' tokens the same (fp32); bad flags are
    errors naming them."""
    assert engine.main(["--backends", "fused,hf", "--device", "cpu", "--shapes", "tiny", "--batches", "2",
                        "--prompt", "8", "--new", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "backends.json").read_text())["shapes"][0]["rows"]
    assert [(r["backend"], r["mode"], r["batch"]) for r in rows] == [
        ("fused", "plain", 2), ("fused", "dspark", 2), ("hf", "plain", 2), ("hf", "dspark", 2)]
    assert all(r["same_tokens_as_first"] == 2 and r["step_ms"] > 0 and not r["uncapturable"] for r in rows)
    assert "| mode | B | fused | hf | hf / fused |" in capsys.readouterr().out
    for flags, name in ((["--backends", "fused,vllm"], "--backends"), (["--device", "cpu"], "--device"),
                        (["--shapes", "tiny"], "--shapes")):
        with pytest.raises(SystemExit) as error:
            engine.main(flags + ["--out", str(tmp_path)])
        assert error.value.code == 2 and name in capsys.readouterr().err, name
