"""``normswap sensitivity``: the damage of each norm converted alone, and the greedy curve (what a conversion's
quality budget, ``conversion.budget``, searches)."""

from __future__ import annotations

import contextlib

from ..checkpoint.loading import load_model
from ..conversion.job import ConversionJob, Selection
from ..conversion.budget import measured_weights_lr, measurer
from ..conversion.evaluation import calibration_overlap, check_context_lengths, warn
from ..surgery import check_not_converted, plan, split_roles
from ..data import check_spec
from ..model_inputs import ModelFacts, context_length
from ..evaluation import finite_json
from ..evaluation.documents import evaluation_texts
from ..evaluation.norm_sensitivity import (
    CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, SENTENCES, measure_map, plot,
)
from ..modules import METHODS
from ..validation import check_number, check_output_file
from ..calibration.defaults import NONE
from .calibration_flags import calibration, calibration_args, check_calibration_args
from .common import MODEL_HELP, placement, placement_args, selection_args


def add_parser(commands) -> None:
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


def run(args) -> None:
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
    check_context_lengths(args.model, model, {"--window-len": args.window_len,
                                        "--calib-len": args.calib_len if args.calib else None},
                          {"--calib": args.calib, "--data": args.data})
    window_len = args.window_len or min(EVAL_LEN, context_length(model) or EVAL_LEN)
    _, selected, _ = plan(model, split_roles(args.roles), args.include, args.exclude)
    texts = evaluation_texts(args.data, model, tokenizer, args.windows * window_len)
    measured = calibration(args, model, tokenizer)
    if measured is not None:
        measured.block_len = args.calib_len or CALIB_LEN
        measured.tune_steps, measured.progress = args.tune_steps, False
        measured.block_weights_lr = measured_weights_lr(args.block_weights_lr)
        warn(calibration_overlap(measured.data, None, args.data, texts))
    job = ConversionJob(model=args.model, to=args.to, per_channel=args.per_channel,
                        selection=Selection(roles=list(split_roles(args.roles)), include=args.include,
                                            exclude=args.exclude))
    measure = measurer(job, model, ModelFacts.read(model), tokenizer, texts, measured, windows=args.windows,
                       window_len=window_len, sentences=args.sentences)
    with open(args.log, "a") if args.log else contextlib.nullcontext() as log:
        def write(entry: dict) -> None:
            log.write(finite_json.dumps(entry) + "\n")
            log.flush()

        sensitivity = measure_map(measure, selected, log=write if log else None)
    if args.plot:
        plot(sensitivity, args.plot)
    print(finite_json.dumps(sensitivity.to_dict(), indent=2) if args.json else sensitivity.table())
