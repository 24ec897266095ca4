"""Time to a recovery's first training step, and the launch's peak host memory, against the run's length.

The original's samples are drawn as the run trains, so a run of 10M tokens should wait for its first step no longer
than a run of 64,000, and hold no more of its text in memory. Each budget is one launch of ``recipes/finetune.py``
in a fresh process, stopped after its first step (``max_minutes`` tiny): the seconds to the first step come from
its summary (``launches[-1].first_step_seconds``), the peak resident memory from the process's rusage. Budgets run
in turn, each from its own output directory (a converted checkpoint as ``model=`` skips calibration)::

    python scripts/benchmarks/bench_first_step.py --config recipes/configs/smollm2-eln.yaml --budgets 64000 10000000 \\
        --set model=CONVERTED original=offline:smollm2 --out OUT
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, add_threads, script_parser
from harness.record import ROOT, commit, machine

RECIPE = ROOT / "recipes" / "finetune.py"
# run in a child so that its peak resident memory is its own: ru_maxrss of the children waited for (KiB on Linux)
MEASURED = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def launch(args, budget: int, out: Path) -> dict:
    """One launch up to its first step, with a sample cache of its own (the original's samples drawn, not read from
    an earlier launch's cache); the seconds to the first step and the peak resident MiB."""
    command = [sys.executable, str(RECIPE), "--config", args.config, f"train_tokens={budget}", f"output_dir={out}",
               f"threads={args.threads}", "max_minutes=0.0001", "training.disable_tqdm=true", *args.set]
    log = out.parent / f"{out.name}.log"
    with log.open("w") as stream:
        result = subprocess.run([sys.executable, "-c", MEASURED, *command], stdout=subprocess.PIPE, stderr=stream,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                                "HF_NORMSWAP_CACHE": str(out.parent / f"{out.name}.cache")})
    if result.returncode != 0:
        raise SystemExit(f"bench_first_step: the recipe exited with {result.returncode} at train_tokens={budget}; "
                         f"see {log}")
    summary = json.loads((out / "summary.json").read_text())
    first = summary["launches"][-1]
    return {"train_tokens": budget,
            "first_step_s": first["first_step_seconds"], "peak_rss_mib": round(int(result.stdout.split()[-1]) / 1024),
            "steps_taken": first["global_step"]}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "smollm2-eln.yaml"))
    parser.add_argument("--budgets", nargs="+", type=int, default=[64_000, 10_000_000])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every launch")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the budgets, alternating")
    add_threads(parser)
    add_output(parser, "out/first-step", "folder for the runs and the rows")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} is not empty: name a new directory")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        for budget in args.budgets:
            row = {**launch(args, budget, out / f"tokens-{budget}-{repeat}"), "repeat": repeat, "commit": commit(),
                   **machine(), "threads": args.threads, "overrides": args.set}
            rows.append(row)
            with (out / "first_step.jsonl").open("a") as stream:
                stream.write(json.dumps(row) + "\n")
            print(f"[bench_first_step] train_tokens {budget:,}: first step after {row['first_step_s']} s, peak "
                  f"{row['peak_rss_mib']:,} MiB", flush=True)

    def median(budget, key):
        return statistics.median(row[key] for row in rows if row["train_tokens"] == budget)

    base = args.budgets[0]
    for budget in args.budgets[1:]:
        print(f"[bench_first_step] {budget:,} against {base:,} tokens (medians): first step "
              f"x{median(budget, 'first_step_s') / median(base, 'first_step_s'):.3f}, peak memory "
              f"x{median(budget, 'peak_rss_mib') / median(base, 'peak_rss_mib'):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
