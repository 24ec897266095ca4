"""scripts/benchmarks/bench_first_step.py: bad input refused before any launch; the ratios are of the budgets' medians."""

from __future__ import annotations

import pytest

from file_modules import import_file

bench = import_file("scripts/benchmarks/bench_first_step.py")


def test_a_filled_output_or_a_missing_config_is_refused_before_any_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "launch", lambda *a: pytest.fail("launched"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "first_step.jsonl").write_text("{}\n")
    for argv, message in ((["--out", str(tmp_path / "out")], "is not empty"),
                          (["--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "new")], "no such file")):
        with pytest.raises(SystemExit) as exit:
            bench.main(argv)
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert (tmp_path / "out" / "first_step.jsonl").read_text() == "{}\n"


def test_budgets_alternate_and_the_ratios_are_of_medians(tmp_path, monkeypatch, capsys):
    seconds = iter([10.0, 11.0, 30.0, 12.0, 10.0, 13.0])  # a slow first launch of the small budget: an outlier
    order = []

    def launch(args, budget, out):
        order.append((budget, out.name))
        return {"train_tokens": budget, "first_step_s": next(seconds), "peak_rss_mib": 100, "steps_taken": 1}

    monkeypatch.setattr(bench, "launch", launch)
    bench.main(["--budgets", "64", "6400", "--repeats", "3", "--out", str(tmp_path / "out")])
    assert order == [(64, "tokens-64-0"), (6400, "tokens-6400-0"), (64, "tokens-64-1"), (6400, "tokens-6400-1"),
                     (64, "tokens-64-2"), (6400, "tokens-6400-2")]
    assert "first step x1.200, peak memory x1.000" in capsys.readouterr().out  # median 12 over median 10
    assert len((tmp_path / "out" / "first_step.jsonl").read_text().splitlines()) == 6
