"""Per-process peak memory and loss of the recovery recipe (``hf_normswap.training.recipe``) sharded with FSDP2 against
DDP, at the same global batch.

Two CPU processes over gloo (or GPUs, where there are), every weight of SmolLM2 trained against its frozen original
(logit KL and the layer-wise term, fp32), N steps in each mode from one converted start (analytic ELN, no
calibration, so that both modes start from the same weights):

    python scripts/benchmarks/bench_sharding.py --out out/bench-sharding --steps 4

Modes: ``ddp`` (``--multi_gpu``), ``fsdp2`` (``recipes/accelerate_configs/fsdp2.yaml``, the teacher sharded too) and
``fsdp2-whole-teacher`` (``shard_teacher=false``). Each process of a run samples its resident memory (/proc, every
20 ms) by phase (load, training, after training: gathering, final evaluation, save, reload check) and records
its lifetime peak (``ru_maxrss``); each run's log must show the shard units (``[sharding] FSDP2: ...``) or, for
DDP, must not, so that no DDP run is counted as sharded. ``OUT/results.json`` holds the machine, the peaks per
process and phase, the training loss of every step of each mode and its largest difference to DDP's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, script_parser
from harness.memory import peak_rss_mb, recipe_by_phase
from harness.record import ROOT, machine

MODES = {"ddp": (["--multi_gpu"], []),
         "fsdp2": (["--config_file", str(ROOT / "recipes" / "accelerate_configs" / "fsdp2.yaml")], []),
         "fsdp2-whole-teacher": (["--config_file", str(ROOT / "recipes" / "accelerate_configs" / "fsdp2.yaml")],
                                 ["shard_teacher=false"])}


def worker(out: Path, recipe_args: list[str]) -> int:
    """One process of a launch: the recipe's main with a resident-memory sampler, peaks written per rank."""
    import hf_normswap

    rank = int(os.environ.get("RANK", 0))
    code, peaks = recipe_by_phase(recipe_args, "training", "after training")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "package": hf_normswap.__file__,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_mb_by_phase": {k: round(v / 2 ** 20, 1) for k, v in peaks.items()}}, indent=1))
    return code


def prepare(out: Path) -> Path:
    """SmolLM2 converted to ELN analytically (no calibration), saved once: the start of every mode."""
    converted = out / "converted"
    if not (converted / "config.json").exists():
        code = ("import sys, hf_normswap\nfrom hf_normswap.checkpoint.loading import load_model\n"
                "model, tokenizer = load_model('offline:smollm2')\nhf_normswap.convert(model, to='eln')\n"
                "hf_normswap.save_pretrained(model, sys.argv[1], tokenizer=tokenizer, overwrite=True)\n")
        subprocess.run([sys.executable, "-c", code, str(converted)], check=True, cwd=ROOT)
    return converted


def launch(mode: str, out: Path, converted: Path, args) -> dict:
    """One mode's recipe run under accelerate, sized by the flags (``args``: steps, processes, batch, block, the
    glibc threshold and the settings), and what its processes measured."""
    steps, batch, block, mmap_threshold = args.steps, args.batch, args.block, args.mmap_threshold
    launcher, extra = MODES[mode]
    run_dir = out / mode
    recipe_args = [f"model={converted}", "original=offline:smollm2", "method=eln", "trainable=all",
                   "precision=fp32", "distill.weight=1", "distill.hidden=10", "progressive.enabled=false",
                   f"block_len={block}", "eval_blocks=2", "final_eval.max_tokens=1024", "final_eval.max_length=256",
                   f"output_dir={run_dir}", "resume=false", "threads=1", f"training.max_steps={steps}",
                   f"training.per_device_train_batch_size={batch}", "training.logging_steps=1",
                   "training.eval_strategy=steps", f"training.eval_steps={steps}", "training.save_strategy=no",
                   "training.warmup_steps=0", "training.lr_scheduler_type=constant", "training.report_to=none",
                   "training.disable_tqdm=true", *args.set, *extra]
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(args.processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
               str(Path(__file__).resolve()), "--worker", str(run_dir / "memory"), "--", *recipe_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if mmap_threshold:  # glibc then returns every freed tensor to the OS: RSS is live memory, not allocator reserve
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    start = time.time()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    (out / f"{mode}.log").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{mode} failed (see {out / f'{mode}.log'}):\n{result.stderr[-3000:]}")
    shard_lines = [line for line in result.stdout.splitlines() if line.startswith("[sharding]")]
    if bool(shard_lines) != mode.startswith("fsdp2"):
        raise SystemExit(f"{mode}: the log {'lacks' if not shard_lines else 'has'} the shard units: not {mode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "memory").glob("rank*.json"))]
    return {"mode": mode, "wall_seconds": round(time.time() - start, 1), "sharding": shard_lines,
            "package": ranks[0]["package"],
            "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in ranks],
            "peak_rss_mb_by_phase": [r["peak_rss_mb_by_phase"] for r in ranks],
            "loss": [h["loss"] for h in summary["history"] if "loss" in h],
            "final_perplexity_ratio": summary["finetuned"]["ratio"].get("finetuned"),
            "reload_identical": summary["reload_identical"]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]), argv[3:])
    parser = script_parser(__doc__)
    add_output(parser, "out/bench-sharding", "folder for the runs and the rows")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="rows per process and step")
    parser.add_argument("--block", type=int, default=256, help="tokens per row")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe setting for every mode, e.g. training.gradient_checkpointing=true")
    parser.add_argument("--mmap-threshold", type=int, default=65536,
                        help="glibc MALLOC_MMAP_THRESHOLD_ of the processes in bytes (0: glibc's dynamic default, "
                             "which keeps freed memory of the load in the heap and counts it in RSS)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    converted = prepare(out)
    runs = {}
    for mode in args.modes:
        runs[mode] = launch(mode, out, converted, args)
        print(json.dumps(runs[mode]), flush=True)
    if "ddp" in runs:
        ddp = runs["ddp"]
        for run in runs.values():
            run["peak_ratio_to_ddp"] = [round(a / b, 3) for a, b in zip(run["peak_rss_mb"], ddp["peak_rss_mb"])]
            run["training_peak_ratio_to_ddp"] = [
                round(a["training"] / b["training"], 3)
                for a, b in zip(run["peak_rss_mb_by_phase"], ddp["peak_rss_mb_by_phase"])]
            run["max_loss_difference_to_ddp"] = max(abs(a - b) for a, b in zip(run["loss"], ddp["loss"]))
    results = {"machine": machine(), "command": " ".join([Path(sys.argv[0]).name, *argv]),
               "steps": args.steps, "processes": args.processes, "global_batch": args.batch * args.processes,
               "block_len": args.block, "malloc_mmap_threshold": args.mmap_threshold, "settings": args.set,
               "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({m: {k: r.get(k) for k in ("peak_rss_mb", "peak_ratio_to_ddp", "training_peak_ratio_to_ddp",
                                               "max_loss_difference_to_ddp")} for m, r in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
