"""The calibration flags of ``convert`` and ``sensitivity``: each names a field of a job's calibration section
(``conversion.CalibrationSettings``), read into a checked ``CalibrationConfig`` before any load."""

from __future__ import annotations

import argparse

from ..calibration.calibrate import DEFAULT_STRATEGY, STRATEGIES, CalibrationConfig, strategy_help
from ..conversion.calibration_settings import CalibrationSettings
from ..precision import PRECISIONS



def calibration_args(parser: argparse.ArgumentParser) -> None:
    defaults = CalibrationConfig()
    parser.epilog = strategy_help()  # one line per strategy, kept as written
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    group = parser.add_argument_group("calibration (fit alpha/beta to real activations; see calibrate.py)")
    group.add_argument("--calib", metavar="SPEC",
                       help="calibration text: 'builtin' (offline, ships with Python), local txt/json/jsonl/parquet "
                            "files, a Hub dataset name[:config][:split], or generated[:options] (the original's "
                            "samples); 'none': no calibration, the analytic start (each norm's input scale measured "
                            "on random token ids, or --input-scale). Default: 16 x 128 tokens of the original's "
                            "samples (an encoder: of builtin text)")
    group.add_argument("--calib-blocks", type=int, metavar="N",
                       help=f"calibration blocks (default: {defaults.num_blocks} with --calib, 16 without)")
    group.add_argument("--calib-len", type=int, metavar="L",
                       help=f"tokens per block (default: {defaults.block_len} with --calib, 128 without, or the "
                            "model's context when shorter)")
    group.add_argument("--strategy", choices=[DEFAULT_STRATEGY, *STRATEGIES],
                       help=f"calibration strategy, listed at the end (default: {DEFAULT_STRATEGY})")
    group.add_argument("--max-tokens-per-norm", type=int, metavar="K",
                       help=f"token vectors kept per norm, the memory cap (default: {defaults.max_tokens_per_norm})")
    group.add_argument("--plots", metavar="DIR", help="write one fit plot per norm (PNG) into DIR")
    block = STRATEGIES["block"]
    group.add_argument("--block-weights-lr", type=float, metavar="LR",
                       help="block-wise reconstruction: the block strategy's tuning also fits each block's own weights "
                            f"at this rate; 0: the norms' parameters only (default: {block.block_weights_lr:g})")
    group.add_argument("--block-steps", type=int, metavar="N",
                       help=f"Adam steps a block of the block strategy's tuning; more give a closer start for more "
                            f"time (default: {block.block_steps})")
    group.add_argument("--block-rows", type=int, metavar="N",
                       help=f"sequences per step of the block strategy's tuning (default: {block.block_rows})")
    group.add_argument("--calib-device", metavar="DEVICE",
                       help="where the block strategy computes, one block at a time, the rest of the model staying in "
                            "CPU memory (e.g. cuda; default: where the model is)")
    group.add_argument("--calib-cache-mb", type=float, metavar="MB",
                       help="CPU memory for the hidden states cached between blocks; the rest goes to files in TMPDIR, "
                            "removed after (default: no limit)")
    group.add_argument("--precision", choices=PRECISIONS,
                       help="forward / backward passes of calibration in fp32, bf16 autocast, or auto: bf16 where a "
                            f"timed probe finds it faster on this machine (default: {defaults.precision})")


def calibration_settings(args) -> CalibrationSettings:
    """The calibration flags given, as a job's calibration section (``--calib none`` kept: the analytic start)."""
    flags = {"data": args.calib, "num_blocks": args.calib_blocks, "block_len": args.calib_len,
             "strategy": args.strategy, "max_tokens_per_norm": args.max_tokens_per_norm, "plots": args.plots,
             "precision": args.precision, "block_weights_lr": args.block_weights_lr, "block_steps": args.block_steps,
             "block_rows": args.block_rows, "device": args.calib_device, "cache_memory_mb": args.calib_cache_mb}
    return CalibrationSettings(**{name: value for name, value in flags.items() if value is not None})


def check_calibration_args(args) -> None:
    """Flag mistakes that need no model, so they fail before the (slow) load; numbers are checked even unused."""
    calibration_settings(args).check_calibration(getattr(args, "input_scale", None))


def calibration(args, model, tokenizer) -> CalibrationConfig | None:
    """The calibration the flags ask for (``CalibrationSettings.calibration_for``)."""
    return calibration_settings(args).calibration_for(model, tokenizer)
