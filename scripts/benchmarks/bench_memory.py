"""The memory plan (``hf_normswap.planning``) against the measured peak resident memory of each process (VmHWM).

One case at a time, each in fresh processes (OMP_NUM_THREADS=1, glibc returning freed tensors to the OS as in
bench_sharding.py), with tiny step budgets: memory depends on the shapes, not on how long a run lasts.

    python scripts/benchmarks/bench_memory.py --out out/bench-memory                      # every case
    python scripts/benchmarks/bench_memory.py --out out/bench-memory --cases runtime calibration-smollm2
    python scripts/benchmarks/bench_memory.py --out out/bench-memory --replan   # the plan's predictions made again

Cases:
- ``runtime``: a process that has imported what the recipe imports, no model (the plan's ``RUNTIME_BYTES``);
- ``calibration-smollm2``: SmolLM2-135M (``offline:smollm2``, real weights) converted to ELN with the ``block``
  strategy on ``wiki.valid.tokens`` (../shared), as ``normswap convert`` does;
- ``calibration-llama1b``: the same on a Llama-3.2-1B-shaped model with random weights, built from its config and
  saved as sharded safetensors in a temporary folder (removed afterwards), on random token ids;
- ``recipe-{ddp,fsdp2}-{all,norms}``: recipes/finetune.py on 2 processes over gloo (accelerate launch), SmolLM2
  converted analytically (no calibration in the run), logit KL and the layer-wise term, fp32;
- ``recipe-single-all``: the same recipe in one process (``python recipes/finetune.py``), against which each
  two-process case's memory at start is put;
- ``recipe1b-fsdp2-norms``: the same on a Llama-3.2-1B-shaped model with random weights (converted analytically,
  SmolLM2's tokenizer), the one 1B recipe that fits this machine by the plan;
- ``start1b-{single,fsdp2}-norms``: the 1B recipe stopped where training would start. For either size,
  ``start_sum`` is the largest total resident set of all its processes at once before training begins (the
  ``load`` phase: the models loaded, the first evaluation, the training rows, the teacher sharded), ``start_ratio``
  that total over the single process's, ``start_ratio_models`` the same with each process's runtime
  (``RUNTIME_BYTES``) taken off; ``start_sum_pss`` and ``start_ratio_pss`` the same in proportional sets
  (``harness.memory.proportional``: the libraries both processes map counted once).

``OUT/results.json`` holds the machine, the commit, each case's command, predicted and measured peaks per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, script_parser
from harness.memory import memory_environment, phase_sampler, recipe_by_phase
from harness.record import ROOT, commit, machine
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"
LAUNCHERS = {"ddp": ["--multi_gpu"],
             "fsdp2": ["--config_file", str(ROOT / "recipes" / "accelerate_configs" / "fsdp2.yaml")]}
# Llama-3.2-1B's published shape (tied embeddings)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=True)
# tiny budgets: shapes as the defaults, few steps (fewer tokens at 1B: one core's minutes)
CALIBRATION = {"calibration-smollm2": dict(num_blocks=8, block_len=256, batch_size=4, block_steps=2, block_rows=1,
                                           tune_steps=2, tune_blocks=4),
               "calibration-llama1b": dict(num_blocks=2, block_len=64, batch_size=2, block_steps=2, block_rows=1,
                                           tune_steps=2, tune_blocks=2)}
RECIPE_BLOCK, RECIPE_STEPS, EVAL_LENGTH = 256, 2, 256


def peak_rss() -> int:
    """This process's peak resident set (VmHWM of /proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ------------------------------------------------------------------------------------------- inside the processes


def runtime_worker() -> dict:
    import accelerate, datasets, torch, transformers  # noqa: F401, E401  what the recipe imports
    from transformers import Trainer  # noqa: F401

    # internal: the modules the recipe imports, whose memory is the runtime's
    import hf_normswap.calibration.calibrate  # noqa: F401
    import hf_normswap.training.trainer  # noqa: F401
    return {"peak": peak_rss()}


