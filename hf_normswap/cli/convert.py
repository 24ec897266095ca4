"""``normswap convert``: every option and destination checked, then load, convert (within a quality budget when
asked), fold, evaluate, save and push."""

from __future__ import annotations

import copy
from pathlib import Path

from ..checkpoint.hub import PushError, preflight
from ..checkpoint.loading import load_model, resolve
from ..checkpoint.record import ConversionRecord
from ..checkpoint.directory import check_output_dir
from ..surgery import ConversionError, check_not_converted, check_selection, convert
from ..data import check_spec
from ..calibration.defaults import NONE
from ..evaluation.conversion_check import ConversionCheck
from ..evaluation.perplexity import EvaluationError
from ..evaluation.norm_sensitivity import exact
from ..evaluation.documents import evaluation_texts
from ..fold import fold
from ..modules import METHODS
from ..validation import check_data_files, check_input_scale, check_output_file, first_line
from . import linear_paths, output, sensitivity
from .calibration_flags import calibration, calibration_args, calibration_config, check_calibration_args
from .common import (
    MODEL_HELP, calibration_overlap, check_context_lengths, check_evaluation_args,
    evaluation_args, placement, placement_args, roles, run_evaluation, selection_args, warn,
)


def add_parser(commands) -> None:
    conv = commands.add_parser("convert", help=f"replace norms with an element-wise method ({', '.join(METHODS)})")
    conv.add_argument("model", help=MODEL_HELP)
    conv.add_argument("--to", required=True, choices=sorted(METHODS), type=str.lower, help="element-wise method")
    conv.add_argument("--per-channel", action="store_true", help="one alpha/beta per channel instead of per module")
    conv.add_argument("--input-scale", type=float,
                      help="with --calib none: typical input RMS for the analytic start (default: each norm's own, "
                           "measured in one forward pass on random token ids)")
    conv.add_argument("--no-check", action="store_true",
                      help="skip the check after converting (original and converted scored on a small slice; a "
                           "warning when the converted model is far off)")
    conv.add_argument("--fold", action="store_true",
                      help="for inference: fold each norm's weight and bias into the linear layers it feeds "
                           "(q/k/v, gate/up), leaving a bare element-wise function; norms feeding anything else skip")
    conv.add_argument("--output", help="directory to save the converted checkpoint to (written atomically)")
    conv.add_argument("--overwrite", action="store_true", help="replace --output when it exists and is not empty")
    conv.add_argument("--push-to-hub", metavar="REPO", help="push the checkpoint to this Hub repo (NAME or OWNER/NAME)")
    conv.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    conv.add_argument("--report", help="write the conversion report as JSON to this file")
    conv.add_argument("--max-host-memory", metavar="SIZE",
                      help="host memory the conversion may use, e.g. 16GB: weights beyond what fits stay on disk and "
                           "calibration brings one block in at a time, without its end-to-end steps (default: the "
                           "memory this machine has free). It bounds the weights and calibration's buffers; the "
                           "interpreter, torch and transformers come on top")
    placement_args(conv)
    calibration_args(conv)
    selection_args(conv)
    conv.add_argument("--eval", metavar="DATA", dest="eval_data",
                      help="after converting, evaluate against the original on DATA (same forms as `eval --data`) "
                           "and print the side-by-side table; it is stored in config.json and the model card")
    evaluation_args(conv, prefix="eval-")
    sensitivity.budget_args(conv)
    linear_paths.add_args(conv)


def run(args) -> None:
    # every option and destination is checked before any loading or conversion work
    where = placement(args)
    if args.input_scale is not None:
        check_input_scale(args.input_scale, "--input-scale")
    check_calibration_args(args)
    linear_paths.check_args(args)
    check_selection(roles(args.roles), args.include, args.exclude)
    if args.output:
        check_output_dir(args.output, args.overwrite)
    if args.report:
        check_output_file(args.report, "--report")
    for flag, spec in (("--calib", args.calib), ("--eval", args.eval_data)):  # a mistyped data path, an empty file
        if spec and not (flag == "--calib" and spec == NONE):
            check_data_files(check_spec(spec), flag)
    check_evaluation_args(args, "eval_")
    if args.push_to_hub:
        preflight(args.push_to_hub)
    elif args.private:
        raise PushError("--private needs --push-to-hub REPO")
    budget = sensitivity.budget(args)
    if budget and args.budget_data:
        check_spec(args.budget_data)
    on_disk = weights_memory(args, budget)
    model, tokenizer = load_model(args.model, **where, weights_memory=on_disk)
    if args.to == "linear" and linear_paths.is_converted(model):
        linear_paths.linearise_converted(args, model, tokenizer)
        return save(args, model, tokenizer)
    check_not_converted(model)
    check_context_lengths(args, model, {"--calib-len": args.calib_len if args.calib else None,
                                        "--eval-max-length": args.eval_max_length if args.eval_data else None},
                          {"--calib": args.calib, "--eval": args.eval_data})
    original = copy.deepcopy(model) if args.eval_data else None  # the reference for --eval
    if budget:
        budget, reasons = sensitivity.select_within_budget(args, model, tokenizer)
    check = None if args.no_check else ConversionCheck(model, tokenizer)  # the original's scores, before
    report = convert(model, to=args.to, calibration=calibration(args, model, tokenizer),
                     roles=roles(args.roles), include=exact(budget.converted) if budget else args.include,
                     exclude=None if budget else args.exclude, per_channel=args.per_channel,
                     input_scale=args.input_scale)
    if budget:  # the selection's own reasons, not the exact-name pattern the budgeted conversion used
        kept = {k["name"] for k in budget.kept}
        for entry in report.skipped:
            entry["reason"] = "kept by the quality budget" if entry["name"] in kept else reasons[entry["name"]]
        report.budget = budget.to_dict()
        ConversionRecord.amend(model, budget=report.budget)
    print(report)
    if budget:
        print(budget)
    if args.fold:
        print(fold(model))
    if check is not None:
        check_conversion(check, model)
    if original is not None:
        evaluate_or_keep(args, model, original, tokenizer)
    save(args, model, tokenizer)
    if args.report:  # after the save: a report that cannot be written must not cost the checkpoint
        try:
            output.write_whole(args.report, report.to_json())
        except OSError as error:
            saved = f" (the checkpoint is saved in {args.output})" if args.output else ""
            raise ConversionError(f"cannot write --report {args.report}: {error.strerror}{saved}") from None


