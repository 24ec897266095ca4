"""scripts/benchmarks/bench_recovery.py: the curve's plot, shared calibrated starts, refusal of bad input (no training)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from types import SimpleNamespace

import pytest

import hf_normswap
from file_modules import import_file
from hf_normswap.training import recipe_settings
from hf_normswap.training.run_dir import RECORD, WRITTEN_BY, check_run_dir, write_json
from tiny_models import tiny_model

bench = import_file("scripts/benchmarks/bench_recovery.py")


def test_plot_draws_every_series_from_the_json_lines(tmp_path):
    curve = tmp_path / "curve.jsonl"
    rows = [{"norm": norm, "method": method, "budget": t, "tokens": t, "ratio": 20.0 / (1 + t / 1000),
             "kl": 3.0 / (1 + t / 1000), "top1": 0.2 + t / 1e5}
            for norm in ("eln", "dyt") for method in ("logits", "layerwise+logits") for t in (0, 2048, 5120)]
    curve.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = bench.plot(curve, tmp_path / "curve.png")
    assert path.stat().st_size > 10_000


def test_curves_of_other_training_text_are_drawn_apart_and_against_cpu_hours(tmp_path):
    """One curve a norm, method and --set train_data, from this and compared directories; CPU-hours add up each
    launch's time (the calibrated start at 0); a curve with a launch of unknown time has none."""
    def rows(text, cpu):
        return [{"norm": "eln", "method": "config", "budget": t, "tokens": t, "ratio": 4.0 / (1 + t / 1e5),
                 "kl": 1.0, "top1": 0.5, "overrides": [f"train_data={text}"] if text else [],
                 **({"chunk_cpu_s": cpu} if t else {}), "other": {"data": "builtin:evaluation", "ratio": 5.0}}
                for t in (0, 102400, 256000)]
    sources = (("wiki", None), ("samples", "generated:batch_size=128"), ("mix", "[generated, /data/w.txt]"))
    for name, text in sources:
        (tmp_path / name).mkdir()
        (tmp_path / name / "curve.jsonl").write_text("\n".join(json.dumps(r) for r in rows(text, 1800.0)) + "\n")
    points = [p for name in ("wiki", "samples", "mix") for p in bench.read_points(tmp_path / name / "curve.jsonl")]
    curves = bench.series(points)
    assert sorted(curves) == [("eln", "config"), ("eln", "config [generated + w.txt]"),
                              ("eln", "config [generated:batch_size=128]")]
    assert bench.cpu_hours(curves["eln", "config"]) == [0.0, 0.5, 1.0]
    assert bench.cpu_hours([{"tokens": 0}, {"tokens": 5}]) is None
    bench.main(["--out", str(tmp_path / "wiki"), "--plot-only", "--compare", str(tmp_path / "samples"),
                str(tmp_path / "mix")])
    assert (tmp_path / "wiki" / "curve.png").stat().st_size > 10_000


def test_a_point_on_other_text_is_normswap_eval_of_its_checkpoint_as_the_recipe_evaluates(tmp_path, monkeypatch):
    """``--other-data``: the checkpoint scored against the config's original, on the final evaluation's tokens and
    window length."""
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        evaluation = {"tokens": 8192, "max_length": 512, "ratio": {"converted": 3.0}, "kl": {"converted": 1.1},
                      "top1_agreement": {"converted": 0.5}, "results": {"converted": {"token_perplexity": 45.0},
                                                                        "original": {"token_perplexity": 15.0}}}
        return subprocess.CompletedProcess(command, 0, json.dumps(evaluation), "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = argparse.Namespace(set=["final_eval.max_tokens=4096"], train_data="train.txt", eval_data="test.txt",
                              threads=1, schedule="constant_with_warmup", other_data="builtin:evaluation",
                              config=str(bench.ROOT / "recipes/configs/smollm2-eln.yaml"))
    point = bench.other_text(args, "eln", "config", tmp_path / "run", tmp_path / "run" / "final")
    assert point["data"] == "builtin:evaluation" and point["ratio"] == 3.0 and point["kl"] == 1.1
    command = calls[0]
    assert command[command.index("eval") + 1] == str(tmp_path / "run" / "final")
    assert [command[command.index(flag) + 1] for flag in ("--against", "--data", "--max-tokens", "--max-length")] == [
        "offline:smollm2", "builtin:evaluation", "4096", "512"]


