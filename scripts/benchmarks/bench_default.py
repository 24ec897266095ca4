"""The first command as a user types it: ``normswap convert MODEL --to METHOD --output OUT`` with no other flag (the
default calibration, ``hf_normswap/calibration/defaults.py``), and with ``--calib none``, then scored against the
original with ``normswap eval``.

    python scripts/benchmarks/bench_default.py --out out/bench-default               # SmolLM2 and MiniLM, ELN and DyT
    python scripts/benchmarks/bench_default.py --out out/bench-default --models smollm2 --methods eln --starts default
    python scripts/benchmarks/bench_default.py --out out/sweep --sweep '{"tune_steps": 60}' \\
        '{"data": "generated:...,seed=1"}'

Each conversion runs in its own process, timed as ``/usr/bin/time`` does (wall, user + system CPU of the process
and its children, their peak RSS), with the machine's thread count unless ``--threads``. The samples the default
draws are cached in ``OUT/sample-cache`` (``HF_NORMSWAP_CACHE``), removed first, so every default run samples as a
new user's first run does. Scores: a language model's perplexity ratio, KL and top-1 agreement on
``builtin:evaluation`` (``--max-tokens``, 512-token windows); an encoder's mean embedding cosine on ``builtin``.
``--sweep``: what the default's budget buys on SmolLM2, in one process: each JSON object sets ``CalibrationConfig``
fields over the default's (``data`` among them), the conversion scored as above; calibration CPU seconds (one thread
unless ``--threads``; sampling included when the samples are not yet cached).
``OUT/results.json`` holds the machine, the commit, each row's commands and numbers, written after every row.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_models, add_output, add_threads, script_parser
from harness.record import commit, machine

MODELS = {"smollm2": "offline:smollm2", "minilm": "offline:minilm"}
STARTS = {"default": [], "none": ["--calib", "none"]}


def run(command: list[str], env: dict, log: Path) -> dict:
    """Runs ``normswap ARGS`` (``command``) with this Python, its output into ``log``; returns its wall and CPU
    seconds and peak RSS, as ``/usr/bin/time`` (``os.wait4``: this process's own usage). Fails loudly on a non-zero
    exit."""
    start = time.perf_counter()
    with log.open("w") as stream:
        process = subprocess.Popen([sys.executable, "-m", "hf_normswap.cli", *command[1:]], stdout=stream,
                                   stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if process.returncode:
        sys.exit(f"bench_default: {' '.join(command)} exited {process.returncode}; see {log}")
    return dict(wall_s=round(wall, 1), cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
                peak_rss_mb=round(usage.ru_maxrss / 1024))


def score(model: str, original: str, tokens: int, env: dict, log: Path) -> dict:
    """The converted model against the original, as ``normswap eval --json`` reports it."""
    command = ["normswap", "eval", model, "--against", original, "--data",
               "builtin" if original == MODELS["minilm"] else "builtin:evaluation", "--max-tokens", str(tokens),
               "--max-length", "512", "--no-tails", "--json"]
    run(command, env, log)
    text = log.read_text()
    return dict(json.loads(text[text.index("{"):]), command=" ".join(command))


def sweep(variants: list[dict], method: str, tokens: int, out: Path, results: dict) -> None:
    """The default calibration of SmolLM2 with each variant's fields over it, scored against the original."""
    import copy

    # internal: the default calibration as convert picks it and the texts as normswap eval reads them;
    # imported here, as only --sweep runs in this process
    import hf_normswap
    from hf_normswap.calibration.defaults import default_calibration
    from hf_normswap import PerplexitySettings, evaluate, load_model
    from hf_normswap.evaluation.documents import evaluation_texts

    original, tokenizer = load_model(MODELS["smollm2"])
    texts = evaluation_texts("builtin:evaluation", original, tokenizer, tokens)
    for variant in variants:
        model = copy.deepcopy(original)
        sizes = {key: variant[key] for key in ("num_blocks", "block_len") if key in variant}
        config, _ = default_calibration(model, tokenizer, **sizes)
        for key, value in variant.items():
            setattr(config, key, value)
        config.progress = False
        start = time.process_time()
        hf_normswap.convert(model, method, calibration=config)
        cpu = time.process_time() - start
        scored = evaluate(model, tokenizer, texts, against=original,
                          settings=PerplexitySettings(max_length=512, max_tokens=tokens, progress=False))
        row = dict(method=method, variant=variant, ratio=round(scored.ratio("converted"), 2),
                   kl=round(scored.kl["converted"], 3), calibration_cpu_s=round(cpu))
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(row), flush=True)
        del model


def main() -> None:
    parser = script_parser(__doc__)
    add_output(parser, "out/bench-default", "folder for each command's output and the rows")
    add_models(parser, MODELS, MODELS, listed=True)
    parser.add_argument("--methods", nargs="+", default=["eln", "dyt"])
    parser.add_argument("--starts", nargs="+", default=list(STARTS), choices=list(STARTS))
    add_threads(parser, None)
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens scored (MiniLM: twice as many)")
    parser.add_argument("--sweep", nargs="+", type=json.loads, metavar="JSON",
                        help="SmolLM2 with these CalibrationConfig fields over the default, in this process")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        import torch

        torch.set_num_threads(args.threads or 1)
        os.environ.setdefault("HF_NORMSWAP_CACHE", str(out / "sample-cache"))
        results = dict(machine=machine(), commit=commit(), rows=[])
        for method in args.methods:
            sweep([{}, *args.sweep], method, args.max_tokens, out, results)
        return
    cache = out / "sample-cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_NORMSWAP_CACHE=str(cache))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    results = dict(machine=machine(), commit=commit(), rows=[])
    for name in args.models:
        for start in args.starts:
            for method in args.methods:
                label = f"{name}-{method}-{start}"
                shutil.rmtree(cache, ignore_errors=True)  # a first run samples
                target = out / label
                convert = ["normswap", "convert", MODELS[name], "--to", method, "--output", str(target),
                           "--overwrite", *STARTS[start]]
                usage = run(convert, env, out / f"{label}.log")
                tokens = args.max_tokens * (2 if name == "minilm" else 1)
                scored = score(str(target), MODELS[name], tokens, env, out / f"{label}-eval.log")
                row = dict(model=name, method=method, start=start, command=" ".join(convert), **usage,
                           check=next((line for line in (out / f"{label}.log").read_text().splitlines()
                                       if line.startswith("check:")), None),
                           evaluation=scored)
                results["rows"].append(row)
                (out / "results.json").write_text(json.dumps(results, indent=1))
                print(json.dumps({k: row[k] for k in ("model", "method", "start", "wall_s", "cpu_s")}), flush=True)


if __name__ == "__main__":
    main()
