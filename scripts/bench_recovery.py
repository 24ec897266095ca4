"""Recovery curve: perplexity ratio (with KL and top-1 agreement) of the converted model to the original against the
training tokens seen, for named recovery methods at equal token budgets; for a sentence encoder (a config such as
``recipes/configs/minilm-eln.yaml``), the embedding cosine to the original (with nearest-neighbour agreement and
similarity rank correlation) instead.

Each (norm, method) is one run of ``recipes/finetune.py`` in ``OUT/runs/NORM-METHOD``, extended budget by budget:
``train_tokens=B`` for each budget in turn, each launch resuming from the previous one's last checkpoint. A launch is
a chunk; every JSON line records where its chunk began (``chunk_start_tokens``), so a curve can be carried across
processes: run the same command with larger budgets and it goes on from where it stopped (points
already in ``OUT/curve.jsonl`` are not measured again). The learning rate is constant after warmup
(``--schedule``), so extending a run does not change the steps already taken. A schedule that decays over the
run's length (cosine, linear) needs ``--run-per-budget``: each budget is then a whole run of its own, in
``OUT/runs/NORM-METHOD-BUDGET``, from the shared calibrated start. Budget 0 is the recipe's evaluation
of the calibrated start. The recipe's final evaluation gives the numbers: WikiText-2 test windows of
``final_eval.max_length`` tokens, the original scored on the same windows (an encoder: the sentences of the first
``final_eval.max_tokens`` tokens).

    python scripts/bench_recovery.py --config recipes/configs/smollm2-eln.yaml --norms eln dyt \\
        --methods logits layerwise+logits --budgets 0 2048 5120 10240 --out out/recovery \\
        --train-data PATH/wiki.valid.tokens --eval-data PATH/wiki.test.raw
    python scripts/bench_recovery.py --config recipes/configs/minilm-eln.yaml --norms eln --methods config \\
        --schedule cosine --run-per-budget --budgets 0 77000 308000 --out out/recovery-minilm \\
        --train-data PATH/wiki.valid.tokens --eval-data PATH/wiki.test.raw
    python scripts/bench_recovery.py --out out/recovery --plot-only

Methods (:data:`METHODS`, overrides on top of the config; ``--set KEY=VALUE`` adds overrides to every method and wins
over a method's own setting of the same key, so one method can be measured with one setting changed; every JSON line
records them as ``overrides``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "finetune.py"

sys.path.insert(0, str(ROOT / "scripts"))
from bench_speed import machine  # noqa: E402  the CPU and its bf16 / AMX flags, recorded as every benchmark does

LOGITS_ONLY = "distill.hidden=0"  # no layer-wise term (the SmolLM2 configs have one)


def block_calibration(sequences: int, steps: int, rows: int, weights_lr: float) -> list[str]:
    """The block strategy's settings a method pins (``weights_lr`` 0: the norms' parameters alone), so that it measures
    the calibration its curve was measured with when the configs' calibration changes."""
    return ["calibration.strategy=block", f"calibration.num_blocks={sequences}", f"calibration.block_steps={steps}",
            f"calibration.block_rows={rows}", f"calibration.block_weights_lr={weights_lr:g}"]


# 40 steps of 4 of 16 sequences a block (the block strategy's default until eab4faf): the norms alone, or with each
# block's weights too
NORMS_ONLY = block_calibration(16, 40, 4, 0)
BLOCKWISE = block_calibration(16, 40, 4, 1e-4)
BLOCKWISE_60X1 = block_calibration(16, 60, 1, 1e-4)  # the block strategy's default steps and rows
BLOCKWISE_240X1 = block_calibration(64, 240, 1, 1e-4)  # four times the steps, over 64 sequences: the SmolLM2 configs

