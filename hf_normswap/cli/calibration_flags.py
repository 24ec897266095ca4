"""The calibration flags of ``convert`` and ``sensitivity``: each names a ``CalibrationConfig`` field, and the flags
given are read into one by the settings reader (``hf_normswap.settings``) and checked by
``CalibrationConfig.resolved``, before any load: the config's own checks, named by the flag."""

from __future__ import annotations

import argparse
import sys

from ..calibration.calibrate import DEFAULT_STRATEGY, STRATEGIES, CalibrationConfig, strategy_help
from ..calibration.defaults import NONE, default_calibration
from ..surgery import ConversionError
from ..precision import PRECISIONS
from ..settings import read_settings
from ..validation import check_output_folder

# CalibrationConfig field -> the flag that sets it
FLAGS = {"data": "--calib", "num_blocks": "--calib-blocks", "block_len": "--calib-len", "strategy": "--strategy",
         "max_tokens_per_norm": "--max-tokens-per-norm", "plots": "--plots", "precision": "--precision",
         "block_weights_lr": "--block-weights-lr", "block_steps": "--block-steps", "block_rows": "--block-rows",
         "device": "--calib-device", "cache_memory_mb": "--calib-cache-mb"}
BLOCK_ONLY = ("block_weights_lr", "block_rows", "block_steps")  # settings of the block strategy alone
NEEDS_DATA = ("plots", "strategy", "device", "cache_memory_mb", *BLOCK_ONLY)


def _dest(field: str) -> str:
    return FLAGS[field].lstrip("-").replace("-", "_")


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
    group.add_argument("--max-tokens-per-norm", type=int, default=defaults.max_tokens_per_norm, metavar="K",
                       help="token vectors kept per norm, the memory cap (default: %(default)s)")
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
    group.add_argument("--precision", choices=PRECISIONS, default=defaults.precision,
                       help="forward / backward passes of calibration in fp32, bf16 autocast, or auto: bf16 where a "
                            "timed probe finds it faster on this machine (default: %(default)s)")


def _given(args) -> dict:
    given = {field: getattr(args, _dest(field)) for field in FLAGS if getattr(args, _dest(field)) is not None}
    if given.get("data") == NONE:
        del given["data"]
    return given


def calibration_config(args, tokenizer=None) -> CalibrationConfig:
    """The flags as a checked ``CalibrationConfig`` (``--calib`` absent: the default data, for the checks alone)."""
    config = read_settings(CalibrationConfig, _given(args), labels=FLAGS, check=CalibrationConfig.resolved)
    config.tokenizer = tokenizer
    return config


def check_calibration_args(args) -> None:
    """Flag mistakes that need no model, so they fail before the (slow) load; numbers are checked even unused."""
    calibration_config(args)
    given = _given(args)
    if getattr(args, "input_scale", None) is not None and args.calib != NONE:
        raise ConversionError("--input-scale sets the analytic start: add --calib none (calibration measures the "
                              "scales itself)")
    if args.calib == NONE:
        for field in NEEDS_DATA:
            if field in given:
                raise ConversionError(f"{FLAGS[field]} needs calibration: drop --calib none")
    for field in BLOCK_ONLY:
        if field in given and args.strategy not in (None, DEFAULT_STRATEGY, "block"):
            raise ConversionError(f"{FLAGS[field]} needs the block strategy, not {args.strategy}")
    if args.plots:
        check_output_folder(args.plots, "--plots")


def calibration(args, model, tokenizer) -> CalibrationConfig | None:
    """The calibration the flags ask for: None for ``--calib none`` (the analytic start), the given text, or without
    ``--calib`` the default (``calibration.defaults``), said in one line."""
    if args.calib == NONE:
        return None
    if not args.calib:
        given = _given(args)
        config, line = default_calibration(model, tokenizer, **given)
        print(line or "no tokenizer: the start measured on random token ids, uncalibrated; --calib DATA with a "
                      "tokenizer calibrates", file=sys.stderr)  # stdout is the result's (--json)
        return config
    if tokenizer is None:
        raise ConversionError("--calib needs a model with a tokenizer")
    return calibration_config(args, tokenizer)
