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

    python scripts/benchmarks/bench_recovery.py --config recipes/configs/smollm2-eln.yaml --norms eln dyt \\
        --methods logits layerwise+logits --budgets 0 2048 5120 10240 --out out/recovery \\
        --train-data PATH/wiki.valid.tokens --eval-data PATH/wiki.test.raw
    python scripts/benchmarks/bench_recovery.py --config recipes/configs/minilm-eln.yaml --norms eln --methods config \\
        --schedule cosine --run-per-budget --budgets 0 77000 308000 --out out/recovery-minilm \\
        --train-data PATH/wiki.valid.tokens --eval-data PATH/wiki.test.raw
    python scripts/benchmarks/bench_recovery.py --out out/recovery --plot-only
    python scripts/benchmarks/bench_recovery.py --norms eln --methods blockwise-240x1+layerwise --budgets 0 102400 \\
        --set train_data=generated --other-data builtin:evaluation --out out/samples ...   # text of another kind
    python scripts/benchmarks/bench_recovery.py ... --train-data generated --eval-data PATH/wiki.test.raw  # samples
    python scripts/benchmarks/bench_recovery.py --out out/samples --plot-only --compare out/recovery  # side by side

Methods (:data:`METHODS`, overrides on top of the config; ``--set KEY=VALUE`` adds overrides to every method and wins
over a method's own setting of the same key, so one method can be measured with one setting changed; every JSON line
records them as ``overrides``). A curve is one norm, method and ``train_data``; each point records the CPU time of
its launch, sampling included, so curves of different training text compare against CPU-hours too.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

# internal: --train-data and --eval-data checked as the recipe checks them, and the name of the run's
# record it reads back
from hf_normswap.data import DataError, check_spec
from hf_normswap import METHODS as NORMS
from hf_normswap.training.run_dir import RECORD

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, add_threads, script_parser
from harness.record import ROOT, commit, machine

RECIPE = ROOT / "recipes" / "finetune.py"

LOGITS_ONLY = "distill.hidden=0"  # no layer-wise term (the SmolLM2 configs have one)


def block_calibration(sequences: int, steps: int, rows: int, weights_lr: float) -> list[str]:
    """The block strategy's settings a method pins (``weights_lr`` 0: the norms' parameters alone), so that it measures
    the calibration its curve was measured with when the configs' calibration changes."""
    return ["calibration.strategy=block", f"calibration.num_blocks={sequences}", f"calibration.block_steps={steps}",
            f"calibration.block_rows={rows}", f"calibration.block_weights_lr={weights_lr:g}"]


# 40 steps of 4 of 16 sequences a block: the norms alone, or with each block's weights too
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
    # both: the layer-wise term weighted to about the logit KL's size at the calibrated start (KL ~3, block error ~0.3)
    "layerwise+logits": [*NORMS_ONLY, "distill.hidden=10.0"],
    # norms handed over block by block (hand_overs.progressive): 3 stages of 10 blocks, then the final norm, one
    # every 2 steps, each ramped over 2 steps: all converted after 8 steps (8,192 tokens at 2 x 512)
    "progressive": [*NORMS_ONLY, LOGITS_ONLY, "progressive.enabled=true", "progressive.group=10",
                    "progressive.every=2", "progressive.ramp=2"],
    # block-wise reconstruction in calibration (calibration.reconstruct: each block's weights too), then logit KL
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
    # the taper (hand_overs.taper) from the original itself: the norms alone calibrated (g = 1 is the original), every
    # block's output beside the logits, each norm blended with its original, g 1 to 0 (cosine) over the first half
    "norms+layerwise+taper": [*NORMS_ONLY, "distill.hidden=10.0", "taper.fraction=0.5"],
    # the same in progressive's depth stages, 3 of 10 blocks then the final norm, each over an eighth of the run
    "norms+layerwise+taper-progressive": [*NORMS_ONLY, "distill.hidden=10.0", "taper.fraction=0.5",
                                          "taper.schedule=progressive", "progressive.group=10"],
    # the taper from the configs' block-wise start (its weights fitted to the new norms, so g = 1 is not the
    # original): g falls over the first quarter of the run, by the cosine or in progressive's depth stages
    "blockwise-240x1+layerwise+taper": [*BLOCKWISE_240X1, "distill.hidden=10.0", "taper.fraction=0.25"],
    "blockwise-240x1+layerwise+taper-progressive": [*BLOCKWISE_240X1, "distill.hidden=10.0", "taper.fraction=0.25",
                                                    "taper.schedule=progressive", "progressive.group=10"],
    # the configs with the pre-logit scale anchor (hf_normswap.training.scale_anchor) at weight 10
    "blockwise-240x1+layerwise+scale": [*BLOCKWISE_240X1, "distill.hidden=10.0", "distill.scale=10.0"],
}


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
    run. The files are hard links (no copy of the weights; the recipe refuses a symbolic link in its output_dir, and
    its saves replace files, never write into them). The other run's record (``run.json``: the model it calibrated)
    comes along, or the recipe would refuse a directory it did not write."""
    cache = run_dir / "calibrated"
    if cache.exists():
        return
    for source in sorted(run_dir.parent.glob(f"{norm}-*/calibrated/config.json")):
        other = source.parent.parent.name[len(norm) + 1:]
        head, _, budget = other.rpartition("-")
        other = head if budget.isdigit() and head in METHODS else other  # NORM-METHOD-BUDGET (--run-per-budget)
        if other in METHODS and calibration_settings(args, other) == calibration_settings(args, method):
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copytree(source.parent, cache, copy_function=os.link)
            record = source.parent.parent / RECORD
            if record.exists() and not (run_dir / RECORD).exists():
                shutil.copyfile(record, run_dir / RECORD)
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


def resolved_run(args, norm: str, method: str, run_dir: Path):
    """A point's run as the recipe resolves it (``RecoveryRun``)."""
    # internal: the recipe's own resolution, for its evaluation windows and whether it calibrates
    from hf_normswap.training.recovery_run import resolve_run
    from hf_normswap.training.config import read_recipe_config

    return resolve_run(read_recipe_config(args.config, recipe_overrides(args, norm, method, 1, run_dir)))