def test_an_encoders_curve_is_its_embedding_agreement(tmp_path):
    """A sentence encoder's summary (hf_normswap.evaluation.embeddings) gives cosine / neighbours / rank correlation points,
    plotted on their own axes."""
    evaluation = {"data": "test.txt", "sentences": 266, "tokens": 8000, "reference": "original",
                  "results": {"converted": {"cosine": 0.96, "nearest_neighbour_agreement": 0.7, "spearman": 0.97}}}
    row = bench.point({"finetuned": evaluation}, "finetuned")
    assert row == {"cosine": 0.96, "neighbours": 0.7, "spearman": 0.97, "eval_sentences": 266, "eval_tokens": 8000}
    assert bench.describe(row) == "cosine 0.96, neighbours 0.7, spearman 0.97"
    curve = tmp_path / "curve.jsonl"
    rows = [{"norm": norm, "method": "config", "budget": t, "tokens": t, "cosine": 0.85 + t / 1e6,
             "neighbours": 0.5 + t / 1e6, "spearman": 0.9 + t / 1e6} for norm in ("eln", "dyt") for t in (0, 77000)]
    curve.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert bench.plot(curve, tmp_path / "curve.png").stat().st_size > 10_000


def test_the_start_of_a_run_is_its_calibrated_model_or_the_converted_checkpoint_it_was_given(tmp_path):
    """Budget 0 on ``--other-data`` scores where the run started: ``OUT/runs/RUN/calibrated`` when the recipe
    calibrates, the checkpoint itself when ``--set model=`` names a converted one (it has no calibrated/)."""
    converted = tmp_path / "converted"
    model = tiny_model("llama")
    hf_normswap.convert(model, to="dyt", calibration=None)
    hf_normswap.save_pretrained(model, converted)
    args = argparse.Namespace(set=[], train_data="train.txt", eval_data="test.txt", threads=1,
                              schedule="constant_with_warmup", config=str(bench.ROOT / "recipes/configs/smollm2-dyt.yaml"))
    run_dir = tmp_path / "runs" / "dyt-config"
    assert bench.start_checkpoint(args, "dyt", "config", run_dir) == run_dir / "calibrated"
    args.set = [f"model={converted}", "original=offline:smollm2"]
    assert bench.start_checkpoint(args, "dyt", "config", run_dir) == converted


def test_methods_with_the_same_calibration_share_the_calibrated_start(tmp_path):
    args = argparse.Namespace(set=["calibration.strategy=fast"])
    runs = tmp_path / "runs"
    (runs / "eln-logits" / "calibrated").mkdir(parents=True)
    (runs / "eln-logits" / "calibrated" / "config.json").write_text("{}")
    bench.share_calibration(args, "eln", "layerwise", runs / "eln-layerwise")
    assert os.path.samefile(runs / "eln-layerwise" / "calibrated" / "config.json",
                            runs / "eln-logits" / "calibrated" / "config.json")
    bench.share_calibration(args, "eln", "blockwise", runs / "eln-blockwise")  # its own calibration
    assert not (runs / "eln-blockwise" / "calibrated").exists()
    bench.share_calibration(args, "dyt", "layerwise", runs / "dyt-layerwise")  # another norm
    assert not (runs / "dyt-layerwise" / "calibrated").exists()


def test_a_run_per_budget_has_its_own_directory_and_shares_the_calibrated_start(tmp_path):
    args = argparse.Namespace(set=[], out=str(tmp_path), run_per_budget=True)
    first, second = (bench.run_directory(args, "eln", "config", b) for b in (77000, 308000))
    assert first.name == "eln-config-77000" and second.name == "eln-config-308000"
    (first / "calibrated").mkdir(parents=True)
    (first / "calibrated" / "config.json").write_text("{}")
    write_json(first / RECORD, {"written_by": WRITTEN_BY, "model": {"model": "m"}, "parameters": {}})
    bench.share_calibration(args, "eln", "config", second)
    assert not (second / "calibrated").is_symlink()  # hard links: the recipe refuses a link in its output_dir
    assert os.path.samefile(second / "calibrated" / "config.json", first / "calibrated" / "config.json")
    # with the record of the run it came from, the recipe takes the directory as its own
    check_run_dir(SimpleNamespace(output_dir=str(second), resume=False, model="offline:smollm2", original=None))
    bench.share_calibration(args, "eln", "blockwise", bench.run_directory(args, "eln", "blockwise", 77000))
    assert not (tmp_path / "runs" / "eln-blockwise-77000" / "calibrated").exists()  # its own calibration
    chunks = argparse.Namespace(out=str(tmp_path), run_per_budget=False)
    assert bench.run_directory(chunks, "eln", "config", 77000).name == "eln-config"


