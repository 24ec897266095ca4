"""What calibration costs: ``convert(..., calibration=...)`` time and peak RSS against plain forward passes over the
same data, each measured in a fresh process, run after run interleaved (forward, calibration, forward, ...).

    python scripts/benchmarks/bench_calibration_cost.py --models smollm2 --calib-strategies fast,block
    python scripts/benchmarks/bench_calibration_cost.py --quick       # a smoke run: tiny GPT-2, 2 blocks
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_normswap import METHODS, CalibrationConfig, convert

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_models
from harness.models import MODELS, load
from harness.timing import PeakRSS, arguments, child_result, log, run_sections, split_list


def calibration_job(args) -> dict:
    """One measurement in this (fresh) process: the plain forward passes over the calibration data, or one
    ``convert`` with calibration (``--calib-job forward`` / ``--calib-job STRATEGY``). Time and peak RSS above the
    loaded model."""
    original, vocab = load(args.models[0], args.layers)
    original.config.use_cache = False
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (args.calib_blocks, args.seq))
    gc.collect()
    with PeakRSS() as memory:
        start = time.perf_counter()
        if args.calib_job == "forward":
            with torch.no_grad():
                for i in range(0, ids.shape[0], args.batch):
                    original(input_ids=ids[i:i + args.batch])
        else:
            config = CalibrationConfig(data=ids, num_blocks=args.calib_blocks, block_len=args.seq,
                                       batch_size=args.batch, strategy=args.calib_job, progress=False)
            convert(original, to=args.methods[0], calibration=config)
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, peak_mib=memory.mib, tokens=ids.numel())


def run_calibration_job(args, model_name: str, job: str) -> dict:
    """:func:`calibration_job` in a child process, so its peak memory is its own."""
    return child_result(__file__, [
        "--calib-job", job, "--models", model_name, "--methods", args.methods[0], "--layers", str(args.layers),
        "--calib-blocks", str(args.calib_blocks), "--seq", str(args.seq), "--batch", str(args.batch)],
        f"calibration job {job}")


def calibration_section(args) -> list[dict]:
    rows = []
    for model_name in args.models:
        for strategy in args.calib_strategies:
            runs = {"forward": [], strategy: []}
            for _ in range(args.calib_reps):  # interleaved: forward passes, then a calibration, and again
                for job in runs:
                    runs[job].append(run_calibration_job(args, model_name, job))
            forward, calib = ({key: statistics.median(r[key] for r in runs[job]) for key in ("seconds", "peak_mib")}
                              for job in ("forward", strategy))
            tokens = runs["forward"][0]["tokens"]
            rows.append(dict(section="calibration", model=model_name, method=args.methods[0], strategy=strategy,
                             tokens=tokens, forward_s=forward["seconds"], calibration_s=calib["seconds"],
                             ratio=calib["seconds"] / forward["seconds"], forward_peak_mib=forward["peak_mib"],
                             calibration_peak_mib=calib["peak_mib"]))
            log(f"{model_name} calibration {strategy:<9} {tokens} tokens: forward passes {forward['seconds']:.2f}s, "
                f"calibration {calib['seconds']:.2f}s ({calib['seconds'] / forward['seconds']:.2f}x), peak RSS above "
                f"the loaded model (fresh process each): forward {forward['peak_mib']:.0f} MiB, calibration "
                f"{calib['peak_mib']:.0f} MiB")
    return rows


def parse_args(argv=None):
    parser = arguments(__doc__, "tiny GPT-2, 2 blocks", None)
    add_models(parser, MODELS, "smollm2,gpt2")
    parser.add_argument("--layers", type=int, default=30, help="smollm2-random: its layers (30, as SmolLM2-135M)")
    parser.add_argument("--methods", default="eln", help=f"the first is converted to: {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--calib-blocks", type=int, default=4)
    parser.add_argument("--calib-strategies", default="fast,block")
    parser.add_argument("--calib-reps", type=int, default=1)
    parser.add_argument("--calib-job", help=argparse.SUPPRESS)  # internal: one calibration measurement (a child)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.calib_blocks = "gpt2", 2
    args.models, args.methods = split_list(args.models), split_list(args.methods)
    args.calib_strategies, args.sections, args.device = split_list(args.calib_strategies), ["calibration"], "cpu"
    return args


def main(argv=None) -> int:
    return run_sections(__file__, parse_args(argv), {"calibration": calibration_section}, argv,
                        children={"calib_job": calibration_job})


if __name__ == "__main__":
    sys.exit(main())