def other_text(args, norm: str, method: str, run_dir: Path, checkpoint: Path) -> dict:
    """A point on ``--other-data``, text that neither calibration nor training read: ``normswap eval`` of the
    checkpoint against the original, on as many tokens in windows as long as the recipe's final evaluation."""
    run = resolved_run(args, norm, method, run_dir)
    config = run.settings
    command = [sys.executable, "-c", "import sys; from hf_normswap.cli import main; sys.exit(main())", "eval",
               str(checkpoint), "--against", run.original, "--data", args.other_data,
               "--max-tokens", str(config.final_eval.max_tokens), "--max-length", str(config.final_eval.max_length),
               "--no-tails", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS":
                                                                          str(args.threads)})
    if result.returncode != 0:
        raise SystemExit(f"bench_recovery: normswap eval {checkpoint} on {args.other_data} failed:\n"
                         f"{result.stderr[-2000:]}")
    return {"data": args.other_data, **point({"converted": json.loads(result.stdout)}, "converted")}


def start_checkpoint(args, norm: str, method: str, run_dir: Path) -> Path:
    """Where a point's run started: its calibrated model, or the converted checkpoint it was given (``model=``)."""
    run = resolved_run(args, norm, method, run_dir)
    return run.calibrated_cache if run.calibrates else Path(run.settings.model)


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
                    if args.other_data:
                        row["other"] = other_text(args, norm, method, run_dir, Path(summary["checkpoint"]))
                    if 0 in args.budgets and (norm, method, 0) not in done:
                        zero = {"norm": norm, "method": method, "budget": 0, "tokens": 0,
                                **point(summary, "calibrated"), **context}
                        if args.other_data:
                            zero["other"] = other_text(args, norm, method, run_dir, start_checkpoint(args, norm,
                                                                                                     method, run_dir))
                        with curve.open("a") as f:
                            f.write(json.dumps(zero) + "\n")
                        done.add((norm, method, 0))
                row = {"norm": norm, "method": method, "budget": budget, **row, **context}
                with curve.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                done.add((norm, method, budget))
                print(f"[bench_recovery] {norm} {method} {row['tokens']:,} tokens: {describe(row)}", flush=True)


def source(row: dict) -> str:
    """The training text a point's run read when ``--set`` named one (the last ``train_data=`` wins; a mix as
    ``A + B``, files by name), else ''."""
    named = [item.partition("=")[2] for item in row.get("overrides") or [] if item.startswith("train_data=")]
    if not named:
        return ""
    texts = yaml.safe_load(named[-1])
    texts = texts if isinstance(texts, list) else [texts]
    return " + ".join(Path(text).name if "/" in text else text for text in map(str, texts))


