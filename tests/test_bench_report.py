"""``dspark.bench.report``: markdown tables printed from a benchmark JSON (no GPU needed)."""

from __future__ import annotations

import json

from dspark.bench import report
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
