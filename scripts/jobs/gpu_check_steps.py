"""The Python side of scripts/gpu_check.sh, one subcommand a job, so that the shell script holds only the
order of the steps, their time limits and what travels.

    python scripts/jobs/gpu_check_steps.py pins NAME...                # NAME==VERSION of installed packages
    python scripts/jobs/gpu_check_steps.py imports                     # pyproject's dependencies, the CLI, scripts
    python scripts/jobs/gpu_check_steps.py loadable SPEC               # why SPEC cannot run the recipe, or nothing
    python scripts/jobs/gpu_check_steps.py sample-speed --model SPEC --json F  # the sampler's tokens/s
    python scripts/jobs/gpu_check_steps.py recovery-metrics LOG RUN_DIR --json F  # calibration_s, step_tokens_per_s
    python scripts/jobs/gpu_check_steps.py summarize WORK OUT DRY DEVICE TORCH  # OUT/summary.json
    python scripts/jobs/gpu_check_steps.py report OUT                  # one line a step
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the measurements summary.json carries at its top level, from the step files that hold them
METRICS = ("calibration_s", "step_tokens_per_s", "sample_tokens_per_s")


def pins(names: list[str]) -> int:
    import importlib.metadata as metadata

    missing = []
    for name in names:
        try:
            print(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        sys.exit(f"gpu_check: {', '.join(missing)} not installed here: pip install {' '.join(missing)}")
    return 0


def imports() -> int:
    """Every dependency in pyproject.toml (a missing one named with the fix), then the CLI, the recipe and the
    benchmarks."""
    import importlib
    import runpy
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [Requirement(spec).name for spec in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    missing = []
    for name in names:
        try:
            importlib.import_module({"pyyaml": "yaml"}.get(name, name).replace("-", "_"))
        except ImportError as error:
            missing.append(f"{name} ({error})")
    if missing:
        sys.exit("gpu_check: not importable: " + "; ".join(missing) + ": carry its wheel (GPU_WHEELS, --prepare)")
    import hf_normswap.cli  # noqa: F401  internal: the command imports on this machine
    import hf_normswap.training.recipe  # noqa: F401  internal: the recipe imports on this machine

    for script in ("bench_training", "bench_kernels", "bench_decode"):
        runpy.run_path(str(ROOT / "scripts" / "benchmarks" / f"{script}.py"), run_name="imported")
    return 0


def loadable(spec: str) -> int:
    """Exit 1 with the reason on stderr when ``spec`` cannot run the recipe here (its files, or the readers the
    recipe imports for it)."""
    import importlib

    from hf_normswap.checkpoint.loading import resolve  # internal: where the recipe would find SPEC's files

    try:
        location, extra = resolve(spec)
    except Exception as error:  # noqa: BLE001 -- any reason is the reason
        sys.exit(f"{spec} cannot load ({error})")
    for package in ("datasets", "omegaconf") + (("gguf",) if "gguf_file" in extra else ()):
        try:
            importlib.import_module(package)
        except ImportError as error:
            sys.exit(f"the recipe needs the {package} package ({error}): pip install {package} (offline: --prepare)")
    if not extra and not (Path(location) / "config.json").is_file():
        sys.exit(f"{spec} holds no config.json")
    return 0


def sample_speed(args) -> int:
    """The sampler as the recipe runs it (``data.generated.draw``): one batch first (on CUDA: the compile of the
    decode step and its CUDA graphs), then ``--batches`` more timed; tokens/s of those."""
    import torch
    from transformers import CompileConfig

    from hf_normswap import load_model
    from hf_normswap.data.generated import SampleCache, SamplingSettings, draw  # internal: the recipe's sampler

    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.bfloat16)
    if args.layers:  # toy sizes: the first blocks alone
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    settings = SamplingSettings(length=args.length, batch_size=args.batch, precision="bf16")
    cuda = args.device.startswith("cuda")
    compiled = CompileConfig(mode="reduce-overhead") if cuda else None
    cache = SampleCache(model, settings, Path(args.cache))
    seconds = []
    for index in range(1 + args.batches):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        draw(model, tokenizer, cache, [index], progress=False, compiled=compiled)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    tokens = args.batches * args.batch * args.length
    result = {"sample_tokens_per_s": round(tokens / sum(seconds[1:]), 1), "first_batch_s": round(seconds[0], 2),
              "batch": args.batch, "length": args.length, "batches_timed": args.batches, "compiled": cuda}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def recovery_metrics(log: Path, run_dir: Path) -> dict:
    """What a recovery run measured: calibration's seconds (its log line), the training's tokens/s (tokens seen
    over the training's wall seconds, evaluations included, from the run's summary.json), the perplexity ratios,
    and the original's samples' tokens/s where the run drew them in one go (its ``[generated]`` line)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    metrics = {}
    found = re.search(r"calibration in (\d+)s", text)
    if found:
        metrics["calibration_s"] = int(found.group(1))
    found = re.findall(r"\[generated\] ([\d,]+) tokens sampled in (\d+) s", text)
    if found:
        tokens, seconds = (sum(int(t.replace(",", "")) for t, _ in found), sum(int(s) for _, s in found))
        metrics["sample_tokens_per_s"] = round(tokens / max(seconds, 1), 1)
    summary = run_dir / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        training = data.get("training") or {}
        if training.get("wall_seconds"):
            metrics["step_tokens_per_s"] = round(training["tokens_seen"] / training["wall_seconds"], 1)
            metrics["tokens_seen"] = training["tokens_seen"]
        metrics.update({f"ratio_{k}": data[k]["ratio"].get(k) for k in ("calibrated", "finetuned")
                        if isinstance(data.get(k), dict) and "ratio" in data[k]})
    return metrics