def series(points: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The points of each curve, in token order, by (norm, method and training text): one curve each."""
    found: dict[tuple[str, str], list[dict]] = {}
    for p in points:
        text = source(p)
        found.setdefault((p["norm"], f"{p['method']} [{text}]" if text else p["method"]), []).append(p)
    return {key: sorted(rows, key=lambda p: p["tokens"]) for key, rows in sorted(found.items())}


def cpu_hours(rows: list[dict]) -> list[float] | None:
    """CPU-hours spent to reach each point of one curve (its launches' CPU time summed, sampling included; the
    calibrated start at 0), or None when a point lacks its launch's time."""
    spent, hours = 0.0, []
    for p in rows:
        if p["tokens"] and "chunk_cpu_s" not in p:
            return None
        spent += p.get("chunk_cpu_s", 0.0)
        hours.append(spent / 3600)
    return hours


LINE_STYLES = ("-", "--", ":", "-.")


def plot(curve: Path, path: Path, compare: list[Path] = ()) -> Path:
    """Ratio, KL and top-1 agreement (an encoder: cosine, neighbours, rank correlation) against training tokens (log
    x; 0 sits on the linear part of a symlog axis), the first against CPU-hours too, and the ratio on ``--other-data``
    where points have it; one colour a method and training text, one line style a norm (solid ELN, dashed DyT, dotted
    Derf: the order of ``modules.METHODS``). ``compare``: other curves' JSON lines drawn beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for file in (curve, *compare) for p in read_points(file)]
    metrics = METRICS if all(metrics_of(p) is METRICS for p in points) else ENCODER_METRICS
    curves = series([p for p in points if metrics_of(p) is metrics])
    first = next(iter(metrics))
    other = next((p["other"]["data"] for rows in curves.values() for p in rows if "other" in p), None)
    panels = [*metrics.items(), ("cpu", f"{metrics[first]}, against CPU-hours")]
    if other:
        panels.append(("other", f"{metrics[first]} on {other}"))
    colours = {label: f"C{i}" for i, label in enumerate(sorted({label for _, label in curves}))}
    positive = [p["tokens"] for rows in curves.values() for p in rows if p["tokens"] > 0]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    for (norm, label), rows in curves.items():
        style, colour = LINE_STYLES[list(NORMS).index(norm) % len(LINE_STYLES)], colours[label]
        for ax, (key, _) in zip(axes, panels):
            if key == "cpu":
                x, y = cpu_hours(rows), [p[first] for p in rows]
            elif key == "other":
                kept = [p for p in rows if "other" in p]
                x, y = [p["tokens"] for p in kept], [p["other"][first] for p in kept]
            else:
                x, y = [p["tokens"] for p in rows], [p[key] for p in rows]
            if x:
                ax.plot(x, y, style, marker="o", ms=3, c=colour, label=f"{norm.upper()} {label}")
    for ax, (key, label) in zip(axes, panels):
        if key != "cpu" and positive:
            ax.set_xscale("symlog", linthresh=min(positive))
        ax.set(xlabel="CPU-hours" if key == "cpu" else "training tokens", ylabel=label)
        ax.grid(alpha=0.3, which="both")
        if key in (first, "cpu", "other") and first == "ratio":
            ax.set_yscale("log")
    axes[0].axhline(GOALS[first], c="k", ls=":", lw=0.8, label=f"goal {GOALS[first]}")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.suptitle(f"Recovery per training token ({', '.join(map(str, (curve, *compare)))})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * (1 + len(labels) // 3), 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def unreadable(spec: str | None) -> str | None:
    """Why a text spec cannot be read, checked as the recipe checks it before any model loads; None when it can."""
    if not spec:
        return "give a text file, builtin:..., generated... or a Hub dataset"
    try:
        check_spec(spec)
    except DataError as error:
        return str(error)
    return None


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "smollm2-eln.yaml"))
    parser.add_argument("--norms", nargs="+", default=["eln", "dyt"], choices=list(NORMS))
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
    parser.add_argument("--other-data", metavar="SPEC",
                        help="a second evaluation text, read by neither calibration nor training (e.g. "
                             "builtin:evaluation): each point is also scored on it (a language model)")
    add_threads(parser)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per launch of the recipe")
    add_output(parser, "out/recovery", "folder for the runs, the rows and the plot")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--compare", nargs="+", default=[], metavar="OUT",
                        help="other --out directories whose curves are drawn beside this one's")
    args = parser.parse_args(argv)
    if not args.plot_only:
        texts = (("--train-data", args.train_data), ("--eval-data", args.eval_data),
                 *((("--other-data", args.other_data),) if args.other_data else ()))
        problems = [f"{name}: {problem}" for name, value in texts if (problem := unreadable(value))]
        if problems:
            parser.error("; ".join(problems))
        if not Path(args.config).is_file():
            parser.error(f"--config {args.config}: no such file")
        if args.schedule in DECAYING and len([b for b in args.budgets if b > 0]) > 1 and not args.run_per_budget:
            parser.error(f"--schedule {args.schedule} decays over the run's length, so extending a run budget by "
                         "budget would change the steps already taken: give --run-per-budget")
        tapered = [m for m in args.methods if any(o.startswith("taper.fraction=") and o != "taper.fraction=0"
                                                  for o in [*METHODS[m], *args.set])]
        if tapered and len([b for b in args.budgets if b > 0]) > 1 and not args.run_per_budget:
            parser.error(f"{tapered[0]}: the taper falls over a share of the run's length, so extending a run budget "
                         "by budget would change the steps already taken: give --run-per-budget")
        measure(args)
    curve = Path(args.out) / "curve.jsonl"
    if not read_points(curve):
        print(f"[bench_recovery] no points in {curve} yet", flush=True)
        return 0
    compare = [Path(other) / "curve.jsonl" for other in args.compare]
    print(f"[bench_recovery] {plot(curve, Path(args.out) / 'curve.png', compare)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