@pytest.mark.parametrize("setting, said", [(["--schedule", "cosine"], "--run-per-budget"),
                                           (["--methods", "norms+layerwise+taper"], "norms+layerwise+taper")])
def test_a_decaying_schedule_or_a_taper_over_several_budgets_needs_a_run_per_budget(tmp_path, capsys, setting, said):
    """Extending a cosine run changes its length and so the rate of the steps already taken; the taper falls over
    a share of the run's length: both refused at once."""
    data = tmp_path / "text.txt"
    data.write_text("text")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--train-data", str(data), "--eval-data", str(data), *setting,
                    "--budgets", "0", "1000", "2000", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_command_line_wins_over_the_methods_own_setting(tmp_path):
    """--set distill.hidden=30 measures the configs' method with that one setting changed, not silently without it."""
    args = argparse.Namespace(set=["distill.hidden=30", "calibration.block_steps=120"], train_data="train.txt",
                              eval_data="test.txt", threads=1, schedule="constant_with_warmup")
    overrides = bench.recipe_overrides(args, "eln", "blockwise-60x1+layerwise", 1024, tmp_path / "run")
    config = recipe_settings.load_config(["--config", str(bench.ROOT / "recipes/configs/smollm2-eln.yaml"), *overrides])
    assert config.distill.hidden == 30 and config.calibration.block_steps == 120
    assert "calibration.block_steps=120" in bench.calibration_settings(args, "blockwise-60x1+layerwise")


def test_missing_data_is_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--train-data", str(tmp_path / "absent.txt"), "--eval-data", str(tmp_path / "absent.txt"),
                    "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "--train-data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--train-data", "generated:batch_size=128", "--eval-data", "builtin:evaluation",
                    "--other-data", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err.splitlines()[-1]  # the original's samples need no file: only --other-data
    assert exit_info.value.code == 2 and "--other-data" in error and "--train-data" not in error
    with pytest.raises(SystemExit) as exit_info:  # sampling settings are checked as the recipe checks them
        bench.main(["--train-data", "generated:temperature=0", "--eval-data", "builtin:evaluation",
                    "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "--train-data: generated: temperature must be above 0" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def resolved(method: str, config: str = "recipes/configs/smollm2-eln.yaml") -> dict:
    args = argparse.Namespace(set=[], train_data="train.txt", eval_data="test.txt", threads=1,
                              schedule="constant_with_warmup")
    overrides = bench.recipe_overrides(args, "eln", method, 1024, bench.ROOT / "out" / "unused")
    return recipe_settings.load_config(["--config", str(bench.ROOT / config), *overrides]).to_dict()


@pytest.mark.parametrize("config", ["recipes/configs/smollm2-eln.yaml", "recipes/configs/smollm2-dyt.yaml"])
def test_each_method_keeps_its_calibration_whatever_the_config_says(config):
    """A named method measures the calibration its curve was measured with, so a change of the configs' calibration
    does not silently change an earlier curve's method; the configs' own recovery is blockwise-240x1+layerwise."""
    keys = ("strategy", "num_blocks", "block_steps", "block_rows", "block_weights_lr")
    for method in bench.METHODS:
        if method != "config":
            pinned = bench.calibration_settings(argparse.Namespace(set=[]), method)
            assert {f"calibration.{key}" for key in keys} <= {item.split("=")[0] for item in pinned}, method
    assert resolved("logits", config)["calibration"]["block_steps"] == 40
    assert resolved("blockwise-60x1", config)["calibration"]["num_blocks"] == 16
    configs = resolved("config", config)
    assert {k: configs[k] for k in ("calibration", "distill")} == \
        {k: resolved("blockwise-240x1+layerwise", config)[k] for k in ("calibration", "distill")}
