"""The speed benchmarks (bench_norms.py, bench_model_speed.py, bench_calibration_cost.py, bench_training.py) run end
to end on their smoke settings (timings are not checked, only that every candidate is measured and that the model
benchmark times a calibrated, finite conversion)."""

from __future__ import annotations

import json
import math

import pytest
from file_modules import import_file
from hf_normswap.precision import SLOW_MATMUL


@pytest.fixture
def one_thread(monkeypatch):
    """torch and the peak-RSS children at one thread: two threads on a loaded machine crawl."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quick_model_section_measures_every_variant_of_a_finite_conversion(tmp_path):
    bench = import_file("scripts/benchmarks/bench_model_speed.py")
    out = tmp_path / "speed.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    forward = {r["variant"]: r for r in rows if r["mode"] == "forward"}
    assert set(forward) == {"original", "eln", "eln-eager", "eln-folded"}
    assert forward["original"]["speedup"] == 1.0
    assert all(r["ms"] > 0 for r in rows)
    assert {r["variant"] for r in rows if r["mode"] == "train step"} == {"original", "eln", "eln-eager"}
    for variant in ("eln", "eln-folded"):
        assert math.isfinite(forward[variant]["largest_logit"])
    assert all(0 < r["norm_share"] < 1 for r in forward.values())


def test_model_variants_are_calibrated_unless_asked_not_to():
    """The calibrated start is per-channel (saturating init); the analytic conversion keeps one scalar per norm."""
    from hf_normswap.modules import ElementwiseNorm

    bench = import_file("scripts/benchmarks/bench_model_speed.py")  # the models as a benchmark imports them
    original, vocab = bench.load("gpt2")
    for calibrate in (True, False):
        for model in bench.model_variants(original, "eln", calibrate, vocab, 32):
            norms = [m for m in model.modules() if isinstance(m, ElementwiseNorm)]
            assert len(norms) == 9 and all(m.per_channel == calibrate for m in norms)


def test_quick_train_section_writes_the_keys_a_script_checks(tmp_path, one_thread):
    bench = import_file("scripts/benchmarks/bench_training.py")
    out = tmp_path / "train.json"
    assert bench.main(["--quick", "--sections", "train", "--seq", "32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("baseline_tokens_per_s", "recipe_tokens_per_s", "baseline_peak_rss_mb", "recipe_peak_rss_mb"):
        assert result[key] > 0, key
    assert result["cpu"] and isinstance(result["cpu_flags"], list)
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["baseline"]["precision"] == "fp32" and rows["baseline"]["speedup"] == 1.0
    recipe = rows["recipe"]
    assert recipe["precision"] in ("fp32", "bf16") and recipe["probe_matmul_speedup"] > 0
    # the step is timed unless the matmul found bf16 far slower (no bf16 matrix instructions)
    assert (recipe["probe_fp32_s"] is not None) == (recipe["probe_matmul_speedup"] >= SLOW_MATMUL)


def test_device_is_checked_and_kept_to_the_sections_it_times(capsys):
    """Without a GPU cuda is refused outright; with one, the default sections include calibration, timed on the
    CPU only."""
    for script in ("bench_norms", "bench_model_speed", "bench_training"):
        bench = import_file(f"scripts/benchmarks/{script}.py")
        with pytest.raises(SystemExit) as exit:
            bench.parse_args(["--device", "cuda"])
        assert exit.value.code == 2 and "--device" in capsys.readouterr().err
    assert bench.parse_args(["--device", "cpu", "--sections", "train", "--models", "smollm2-random"]).layers == 30


def test_quick_sampling_section_prices_each_batch_and_length_in_training_time(tmp_path, one_thread):
    bench = import_file("scripts/benchmarks/bench_training.py")
    out = tmp_path / "sampling.json"
    assert bench.main(["--quick", "--sections", "sampling", "--seq", "32", "--sample-batches", "2",
                       "--sample-lengths", "16,32", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert (rows["sample-2x16"]["tokens"], rows["sample-2"]["tokens"]) == (2 * 16, 2 * 32)
    for name in ("sample-2x16", "sample-2"):
        row = rows[name]
        assert row["tokens_per_s"] > 0 and row["precision"] in ("fp32", "bf16")
        assert all(row[f"cost_of_{step}"] > 0 for step in bench.SAMPLING_TRAIN)


def test_quick_norms_and_calibration_cost_measure_every_candidate(tmp_path, one_thread):
    norms = import_file("scripts/benchmarks/bench_norms.py")
    assert norms.main(["--quick", "--tokens", "64", "--reps", "1", "--json", str(tmp_path / "norms.json")]) == 0
    rows = json.loads((tmp_path / "norms.json").read_text())["rows"]
    assert {r["impl"] for r in rows} >= {"copy", "layernorm", "rmsnorm", "eln", "eln-eager", "dyt", "derf"}
    cost = import_file("scripts/benchmarks/bench_calibration_cost.py")
    assert cost.main(["--quick", "--seq", "32", "--calib-strategies", "fast", "--json", str(tmp_path / "c.json")]) == 0
    row = json.loads((tmp_path / "c.json").read_text())["rows"][0]
    assert row["forward_s"] > 0 and row["calibration_s"] > 0 and row["tokens"] == 2 * 32
