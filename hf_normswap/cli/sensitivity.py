"""``normswap sensitivity``: the damage of each norm converted alone, and the greedy curve; and the quality budget
of ``convert --budget-*``, the largest greedy subset within a limit, searched on a copy."""

from __future__ import annotations

import argparse
import contextlib
import math

from ..checkpoint.loading import load_model
from ..surgery import ConversionError, check_not_converted, plan
from ..data import check_spec
from ..model_inputs import context_length
from ..evaluation import finite_json
from ..evaluation.documents import evaluation_texts
from ..modules import METHODS
from ..validation import check_number, check_output_file
from ..calibration.defaults import NONE
from .calibration_flags import calibration, calibration_args, check_calibration_args
from .common import (
    MODEL_HELP, calibration_overlap, check_context_lengths, placement, placement_args, roles,
    selection_args, warn,
)


def add_parser(commands) -> None:
    from ..evaluation.norm_sensitivity import CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, SENTENCES

    sens = commands.add_parser("sensitivity", help="damage of each norm converted alone, and the greedy curve")
    sens.add_argument("model", help=MODEL_HELP)
    sens.add_argument("--to", required=True, choices=sorted(METHODS), type=str.lower, help="element-wise method")
    sens.add_argument("--data", default="builtin", help="text scored against the original (same forms as `eval "
                      "--data`; default: %(default)s)")
    sens.add_argument("--windows", type=int, default=EVAL_WINDOWS, help="windows of --window-len tokens scored "
                      "(language models; default: %(default)s)")
    sens.add_argument("--window-len", type=int, help=f"tokens per window (default: {EVAL_LEN}, or the model's "
                      "context when shorter)")
    sens.add_argument("--sentences", type=int, default=SENTENCES, help="sentences embedded (encoders; default: "
                      "%(default)s)")
    sens.add_argument("--tune-steps", type=int, default=0, help="end-to-end calibration steps per measurement "
                      "(default: %(default)s; the strategy's own count makes each a full calibration)")
    sens.add_argument("--per-channel", action="store_true", help="as convert: one alpha/beta per channel")
    sens.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sens.add_argument("--plot", metavar="PNG", help="draw per-norm bars by layer and role and the greedy curve")
    sens.add_argument("--log", metavar="JSONL", help="append each measurement to this file as it is made")
    placement_args(sens)
    calibration_args(sens)
    sens.set_defaults(calib_blocks=CALIB_BLOCKS)  # --calib-len unset: CALIB_LEN
    selection_args(sens)


def budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quality budget (convert the largest greedy subset within it; see "
                                      "`normswap sensitivity`)").add_mutually_exclusive_group()
    group.add_argument("--budget-kl", type=float, metavar="X", help="KL(original || converted) at most X nats/token")
    group.add_argument("--budget-ppl-ratio", type=float, metavar="R", help="perplexity at most R times the original's")
    group.add_argument("--budget-cosine", type=float, metavar="C", help="encoders: mean embedding cosine at least C")
    parser.add_argument("--budget-data", default="builtin", help="text the budget is measured on (default: "
                        "%(default)s, the evaluation half)")


def budget(args) -> tuple[str, float] | None:
    for metric in ("kl", "ppl_ratio", "cosine"):
        limit = getattr(args, f"budget_{metric}")
        if limit is not None:
            if not (0 < limit < math.inf) or (metric == "ppl_ratio" and limit < 1) or (metric == "cosine" and limit > 1):
                raise ConversionError(f"--budget-{metric.replace('_', '-')} {limit} is out of range: give a KL > 0, "
                                      "a perplexity ratio >= 1 or a cosine in (0, 1]")
            return metric, limit
    return None


def measurer(args, model, tokenizer, texts, calibration, **slice_options):
    from ..evaluation.norm_sensitivity import Measurer, Reference

    if tokenizer is None:
        raise ConversionError(f"{args.model} has no tokenizer: the sensitivity map needs one to score text")
    reference = Reference(model, tokenizer, texts, **slice_options)
    return Measurer(model, reference, args.to, calibration, roles=roles(args.roles), per_channel=args.per_channel)