def marked(owner, name: str, phase: list[str], label: str) -> None:
    """Make ``owner.name`` set ``phase[0] = label`` while it runs."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        phase[0] = label
        return function(*args, **kwargs)
    setattr(owner, name, wrapper)


def calibration_worker(case: str, model: str, data: str) -> dict:
    import torch

    # internal: calibration's block pass and end-to-end steps, each phase marked; imported in the worker, whose memory
    # is what is measured
    import hf_normswap
    from hf_normswap.calibration import block_pass, end_to_end
    from hf_normswap import CalibrationConfig, load_model

    torch.set_num_threads(1)
    settings = CALIBRATION[case]
    phase, peaks, done = ["load"], {}, threading.Event()
    marked(end_to_end, "teacher_outputs", phase, "calibration: block pass")  # the original's logits come first
    marked(end_to_end, "tune", phase, "calibration: end-to-end steps")
    marked(block_pass, "sequential", phase, "calibration: block pass")
    sampler = phase_sampler(phase, peaks, done)
    loaded, tokenizer = load_model(model)
    if data == "random":
        generator = torch.Generator().manual_seed(0)
        data = torch.randint(0, loaded.config.vocab_size, (settings["num_blocks"], settings["block_len"]),
                             generator=generator)
    start = time.time()
    hf_normswap.convert(loaded, to="eln", calibration=CalibrationConfig(data=data, tokenizer=tokenizer,
                                                                         progress=False, **settings))
    done.set()
    sampler.join()
    return {"peak": peak_rss(), "calibration_seconds": round(time.time() - start, 1), "phases": peaks}


def recipe_worker(out: Path, recipe_args: list[str], start_only: bool) -> int:
    timeline = []
    code, peaks = recipe_by_phase(recipe_args, "training step", "final evaluation and save", timeline,
                                  stop_at_training=start_only)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps({"peak": peak_rss(), "phases": peaks,
                                                                          "load_timeline": timeline}))
    return code


# ------------------------------------------------------------------------------------------------------ the cases


def run_python(code: str, *args: str) -> dict:
    """The JSON that ``python -c code args`` prints last, in a fresh process."""
    return _run_process([sys.executable, "-c", code, *args])


def run_worker(function: str, *args: str) -> dict:
    """The JSON of one of this file's workers, run in a fresh process (``bench_memory.py --call FUNCTION ARGS``)."""
    return _run_process([sys.executable, str(Path(__file__).resolve()), "--call", function, *args])