def summarize(work: Path, out: Path, dry: bool, device: str, torch_version: str) -> int:
    """OUT/summary.json from WORK/steps.tsv: each step's status and seconds (the CUDA tests' counts from their junit
    xml), and at the top level the measurements of :data:`METRICS` from the steps' ``metrics-*.json`` (None: not
    measured)."""
    import xml.etree.ElementTree as ET

    steps = {}
    for line in (work / "steps.tsv").read_text().splitlines():
        name, status, seconds = line.split("\t")
        steps[name] = {"status": status, "seconds": int(seconds)}
        if (work / f"{name}.log").is_file():
            steps[name]["log"] = f"{name}.log"
    junit = work / "pytest-cuda.xml"
    if "pytest" in steps and junit.is_file():
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        steps["pytest"].update(counts)
        if steps["pytest"]["status"] == "passed" and counts["tests"] == counts["skipped"]:
            steps["pytest"]["status"] = f"skipped: all {counts['tests']} cuda tests skipped (no GPU)"
    measured = {}
    for path in sorted(work.glob("metrics-*.json")):  # the recovery's first, the sampler's own measurement last
        measured.update({k: v for k, v in json.loads(path.read_text()).items() if v is not None})
    summary = {"dry_run": dry, "device": device, "torch": torch_version,
               **{name: measured.get(name) for name in METRICS}, "measured": measured, "steps": steps}
    (out / "summary.json.tmp").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.json.tmp").replace(out / "summary.json")
    return 0


def report(out: Path) -> int:
    summary = json.loads((out / "summary.json").read_text())
    for name, entry in summary["steps"].items():
        print(f"gpu_check: {name:<15} {entry['status']} ({entry['seconds']} s)")
    print("gpu_check: " + ", ".join(f"{name} {summary[name]}" for name in METRICS))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    jobs = parser.add_subparsers(dest="job", required=True)
    jobs.add_parser("pins").add_argument("names", nargs="+")
    jobs.add_parser("imports")
    jobs.add_parser("loadable").add_argument("spec")
    speed = jobs.add_parser("sample-speed")
    speed.add_argument("--model", required=True)
    speed.add_argument("--device", default="cuda")
    speed.add_argument("--layers", type=int, default=0, help="keep the first N blocks (toy sizes)")
    speed.add_argument("--batch", type=int, default=512)
    speed.add_argument("--length", type=int, default=512)
    speed.add_argument("--batches", type=int, default=4, help="batches timed after the first")
    speed.add_argument("--cache", required=True, help="a folder for the samples")
    speed.add_argument("--json", required=True)
    metrics = jobs.add_parser("recovery-metrics")
    metrics.add_argument("log", type=Path)
    metrics.add_argument("run_dir", type=Path)
    metrics.add_argument("--json", required=True)
    summary = jobs.add_parser("summarize")
    for name in ("work", "out"):
        summary.add_argument(name, type=Path)
    for name in ("dry", "device", "torch_version"):
        summary.add_argument(name)
    jobs.add_parser("report").add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.job == "pins":
        return pins(args.names)
    if args.job == "imports":
        return imports()
    if args.job == "loadable":
        return loadable(args.spec)
    if args.job == "sample-speed":
        return sample_speed(args)
    if args.job == "recovery-metrics":
        found = recovery_metrics(args.log, args.run_dir)
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
        return 0
    if args.job == "summarize":
        return summarize(args.work, args.out, args.dry == "1", args.device, args.torch_version)
    return report(args.out)


if __name__ == "__main__":
    sys.exit(main())
