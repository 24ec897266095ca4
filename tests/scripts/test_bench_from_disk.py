"""scripts/benchmarks/bench_from_disk.py --replan: the 3B case's prediction made again from the plan, the measurement kept
(no model written or calibrated)."""

from __future__ import annotations

import json

import pytest

from file_modules import import_file

bench = import_file("scripts/benchmarks/bench_from_disk.py")


def test_replan_predicts_the_3b_case_again_and_keeps_what_was_measured(tmp_path):
    measured = {"case": "llama3b", "peak_mb": 2760, "kept_in_memory": 2**20, "predicted_mb": 1}
    (tmp_path / "results.json").write_text(json.dumps({"cases": [{"case": "equal"}, measured]}))
    assert bench.main(["--out", str(tmp_path), "--replan"]) == 0
    equal, llama3b = json.loads((tmp_path / "results.json").read_text())["cases"]
    assert equal == {"case": "equal"}
    assert llama3b["peak_mb"] == 2760
    assert llama3b["predicted_mb"] == bench.predicted_mb(2**20) == bench.predicted_mb(0) + 1 > 1
    assert llama3b["predicted_over_measured"] == round(llama3b["predicted_mb"] / 2760, 3)


def test_replan_without_results_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--replan"])
    assert "run the benchmark into" in capsys.readouterr().err