def _run_process(command: list[str]) -> dict:
    result = subprocess.run(command, cwd=ROOT, env=memory_environment(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"case failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def random_llama(folder: Path) -> Path:
    """A Llama-3.2-1B-shaped model with random weights, fp32, in sharded safetensors, built once in its own process."""
    if not (folder / "config.json").exists():
        code = ("import sys, torch, transformers; torch.manual_seed(0)\n"
                f"config = transformers.LlamaConfig(**{LLAMA_1B!r})\n"
                "model = transformers.LlamaForCausalLM(config)\n"
                "model.save_pretrained(sys.argv[1], max_shard_size='1GB')\n")
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, cwd=ROOT, env=memory_environment())
    return folder


def converted(original: str | Path, folder: Path) -> Path:
    """``original`` converted to ELN with the start measured in one forward pass (no calibration), saved once with
    SmolLM2's tokenizer: the recipe's start (the recipe needs a tokenizer; SmolLM2's ids fit the 1B vocabulary)."""
    if not (folder / "config.json").exists():
        code = ("import sys, hf_normswap\nfrom hf_normswap.checkpoint.loading import load_model\n"
                "model, _ = load_model(sys.argv[1], with_tokenizer=False)\n"
                "_, tokenizer = load_model('offline:smollm2', empty=True)\n"
                "hf_normswap.convert(model, to='eln', calibration=None)\n"
                "hf_normswap.save_pretrained(model, sys.argv[2], tokenizer=tokenizer, overwrite=True)\n")
        subprocess.run([sys.executable, "-c", code, str(original), str(folder)], check=True, cwd=ROOT,
                       env=memory_environment())
    return folder


def prediction(name: str) -> tuple[list[int], dict[str, list[int]]]:
    """The plan's peaks of a case (one per process) and its phases' host bytes (main, other)."""
    import transformers

    # internal: the plan's predictions, checked against the measurements
    from hf_normswap.planning import plan
    from hf_normswap.planning.phases import RUNTIME_BYTES

    if name == "runtime":
        return [RUNTIME_BYTES], {}
    if name.startswith("calibration"):
        model = "offline:smollm2" if name == "calibration-smollm2" else transformers.LlamaConfig(**LLAMA_1B)
        result = plan(model, **calibration_settings(name))
        return [result.conversion_peak()["host_main"]], {p.name: [p.host_main] for p in result.conversion}
    size, mode, trainable = name.split("-")
    processes, mode = (1, "ddp") if mode == "single" else (2, mode)
    model = "offline:smollm2" if size == "recipe" else transformers.LlamaConfig(**LLAMA_1B)
    result = plan(model, processes=processes, sharding=mode, trainable=trainable, seq_len=RECIPE_BLOCK,
                  eval_len=EVAL_LENGTH, calibrate=False)
    peak = result.peak()
    if size == "start1b":  # stopped where training starts: the load phase is the run
        load = next(p for p in result.recipe if p.name == "load")
        peak = {"host_main": load.host_main, "host_other": load.host_other}
    if processes == 1:
        return [peak["host_main"]], {p.name: [p.host_main] for p in result.recipe}
    return [peak["host_main"], peak["host_other"]], {p.name: [p.host_main, p.host_other] for p in result.recipe}


def replan(results: dict) -> dict:
    """``results`` with every case's prediction made again by the plan as it is now (the measurements kept)."""
    for case in results["cases"]:
        case["predicted"], phases = prediction(case["case"])
        for phase, values in phases.items():
            case.setdefault("phases", {}).setdefault(phase, {})["predicted"] = values
        case["ratio"] = [round(p / m, 3) for p, m in zip(case["predicted"], case["measured"])]
    start_ratios(results)
    return results


def start_ratios(results: dict) -> None:
    """Each two-process recipe case's memory at start (every process's peak before training, summed) over the
    single process's of its size (``recipe-single-all``, ``start1b-single-norms``), whole and with each process's
    runtime taken off."""
    from hf_normswap.planning.phases import RUNTIME_BYTES  # internal: each process's runtime as the plan counts it

    singles = {case["case"].split("-")[0]: (case.get("start_sum"), case.get("start_sum_pss"))
               for case in results["cases"] if "-single-" in case["case"]}
    for case in results["cases"]:
        if case.get("start_sum") is not None:  # the plan's load phase on every process (one main, the others alike)
            load = case["phases"]["load"]["predicted"]
            case["start_predicted"] = load[0] + (len(case["measured"]) - 1) * load[-1]
            case["start_ratio_predicted"] = round(case["start_predicted"] / case["start_sum"], 3)
        single, single_pss = singles.get(case["case"].split("-")[0], (None, None))
        if case.get("start_sum") is None or not single or "-single-" in case["case"]:
            continue
        processes = len(case["measured"])
        case["start_ratio"] = round(case["start_sum"] / single, 3)
        case["start_ratio_models"] = round((case["start_sum"] - processes * RUNTIME_BYTES) / (single - RUNTIME_BYTES), 3)
        if case.get("start_sum_pss") and single_pss:
            case["start_ratio_pss"] = round(case["start_sum_pss"] / single_pss, 3)


def calibration_settings(case: str) -> dict:
    c = CALIBRATION[case]
    return dict(calibration_blocks=c["num_blocks"], calibration_len=c["block_len"], calibration_batch=c["batch_size"],
                tune_rows=c["tune_blocks"], block_rows=c["block_steps"] * c["block_rows"])


def calibration_case(name: str, work: Path) -> dict:
    if name == "calibration-smollm2":
        model, data = "offline:smollm2", str(WIKITEXT)
    else:
        model, data = str(random_llama(work / "llama-1b")), "random"
    measured = run_worker("calibration_worker", name, model, data)
    return {"case": name, "command": f"hf_normswap.convert({model}, 'eln', {CALIBRATION[name]})",
            "phases": {phase: {"measured": [peak]} for phase, peak in measured["phases"].items()},
            "measured": [measured["peak"]],
            "calibration_seconds": measured["calibration_seconds"]}


def recipe_case(name: str, work: Path, out: Path) -> dict:
    size, mode, trainable = name.split("-")
    original = "offline:smollm2" if size == "recipe" else random_llama(work / "llama-1b")
    start = converted(original, work / ("converted" if size == "recipe" else "converted-1b"))
    run_dir = out / name
    recipe_args = [f"model={start}", f"original={original}", "method=eln", f"trainable={trainable}",
                   "precision=fp32", "distill.weight=1", "distill.hidden=10", "progressive.enabled=false",
                   f"block_len={RECIPE_BLOCK}", "eval_blocks=1", "final_eval.max_tokens=512",
                   f"final_eval.max_length={EVAL_LENGTH}", f"output_dir={run_dir}", "resume=false", "threads=1",
                   f"training.max_steps={RECIPE_STEPS}", "training.per_device_train_batch_size=1",
                   "training.logging_steps=1", "training.save_strategy=no", "training.report_to=none",
                   "training.disable_tqdm=true"]
    until = "start" if size == "start1b" else "end"  # stopped where training would start, or run whole
    worker = [str(Path(__file__).resolve()), "--worker", str(run_dir / "memory"), until, "--", *recipe_args]
    command = [sys.executable, *worker] if mode == "single" else [
        sys.executable, "-m", "accelerate.commands.launch", *LAUNCHERS[mode], "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", *worker]
    result = subprocess.run(command, cwd=ROOT, env=memory_environment(), capture_output=True, text=True)
    (out / f"{name}.log").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{name} failed (see {out / f'{name}.log'}):\n{result.stderr[-3000:]}")
    sharded = any(line.startswith("[sharding]") for line in result.stdout.splitlines())
    if sharded != (mode == "fsdp2"):
        raise SystemExit(f"{name}: the log {'has' if sharded else 'lacks'} the shard units: not {mode}")
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "memory").glob("rank*.json"))]
    phases = sorted({phase for r in ranks for phase in r.get("phases", {})})
    start_sum, start_sum_pss = (peak_of_sum([r["load_timeline"] for r in ranks], column) for column in (1, 2))
    launcher = "python" if mode == "single" else "accelerate launch " + " ".join(LAUNCHERS[mode]) + " --num_processes 2"
    return {"case": name, "command": f"{launcher} recipes/finetune.py " + " ".join(recipe_args[3:]), "measured": [r["peak"] for r in ranks],
            "phases": {phase: {"measured": [r.get("phases", {}).get(phase) for r in ranks]} for phase in phases},
            "start_sum": start_sum, "start_sum_pss": start_sum_pss}