def save(args, model, tokenizer) -> None:
    if args.stock:
        linear_paths.save_stock(args, model, tokenizer)
    else:
        output.save_and_push(args, model, tokenizer)


def weights_memory(args, budget) -> int | None:
    """The bytes of weights the conversion keeps in host memory (``--max-host-memory``, else the memory free), the
    rest left on disk; None: the whole model fits, or there is no calibration to bound. Said in one line."""
    from ..calibration.defaults import DEFAULTS
    from ..planning.disk import free_host_memory, weights_in_memory
    from ..planning.plan_settings import parse_bytes
    from ..planning.sizes import PlanError

    given = args.max_host_memory is not None
    try:
        limit = parse_bytes(args.max_host_memory, "--max-host-memory") if given else free_host_memory()
    except PlanError as error:
        raise ConversionError(str(error)) from None
    if args.calib == NONE or (not given and "gguf_file" in resolve(args.model)[1]):  # a GGUF file loads whole
        return None
    config = calibration_config(args)
    if not args.calib:  # the default's sequences
        default = DEFAULTS["samples"]
        config.num_blocks = args.calib_blocks or default.num_blocks
        config.block_len = args.calib_len or default.block_len
    try:
        weights = weights_in_memory(args.model, config, limit)
    except (PlanError, OSError, ValueError) as error:
        if given:
            raise ConversionError(f"--max-host-memory: {first_line(error)}") from None
        return None  # a model the plan cannot read loads as always
    if weights is None:
        return None
    for flag, value in (("--fold", args.fold), ("--budget-ppl-ratio", budget)):
        if value:
            raise ConversionError(f"{flag} needs the whole model in memory, and {args.model} keeps weights on disk "
                                  f"within {'--max-host-memory' if given else 'the free memory'}: allow more memory "
                                  f"or drop {flag}")
    print(f"weights beyond {weights / 2**30:.1f} GiB stay on disk: calibrating block by block "
          f"({'--max-host-memory' if given else 'the free memory'}: {limit / 2**30:.1f} GiB)")
    return weights


def check_conversion(check, model) -> None:
    """The check's line, its warning when the conversion failed, and its record in config.json and the card."""
    result = check.after(model)
    print(result.line())
    record = ConversionRecord.of(model)
    warn(result.warning(record))
    ConversionRecord.amend(model, check=result.to_dict())


def evaluate_or_keep(args, model, original, tokenizer) -> None:
    """``--eval`` runs after the conversion: whatever stops it, the converted model is saved first, without its
    evaluation, and the error says where."""
    try:
        evaluate_conversion(args, model, original, tokenizer)
    except Exception as error:  # noqa: BLE001 - any failure: the conversion is kept, the error named in one line
        save = output.saver(args, model, tokenizer)
        where = output.save_output(args, save) if args.output else output.keep(save, "checkpoint")
        raise EvaluationError(f"--eval failed ({first_line(error)}); the converted model is saved, without its "
                              f"evaluation, in {where}") from None


def evaluate_conversion(args, model, original, tokenizer) -> None:
    """``convert --eval``: the side-by-side table, printed and stored for the model card."""
    texts = evaluation_texts(args.eval_data, original, tokenizer, args.eval_max_tokens)
    record = ConversionRecord.of(model)
    warn(calibration_overlap(None, record.calibration if record is not None else None, args.eval_data, texts))
    evaluation = run_evaluation(args, "eval_", model, tokenizer, original, args.eval_data, texts)
    print(f"\nevaluation on {evaluation.describe()}\n{evaluation.table()}")
    ConversionRecord.amend(model, evaluation=evaluation.card("converted"))
