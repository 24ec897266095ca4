"""scripts/gpu_check.sh --dry-run: every step of the GPU check runs on the CPU at toy sizes and is recorded in
summary.json, and no step is called passed that did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["imports", "pytest", "bench_module", "bench_model", "bench_train", "recovery", "fsdp"]


def _check(out: Path, *options: str) -> dict:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--dry-run", *options], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == STEPS and summary["dry_run"] is True
    return summary["steps"]


def test_dry_run_records_every_step(tmp_path):
    steps = _check(tmp_path)
    for name in ("imports", "bench_module", "bench_model", "bench_train"):
        assert steps[name]["status"] == "passed", (name, (tmp_path / steps[name]["log"]).read_text()[-2000:])
    module = json.loads((tmp_path / "bench_module.json").read_text())["rows"]
    assert {"copy", "eln", "eln-eager", "dyt", "dyt-eager"} <= {row["impl"] for row in module}
    assert {row["mode"] for row in module} == {"forward", "forward+backward"}
    model = json.loads((tmp_path / "bench_model.json").read_text())["rows"]
    assert {"original", "eln"} <= {row["variant"] for row in model}
    train = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert {row["variant"] for row in train} == {"baseline", "recipe"} and {row["precision"] for row in train} == {"bf16"}
    pytest_step = steps["pytest"]  # every CUDA test skipped on the CPU: the step did not run, so it is no pass
    assert pytest_step["status"].startswith("skipped: all") and pytest_step["tests"] == pytest_step["skipped"] > 0
    assert steps["recovery"]["status"].startswith("skipped: ")
    assert steps["fsdp"]["status"].startswith("skipped: dry run: left to the GPU")
    assert all(isinstance(entry["seconds"], int) for entry in steps.values())


def test_steps_not_asked_for_are_recorded_as_skipped(tmp_path):
    steps = _check(tmp_path, "--steps", "fsdp")
    assert all(steps[name]["status"] == "skipped: not in --steps" for name in STEPS[:-1])
    assert not (tmp_path / "pytest-cuda.xml").exists()