METHODS: dict[str, list[str]] = {
    # the config's own calibration and recovery, unchanged (the SmolLM2 configs: blockwise-240x1+layerwise)
    "config": [],
    # the baseline: calibration of the norms alone, then KL to the original's logits, all weights
    "logits": [*NORMS_ONLY, LOGITS_ONLY],
    # every block's output toward the original's (hf_normswap.training.layerwise), sink masked, no logit term
    "layerwise": [*NORMS_ONLY, "distill.logits=false", "distill.hidden=1.0"],
    # both: the layer-wise term weighted to about the logit KL's size at the calibrated start (KL ~3 nats, mean
    # relative block error ~0.3 on SmolLM2)
    "layerwise+logits": [*NORMS_ONLY, "distill.hidden=10.0"],
    # norms handed over from the original block by block (hf_normswap.training.progressive): 3 stages of 10 blocks, then
    # the final norm, one every 2 steps, each ramped over 2 steps: all converted after 8 steps (8,192 tokens at
    # 2 x 512)
    "progressive": [*NORMS_ONLY, LOGITS_ONLY, "progressive.enabled=true", "progressive.group=10",
                    "progressive.every=2", "progressive.ramp=2"],
    # block-wise reconstruction during calibration: each block's linear weights fitted beside its norms to the
    # original block's output (hf_normswap.calibration.reconstruct), then logit distillation
    "blockwise": [*BLOCKWISE, LOGITS_ONLY],
    # both gains at once: the block-wise start, then the layer-wise term beside the logit KL
    "blockwise+layerwise": [*BLOCKWISE, "distill.hidden=10.0"],
    # the same with the block strategy's default
    "blockwise-60x1": [*BLOCKWISE_60X1, LOGITS_ONLY],
    # the same start, the input embeddings and the tied head kept fixed in training (fewer weight gradients)
    "blockwise-60x1+frozen-embeddings": [*BLOCKWISE_60X1, LOGITS_ONLY, "freeze_embeddings=true"],
    # the same start, then the layer-wise term beside the logit KL (as in blockwise+layerwise)
    "blockwise-60x1+layerwise": [*BLOCKWISE_60X1, "distill.hidden=10.0"],
    # the same with four times the block steps, over 64 sequences: the SmolLM2 configs
    "blockwise-240x1+layerwise": [*BLOCKWISE_240X1, "distill.hidden=10.0"],
}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def read_points(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# the numbers of a point, the goal line drawn beside the first, and the axes' labels: a language model's, an encoder's
METRICS = {"ratio": "perplexity / original", "kl": "KL(original || converted), nats/token",
           "top1": "top-1 agreement with the original"}
ENCODER_METRICS = {"cosine": "embedding cosine to the original", "neighbours": "nearest-neighbour agreement",
                   "spearman": "similarity rank correlation (Spearman)"}
GOALS = {"ratio": 2.0, "cosine": 0.98}
# the Trainer's schedules whose rate at a step depends on the run's length (max_steps)
DECAYING = ("linear", "cosine", "cosine_with_restarts", "polynomial", "cosine_with_min_lr")


def point(summary: dict, key: str) -> dict:
    """The numbers of one of the recipe's evaluations (``calibrated`` or ``finetuned``): ratio / KL / top-1 /
    perplexities, or for a sentence encoder (``hf_normswap.evaluation.embeddings``) cosine / neighbours / rank correlation."""
    evaluation = summary[key]
    results = evaluation["results"]
    embedding = results.get("converted", {})
    if "cosine" in embedding:
        return {"cosine": embedding["cosine"], "neighbours": embedding["nearest_neighbour_agreement"],
                "spearman": embedding["spearman"], "eval_sentences": evaluation["sentences"],
                "eval_tokens": evaluation["tokens"]}
    return {"ratio": evaluation["ratio"][key], "kl": evaluation["kl"][key], "top1": evaluation["top1_agreement"][key],
            "ppl": results[key]["token_perplexity"], "ppl_original": results["original"]["token_perplexity"],
            "eval_tokens": evaluation["tokens"], "eval_max_length": evaluation["max_length"]}


def metrics_of(row: dict) -> dict[str, str]:
    """A point's metrics and their labels: a language model's or a sentence encoder's."""
    return METRICS if "ratio" in row else ENCODER_METRICS


def describe(row: dict) -> str:
    return ", ".join(f"{key} {row[key]:.4g}" for key in metrics_of(row))


def calibration_settings(args, method: str) -> list[str]:
    """The overrides that decide the calibrated start (the last one of a key wins, as in the recipe)."""
    settings = dict(item.partition("=")[::2] for item in [*METHODS[method], *args.set]
                    if item.startswith(("calibration.", "model=")))
    return sorted(f"{k}={v}" for k, v in settings.items())


def share_calibration(args, norm: str, method: str, run_dir: Path) -> None:
    """Start from another run's calibrated model when the calibration settings are the same: the same start for
    every method and budget (the curves then differ by the recovery alone) and one calibration instead of one per
    run."""
    cache = run_dir / "calibrated"
    if cache.exists():
        return
    for source in sorted(run_dir.parent.glob(f"{norm}-*/calibrated/config.json")):
        other = source.parent.parent.name[len(norm) + 1:]
        head, _, budget = other.rpartition("-")
        other = head if budget.isdigit() and head in METHODS else other  # NORM-METHOD-BUDGET (--run-per-budget)
        if other in METHODS and calibration_settings(args, other) == calibration_settings(args, method):
            run_dir.mkdir(parents=True, exist_ok=True)
            cache.symlink_to(source.parent.resolve(), target_is_directory=True)
            return


def run_directory(args, norm: str, method: str, budget: int) -> Path:
    """Where a point's run lives: one run a method extended budget by budget, or one a budget."""
    name = f"{norm}-{method}-{budget}" if args.run_per_budget else f"{norm}-{method}"
    return Path(args.out) / "runs" / name


def recipe_overrides(args, norm: str, method: str, budget: int, run_dir: Path) -> list[str]:
    """The recipe's overrides for one chunk: the method's settings, then ``--set`` (the recipe takes the last one of a
    key, so the command line wins)."""
    return [f"method={norm}", f"train_tokens={max(budget, 1)}", f"output_dir={run_dir}",
            f"train_data={args.train_data}", f"eval_data={args.eval_data}",
            f"calibration.data={args.train_data}", f"threads={args.threads}",
            f"training.lr_scheduler_type={args.schedule}", "training.disable_tqdm=true",
            *METHODS[method], *args.set]


def run_chunk(args, norm: str, method: str, budget: int, run_dir: Path) -> tuple[dict, float, float, int]:
    """One launch of the recipe up to ``budget`` tokens; (summary, wall s, CPU s, return code)."""
    command = [sys.executable, str(RECIPE), "--config", args.config,
               *recipe_overrides(args, norm, method, budget, run_dir)]
    share_calibration(args, norm, method, run_dir)
    log = run_dir.parent / f"{run_dir.name}.log"
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    with log.open("a") as stream:
        stream.write(f"\n$ {' '.join(command)}\n")
        stream.flush()
        try:
            code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return summary, time.time() - start, cpu, code


def measure(args) -> None:
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    curve = out / "curve.jsonl"
    done = {(p["norm"], p["method"], p["budget"]) for p in read_points(curve)}
    context = {"commit": commit(), **machine(), "config": args.config, "schedule": args.schedule,
               "run_per_budget": args.run_per_budget, "overrides": args.set, "threads": args.threads}
    for norm in args.norms:
        for method in args.methods:
            for budget in sorted(args.budgets):
                run_dir = run_directory(args, norm, method, budget)
                if (norm, method, budget) in done:
                    continue
                if budget == 0:  # the calibrated start, evaluated by the recipe before any step
                    summary_path = run_dir / "summary.json"
                    if not summary_path.exists() or "calibrated" not in json.loads(summary_path.read_text()):
                        continue  # measured with the first chunk
                    row = {"tokens": 0, **point(json.loads(summary_path.read_text()), "calibrated")}
                else:
                    summary, wall, cpu, code = run_chunk(args, norm, method, budget, run_dir)
                    if code != 0 or "finetuned" not in summary:
                        print(f"[bench_recovery] {norm} {method} {budget}: recipe exited with {code}; see "
                              f"{run_dir}.log (the run resumes from its last checkpoint next time)", flush=True)
                        break
                    launch = summary["launches"][-1]
                    row = {"tokens": summary["training"]["tokens_seen"], "steps": summary["training"]["steps"],
                           **point(summary, "finetuned"), "chunk_start_tokens": launch.get("start_tokens"),
                           "chunk_wall_s": round(wall, 1), "chunk_cpu_s": round(cpu, 1),
                           "train_wall_s": summary["training"]["wall_seconds"]}
                    if 0 in args.budgets and (norm, method, 0) not in done:
                        zero = {"norm": norm, "method": method, "budget": 0, "tokens": 0,
                                **point(summary, "calibrated"), **context}
                        with curve.open("a") as f:
                            f.write(json.dumps(zero) + "\n")
                        done.add((norm, method, 0))
                row = {"norm": norm, "method": method, "budget": budget, **row, **context}
                with curve.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                done.add((norm, method, budget))
                print(f"[bench_recovery] {norm} {method} {row['tokens']:,} tokens: {describe(row)}", flush=True)


def plot(curve: Path, path: Path) -> Path:
    """Ratio, KL and top-1 agreement (an encoder: cosine, neighbours, rank correlation) against training tokens (log
    x; 0 sits on the linear part of a symlog axis); one colour per method, solid ELN, dashed DyT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = read_points(curve)
    metrics = METRICS if all(metrics_of(p) is METRICS for p in points) else ENCODER_METRICS
    points = [p for p in points if metrics_of(p) is metrics]
    series: dict[tuple[str, str], list[dict]] = {}
    for p in points:
        series.setdefault((p["norm"], p["method"]), []).append(p)
    methods = sorted({m for _, m in series})
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    positive = [p["tokens"] for p in points if p["tokens"] > 0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for (norm, method), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda p: p["tokens"])
        style = "-" if norm == "eln" else "--"
        for ax, key in zip(axes, metrics):
            ax.plot([p["tokens"] for p in rows], [p[key] for p in rows], style, marker="o", ms=3,
                    c=colours[method], label=f"{norm.upper()} {method}")
    for ax, label in zip(axes, metrics.values()):
        if positive:
            ax.set_xscale("symlog", linthresh=min(positive))
        ax.set(xlabel="training tokens", ylabel=label)
        ax.grid(alpha=0.3, which="both")
    first = next(iter(metrics))
    if first == "ratio":
        axes[0].set_yscale("log")
    axes[0].axhline(GOALS[first], c="k", ls=":", lw=0.8, label=f"goal {GOALS[first]}")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Recovery per training token ({curve})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "smollm2-eln.yaml"))
    parser.add_argument("--norms", nargs="+", default=["eln", "dyt"], choices=["eln", "dyt"])
    parser.add_argument("--methods", nargs="+", default=["logits"], choices=list(METHODS))
    parser.add_argument("--budgets", nargs="+", type=int, default=[0, 50_000, 100_000, 250_000, 500_000],
                        help="training tokens at which to measure (default: the goal's curve)")
    parser.add_argument("--train-data", help="training and calibration text (e.g. WikiText-2 validation)")
    parser.add_argument("--eval-data", help="evaluation text (e.g. WikiText-2 test)")
    parser.add_argument("--schedule", default="constant_with_warmup", help="the Trainer's lr_scheduler_type")
    parser.add_argument("--run-per-budget", action="store_true",
                        help="each budget a whole run from the calibrated start (for a schedule that decays over the "
                             "run, such as cosine), not one run extended budget by budget")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every run; they win over the method's own")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per launch of the recipe")
    parser.add_argument("--out", default="out/recovery")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.plot_only:
        missing = [name for name, value in (("--train-data", args.train_data), ("--eval-data", args.eval_data))
                   if not value or (not value.startswith("builtin") and not Path(value).exists())]
        if missing:
            parser.error(f"{', '.join(missing)}: give existing text files (or builtin:...)")
        if not Path(args.config).is_file():
            parser.error(f"--config {args.config}: no such file")
        if args.schedule in DECAYING and len([b for b in args.budgets if b > 0]) > 1 and not args.run_per_budget:
            parser.error(f"--schedule {args.schedule} decays over the run's length, so extending a run budget by "
                         "budget would change the steps already taken: give --run-per-budget")
        measure(args)
    curve = Path(args.out) / "curve.jsonl"
    if not read_points(curve):
        print(f"[bench_recovery] no points in {curve} yet", flush=True)
        return 0
    print(f"[bench_recovery] {plot(curve, Path(args.out) / 'curve.png')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
