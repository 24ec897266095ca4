"""scripts/gpu_check.sh --dry-run: every step of the GPU check runs on the CPU at toy sizes and is recorded in
summary.json, and no step is called passed that did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["imports", "recovery-eln", "sample", "convert", "bench_train-2", "pytest", "bench_kernels", "bench_model", "bench_smollm2",
         "fsdp"]
METRICS = ("calibration_s", "step_tokens_per_s", "sample_tokens_per_s")


def _check(out: Path, *options: str, cwd: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", GPU_CHECK_STASH=str(out / "stash"))
    done = subprocess.run(["bash", str(GPU_CHECK), str(out), "--dry-run", *options], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == STEPS and summary["dry_run"] is True
    return summary


def test_dry_run_records_every_step(tmp_path):
    summary = _check(tmp_path)
    steps = summary["steps"]
    for name in ("imports", "recovery-eln", "sample", "convert", "bench_kernels", "bench_model", "bench_train-2"):
        assert steps[name]["status"] == "passed", (name, (tmp_path / steps[name]["log"]).read_text()[-2000:])
    kernels = json.loads((tmp_path / "bench_kernels.json").read_text())["rows"]
    impls = {row["impl"] for row in kernels}
    assert {"copy", "layernorm", "rmsnorm", "eln-eager", "dyt-eager"} <= impls
    assert {row["mode"] for row in kernels} == {"forward", "forward+backward"}
    assert {row["section"] for row in kernels} == {"device", "host"}
    # the Triton path: under the interpreter in the device section (marked, no timing to report), and its host side
    assert all(row.get("interpreted") for row in kernels if row["impl"].endswith("-triton"))
    assert {"eln-triton", "eln-triton-host"} <= impls
    model = json.loads((tmp_path / "bench_model.json").read_text())["rows"]
    assert {row["variant"] for row in model} == {"original", "eln", "eln-folded"}
    assert {row["mode"] for row in model} == {"forward 1x16", "generate batch 1", "generate batch 2"}
    train = json.loads((tmp_path / "bench_train-2.json").read_text())["rows"]
    assert {row["variant"] for row in train} == {"baseline", "recipe"} and {row["precision"] for row in train} == {"bf16"}
    pytest_step = steps["pytest"]  # every CUDA test skipped on the CPU: the step did not run, so it is no pass
    assert pytest_step["status"].startswith("skipped: all") and pytest_step["tests"] == pytest_step["skipped"] > 0
    # the recipe at toy sizes: calibrated, trained on the tokens a step asked, its measurements in the summary
    command = (tmp_path / "recovery-eln.cmd").read_text()
    assert "recipes/finetune.py" in command and "step_tokens=128 " in command
    run = json.loads((tmp_path / "recovery-eln" / "summary.json").read_text())
    assert run["training"]["tokens_seen"] == 256 and run["training"]["steps"] == 2
    assert all(isinstance(summary[name], (int, float)) and summary[name] > 0 for name in METRICS), summary
    assert summary["measured"]["tokens_seen"] == 256
    assert steps["fsdp"]["status"].startswith("skipped: ")
    assert all(isinstance(entry["seconds"], int) for entry in steps.values())


def test_steps_not_asked_for_are_recorded_as_skipped(tmp_path):
    summary = _check(tmp_path, "--steps", "fsdp")
    assert all(summary["steps"][name]["status"] == "skipped: not in --steps" for name in STEPS[:-1])
    assert not (tmp_path / "pytest-cuda.xml").exists()
    assert all(summary[name] is None for name in METRICS)  # nothing measured is no number


def test_a_relative_output_folder_is_where_the_user_stands(tmp_path):
    """OUT_DIR and --work relative to the current folder, not to the repository the script moves to; with --work
    OUT_DIR gets only the summary and the bundle of the work folder."""
    (tmp_path / "here").mkdir()
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", GPU_CHECK_STASH=str(tmp_path / "stash"))
    done = subprocess.run(["bash", str(GPU_CHECK), "relout", "--dry-run", "--steps", "fsdp",
                           "--work", "relwork"], cwd=tmp_path / "here", env=env, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (ROOT / "relout").exists() and not (ROOT / "relwork").exists()
    out, work = tmp_path / "here" / "relout", tmp_path / "here" / "relwork"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "work.tgz"]
    assert (work / "steps.tsv").is_file()
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert list(steps) == STEPS and steps["fsdp"]["status"].startswith("skipped: ")