def peak_of_sum(timelines: list[list[tuple[float, int, int]]], column: int = 1) -> int:
    """The largest total of all processes at once (``column`` of the samples: 1 resident, 2 proportional) while any
    is still before training: at each sample of any process, the sum of every process's latest sample (a process
    not yet sampled, or already training, counts its first or last sample of the phase)."""
    events = sorted((sample[0], rank, sample[column]) for rank, timeline in enumerate(timelines) for sample in timeline)
    latest = [timeline[0][column] if timeline else 0 for timeline in timelines]
    peak = sum(latest)
    for _, rank, value in events:
        latest[rank] = value
        peak = max(peak, sum(latest))
    return peak


CASES = ["runtime", "calibration-smollm2", "calibration-llama1b", "recipe-single-all", "recipe-ddp-all",
         "recipe-ddp-norms", "recipe-fsdp2-all", "recipe-fsdp2-norms", "recipe1b-fsdp2-norms", "start1b-single-norms",
         "start1b-fsdp2-norms"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return recipe_worker(Path(argv[1]), argv[4:], start_only=argv[2] == "start")
    if argv[:1] == ["--call"]:
        print(json.dumps({"calibration_worker": calibration_worker, "runtime_worker": runtime_worker}[argv[1]](*argv[2:])))
        return 0
    parser = script_parser(__doc__)
    add_output(parser, "out/bench-memory", "folder for the runs and the rows")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--replan", action="store_true",
                        help="measure nothing: predict OUT/results.json's cases again with the plan as it is now")
    args = parser.parse_args(argv)
    if args.replan:
        path = Path(args.out) / "results.json"
        path.write_text(json.dumps(replan(json.loads(path.read_text())), indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join([Path(sys.argv[0]).name, *argv]), "cases": []}
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir="/tmp") as work:
        for name in args.cases:
            start = time.time()
            if name == "runtime":
                case = {"case": name, "command": "import the recipe's libraries",
                        "measured": [run_worker("runtime_worker")["peak"]]}
            elif name.startswith("calibration"):
                case = calibration_case(name, Path(work))
            else:
                case = recipe_case(name, Path(work), out)
            case["wall_seconds"] = round(time.time() - start, 1)
            results["cases"].append(case)
            replan(results)
            print(json.dumps(case), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