def _measured_weights_lr(args) -> float:
    """Block-wise reconstruction in a sensitivity measurement only when asked: the map is the damage of norms
    converted with their blocks' weights as they are, and a few hundred tokens would overfit the weights."""
    return 0.0 if args.block_weights_lr is None else args.block_weights_lr


def select_within_budget(args, model, tokenizer):
    """The budget search on a copy: the map on the sensitivity slice, then a bisection of its greedy curve."""
    from dataclasses import replace

    from ..evaluation.norm_sensitivity import CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, measure_map
    from ..evaluation.norm_sensitivity import select_within_budget as bisect
    from ..model_inputs import ends_in_hidden_states

    metric, limit = budget(args)
    encoder = ends_in_hidden_states(model)
    if (metric == "cosine") != encoder:
        raise ConversionError(f"--budget-{metric.replace('_', '-')} does not apply to {args.model}: use "
                              + ("--budget-cosine for an encoder" if encoder else
                                 "--budget-kl or --budget-ppl-ratio for a model with an output head"))
    measured = calibration(args, model, tokenizer)
    if measured is not None:  # measured cheaply; the final conversion runs the full calibration
        measured = replace(measured, num_blocks=CALIB_BLOCKS, block_len=CALIB_LEN, tune_steps=0, plots=None,
                           block_weights_lr=_measured_weights_lr(args), progress=False)
    texts = evaluation_texts(args.budget_data, model, tokenizer, EVAL_WINDOWS * EVAL_LEN)
    measure = measurer(args, model, tokenizer, texts, measured)
    _, selected, skipped = plan(model, roles(args.roles), args.include, args.exclude)
    found = bisect(measure_map(measure, selected), measure, metric, limit)
    if not found.converted:
        raise ConversionError(f"no norm converts within the budget: {found.kept[0]['reason']}")
    return found, {s["name"]: s["reason"] for s in skipped}


def run(args) -> None:
    from ..evaluation.norm_sensitivity import CALIB_LEN, EVAL_LEN, measure_map, plot

    check_calibration_args(args)
    for flag in ("windows", "window_len", "sentences"):
        if getattr(args, flag) is not None:
            check_number(getattr(args, flag), f"--{flag.replace('_', '-')}", minimum=1)
    check_number(args.tune_steps, "--tune-steps", minimum=0)
    for spec in (args.calib, args.data):
        if spec and spec != NONE:
            check_spec(spec)
    for flag, path in (("--plot", args.plot), ("--log", args.log)):
        if path:
            check_output_file(path, flag)
    model, tokenizer = load_model(args.model, **placement(args))
    check_not_converted(model)
    check_context_lengths(args, model, {"--window-len": args.window_len,
                                        "--calib-len": args.calib_len if args.calib else None},
                          {"--calib": args.calib, "--data": args.data})
    window_len = args.window_len or min(EVAL_LEN, context_length(model) or EVAL_LEN)
    _, selected, _ = plan(model, roles(args.roles), args.include, args.exclude)
    texts = evaluation_texts(args.data, model, tokenizer, args.windows * window_len)
    measured = calibration(args, model, tokenizer)
    if measured is not None:
        measured.block_len = args.calib_len or CALIB_LEN
        measured.tune_steps, measured.progress = args.tune_steps, False
        measured.block_weights_lr = _measured_weights_lr(args)
        warn(calibration_overlap(measured.data, None, args.data, texts))
    measure = measurer(args, model, tokenizer, texts, measured, windows=args.windows, window_len=window_len,
                       sentences=args.sentences)
    with open(args.log, "a") if args.log else contextlib.nullcontext() as log:
        def write(entry: dict) -> None:
            log.write(finite_json.dumps(entry) + "\n")
            log.flush()

        sensitivity = measure_map(measure, selected, log=write if log else None)
    if args.plot:
        plot(sensitivity, args.plot)
    print(finite_json.dumps(sensitivity.to_dict(), indent=2) if args.json else sensitivity.table())
