"""The normswap command line: inspect, convert, evaluate and push models. User mistakes exit non-zero with one line
on stderr."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .convert import DEFAULT_ROLES, ConversionError, check_not_converted, check_selection, convert, plan
from .data import DataError, check_spec
from .evaluation.perplexity import EvaluationError, check_window, context_length
from .fold import FoldError, fold
from .checkpoint.save_load import CheckpointError, check_output_dir, checkpoint_files, save_pretrained
from .checkpoint.hub import PushError, preflight, push
from .checkpoint.loading import ModelLoadError, load_model
from .checkpoint.model_card import hub_id
from .model_inputs import is_encoder
from .modules import METHODS
from .placement import DTYPES, check_device, default_device
from .checkpoint.packaged import PackagedModelMissing
from .precision import PRECISIONS
from .discovery.roles import ROLES
from .evaluation.sensitivity import exact
from .validation import (ValidationError, check_data_files, check_input_scale, check_number, check_output_file,
                         check_output_folder, first_line)

USER_ERRORS = (ConversionError, ModelLoadError, PackagedModelMissing, DataError, EvaluationError, CheckpointError,
               PushError, FoldError, ValidationError)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"normswap: error: {message} (see `{self.prog} --help`)\n")


def _selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", default=",".join(DEFAULT_ROLES),
                        help=f"comma-separated roles to convert, from {', '.join(ROLES)} (default: %(default)s)")
    parser.add_argument("--include", help="regular expression: convert only norms whose name matches")
    parser.add_argument("--exclude", help="regular expression: leave norms whose name matches")


def _placement_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=default_device(),
                        help="where the model is loaded and every pass runs: cpu, cuda, cuda:1 (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="precision the model is loaded and computed in (default: %(default)s)")


def _placement(args) -> dict:
    """``load_model``'s ``device`` and ``dtype`` from the flags; a device this machine lacks fails before the load."""
    try:
        check_device(args.device, "--device")
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return {"device": args.device, "dtype": DTYPES[args.dtype]}


def _calibration_args(parser: argparse.ArgumentParser) -> None:
    from .calibration.calibrate import DEFAULT_STRATEGY, STRATEGIES, CalibrationConfig, strategy_help

    defaults = CalibrationConfig()
    parser.epilog = strategy_help()  # one line per strategy, kept as written
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    group = parser.add_argument_group("calibration (fit alpha/beta to real activations; see calibrate.py)")
    group.add_argument("--calib", metavar="SPEC",
                       help="calibration text: 'builtin' (offline, ships with Python), local txt/json/jsonl/parquet "
                            "files, or a Hub dataset name[:config][:split]; without it the analytic values are used")
    group.add_argument("--calib-blocks", type=int, default=defaults.num_blocks, metavar="N",
                       help="calibration blocks (default: %(default)s)")
    group.add_argument("--calib-len", type=int, default=defaults.block_len, metavar="L",
                       help="tokens per block (default: %(default)s)")
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
                            f"time (SmolLM2 ELN: 4.2x the original's perplexity after 240 steps over 64 x 512 tokens, "
                            f"12.6x after 60 over 16 x 512; default: {block.block_steps})")
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


def _check_calibration_args(args) -> None:
    """Flag mistakes that need no model, so they fail before the (slow) load; numbers are checked even unused."""
    from .calibration.calibrate import DEFAULT_STRATEGY, check_device

    # the block strategy's own settings, with their least values
    block_flags = (("--block-weights-lr", args.block_weights_lr, 0), ("--block-rows", args.block_rows, 1),
                   ("--block-steps", args.block_steps, 1))
    for flag, value, minimum in (("--calib-blocks", args.calib_blocks, 1), ("--calib-len", args.calib_len, 1),
                                 ("--max-tokens-per-norm", args.max_tokens_per_norm, 1),
                                 ("--calib-cache-mb", args.calib_cache_mb, 0), *block_flags):
        if value is not None:
            check_number(value, flag, minimum=minimum)
    if args.calib_device is not None:
        try:
            check_device(args.calib_device)
        except ValueError as error:
            raise ConversionError(f"--calib-device: {error}") from None
    if not args.calib:
        unused = (("--plots", args.plots), ("--strategy", args.strategy), ("--calib-device", args.calib_device),
                  ("--calib-cache-mb", args.calib_cache_mb), *((flag, value) for flag, value, _ in block_flags))
        for flag, value in unused:
            if value is not None:
                raise ConversionError(f"{flag} needs --calib SPEC (e.g. --calib builtin)")
    for flag, value, _ in block_flags:
        if value is not None and args.strategy not in (None, DEFAULT_STRATEGY, "block"):
            raise ConversionError(f"{flag} needs the block strategy, not {args.strategy}")
    if args.plots:
        check_output_folder(args.plots, "--plots")


def _calibration(args, tokenizer):
    if not args.calib:
        return None
    from .calibration.calibrate import DEFAULT_STRATEGY, CalibrationConfig

    if tokenizer is None:
        raise ConversionError("--calib needs a model with a tokenizer")
    return CalibrationConfig(data=args.calib, num_blocks=args.calib_blocks, block_len=args.calib_len,
                             strategy=args.strategy or DEFAULT_STRATEGY, max_tokens_per_norm=args.max_tokens_per_norm,
                             plots=args.plots, precision=args.precision, block_weights_lr=args.block_weights_lr,
                             block_rows=args.block_rows, block_steps=args.block_steps, device=args.calib_device,
                             cache_memory_mb=args.calib_cache_mb, tokenizer=tokenizer)


def _roles(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="normswap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    model_help = "Hub id, local directory, .gguf file, or a packaged model (offline:smollm2, offline:minilm)"

    inspect = commands.add_parser("inspect", help="list the norms of a model and what convert would do")
    inspect.add_argument("model", help=model_help)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _selection_args(inspect)
    _placement_args(inspect)

    conv = commands.add_parser("convert", help="replace norms with DyT or ELN")
    conv.add_argument("model", help=model_help)
    conv.add_argument("--to", required=True, choices=sorted(METHODS), type=str.lower, help="element-wise method")
    conv.add_argument("--per-channel", action="store_true", help="one alpha/beta per channel instead of per module")
    conv.add_argument("--input-scale", type=float, default=1.0,
                      help="typical input RMS for the analytic initialization (default: %(default)s)")
    conv.add_argument("--fold", action="store_true",
                      help="for inference: fold each norm's weight and bias into the linear layers it feeds "
                           "(q/k/v, gate/up), leaving a bare element-wise function; norms feeding anything else skip")
    conv.add_argument("--output", help="directory to save the converted checkpoint to (written atomically)")
    conv.add_argument("--overwrite", action="store_true", help="replace --output when it exists and is not empty")
    conv.add_argument("--push-to-hub", metavar="REPO", help="push the checkpoint to this Hub repo (NAME or OWNER/NAME)")
    conv.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    conv.add_argument("--report", help="write the conversion report as JSON to this file")
    _placement_args(conv)
    _calibration_args(conv)
    _selection_args(conv)
    conv.add_argument("--eval", metavar="DATA", dest="eval_data",
                      help="after converting, evaluate against the original on DATA (same forms as `eval --data`) "
                           "and print the side-by-side table; it is stored in config.json and the model card")
    _evaluation_args(conv, prefix="eval-")
    _budget_args(conv)

    _sensitivity_parser(commands, model_help)

    hub = commands.add_parser("push", help="upload a saved checkpoint to the Hugging Face Hub")
    hub.add_argument("directory", help="checkpoint directory written by `normswap convert --output`")
    hub.add_argument("repo", help="Hub repository, NAME or OWNER/NAME (created if missing)")
    hub.add_argument("--private", action="store_true", help="create the repo private")

    ev = commands.add_parser("eval", help="perplexity (token, word, byte) and, with --against, KL / top-1 vs original; "
                                          "for an encoder (no LM head): embedding agreement with --against")
    ev.add_argument("model", help=model_help + ", or a converted checkpoint")
    ev.add_argument("--against", metavar="ORIGINAL", help="the original model: adds KL, top-1 agreement, ratios")
    ev.add_argument("--data", default="builtin",
                    help="text to score: builtin (held-out half of the offline corpus), local files, or a Hub "
                         "dataset name[:config[:split]], split defaulting to test (default: %(default)s)")
    ev.add_argument("--calib", metavar="DATA", help="calibration data used for the model: warn if --data overlaps it "
                    "(a converted checkpoint's recorded calibration is checked without this)")
    _evaluation_args(ev)
    _placement_args(ev)
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _evaluation_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(f"--{prefix}max-length", type=int,
                        help="window length in tokens (default: the model's context, as lm-eval resolves it)")
    parser.add_argument(f"--{prefix}stride", type=int,
                        help="score only the last STRIDE tokens of each later window (default: non-overlapping)")
    parser.add_argument(f"--{prefix}max-tokens", type=int, help="stop after this many tokens (CPU budget)")
    parser.add_argument(f"--{prefix}batch-size", type=int, default=1, help="windows per forward pass (default: 1)")


# ------------------------------------------------------------------------------ sensitivity and quality budgets


def _sensitivity_parser(commands, model_help: str) -> None:
    from .evaluation.sensitivity import CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, SENTENCES

    sens = commands.add_parser("sensitivity", help="damage of each norm converted alone, and the greedy curve")
    sens.add_argument("model", help=model_help)
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
    _placement_args(sens)
    _calibration_args(sens)
    sens.set_defaults(calib_blocks=CALIB_BLOCKS, calib_len=CALIB_LEN)
    _selection_args(sens)


def _budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quality budget (convert the largest greedy subset within it; see "
                                      "`normswap sensitivity`)").add_mutually_exclusive_group()
    group.add_argument("--budget-kl", type=float, metavar="X", help="KL(original || converted) at most X nats/token")
    group.add_argument("--budget-ppl-ratio", type=float, metavar="R", help="perplexity at most R times the original's")
    group.add_argument("--budget-cosine", type=float, metavar="C", help="encoders: mean embedding cosine at least C")
    parser.add_argument("--budget-data", default="builtin", help="text the budget is measured on (default: "
                        "%(default)s, the evaluation half)")


def _budget(args) -> tuple[str, float] | None:
    for metric in ("kl", "ppl_ratio", "cosine"):
        limit = getattr(args, f"budget_{metric}")
        if limit is not None:
            if limit <= 0 or (metric == "ppl_ratio" and limit < 1) or (metric == "cosine" and limit > 1):
                raise ConversionError(f"--budget-{metric.replace('_', '-')} {limit} is out of range: give a KL > 0, "
                                      "a perplexity ratio >= 1 or a cosine in (0, 1]")
            return metric, limit
    return None


def _measurer(args, model, tokenizer, texts, calibration, **slice_options):
    from .evaluation.sensitivity import Measurer, Reference

    if tokenizer is None:
        raise ConversionError(f"{args.model} has no tokenizer: the sensitivity map needs one to score text")
    reference = Reference(model, tokenizer, texts, **slice_options)
    return Measurer(model, reference, args.to, calibration, roles=_roles(args.roles), per_channel=args.per_channel)


def _measured_weights_lr(args) -> float:
    """Block-wise reconstruction in a sensitivity measurement only when asked: the map is the damage of norms
    converted with their blocks' weights as they are, and a few hundred tokens would overfit the weights."""
    return 0.0 if args.block_weights_lr is None else args.block_weights_lr


def _select_within_budget(args, model, tokenizer):
    """The budget search on a copy: the map on the sensitivity slice, then a bisection of its greedy curve."""
    from dataclasses import replace

    from .model_inputs import ends_in_hidden_states
    from .evaluation.sensitivity import (CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, measure_map,
                                         select_within_budget)

    metric, limit = _budget(args)
    encoder = ends_in_hidden_states(model)
    if (metric == "cosine") != encoder:
        raise ConversionError(f"--budget-{metric.replace('_', '-')} does not apply to {args.model}: use "
                              + ("--budget-cosine for an encoder" if encoder else
                                 "--budget-kl or --budget-ppl-ratio for a model with an output head"))
    calibration = _calibration(args, tokenizer)
    if calibration is not None:  # measured cheaply; the final conversion runs the full calibration
        calibration = replace(calibration, num_blocks=CALIB_BLOCKS, block_len=CALIB_LEN, tune_steps=0, plots=None,
                              block_weights_lr=_measured_weights_lr(args),
                              progress=False)
    texts = evaluation_texts(args.budget_data, model, tokenizer, EVAL_WINDOWS * EVAL_LEN)
    measurer = _measurer(args, model, tokenizer, texts, calibration)
    _, selected, skipped = plan(model, _roles(args.roles), args.include, args.exclude)
    budget = select_within_budget(measure_map(measurer, selected), measurer, metric, limit)
    if not budget.converted:
        raise ConversionError(f"no norm converts within the budget: {budget.kept[0]['reason']}")
    return budget, {s["name"]: s["reason"] for s in skipped}


def _sensitivity(args) -> None:
    from .evaluation.sensitivity import EVAL_LEN, measure_map, plot

    _check_calibration_args(args)
    for flag in ("windows", "window_len", "sentences"):
        if getattr(args, flag) is not None:
            check_number(getattr(args, flag), f"--{flag.replace('_', '-')}", minimum=1)
    check_number(args.tune_steps, "--tune-steps", minimum=0)
    for spec in (args.calib, args.data):
        if spec:
            check_spec(spec)
    for flag, path in (("--plot", args.plot), ("--log", args.log)):
        if path:
            check_output_file(path, flag)
    model, tokenizer = load_model(args.model, **_placement(args))
    check_not_converted(model)
    check_window(args.window_len, {args.model: model}, "--window-len")
    window_len = args.window_len or min(EVAL_LEN, context_length(model) or EVAL_LEN)
    _, selected, _ = plan(model, _roles(args.roles), args.include, args.exclude)
    texts = evaluation_texts(args.data, model, tokenizer, args.windows * window_len)
    calibration = _calibration(args, tokenizer)
    if calibration is not None:
        calibration.tune_steps, calibration.progress = args.tune_steps, False
        calibration.block_weights_lr = _measured_weights_lr(args)
        _warn(_calibration_overlap(args.calib, None, args.data, texts))
    measurer = _measurer(args, model, tokenizer, texts, calibration, windows=args.windows,
                         window_len=window_len, sentences=args.sentences)
    with open(args.log, "a") if args.log else contextlib.nullcontext() as log:
        def write(entry: dict) -> None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

        sensitivity = measure_map(measurer, selected, log=write if log else None)
    if args.plot:
        plot(sensitivity, args.plot)
    print(json.dumps(sensitivity.to_dict(), indent=2) if args.json else sensitivity.table())


def _inspect(args) -> None:
    check_selection(_roles(args.roles), args.include, args.exclude)
    model, _ = load_model(args.model, with_tokenizer=False, **_placement(args))
    norms, selected, skipped = plan(model, _roles(args.roles), args.include, args.exclude)
    chosen = {n.name for n in selected}
    reasons = {s["name"]: s["reason"] for s in skipped}
    if args.json:
        rows = [dict(n.to_dict(), action="convert" if n.name in chosen else "skip: " + reasons[n.name]) for n in norms]
        print(json.dumps(rows, indent=2))
        return
    print(f"{type(model).__name__}: {len(norms)} norms, convert would replace {len(chosen)}")
    print(f"{'name':<50} {'class':<18} {'kind':<9} {'bias':<5} {'1+w':<4} {'size':>5}  {'role':<15} action")
    for n in norms:
        action = "convert" if n.name in chosen else "skip: " + reasons[n.name]
        print(f"{n.name:<50} {n.class_name:<18} {n.kind or '?':<9} {str(n.has_bias):<5} "
              f"{'yes' if n.weight_offset else 'no':<4} {n.size:>5}  {n.role:<15} {action}")


def _convert(args) -> None:
    # every option and destination is checked before any loading or conversion work
    placement = _placement(args)
    check_input_scale(args.input_scale, "--input-scale")
    _check_calibration_args(args)
    check_selection(_roles(args.roles), args.include, args.exclude)
    if args.output:
        check_output_dir(args.output, args.overwrite)
    if args.report:
        check_output_file(args.report, "--report")
    for flag, spec in (("--calib", args.calib), ("--eval", args.eval_data)):  # a mistyped data path, an empty file
        if spec:
            check_data_files(check_spec(spec), flag)
    _check_evaluation_args(args, "eval_")
    if args.push_to_hub:
        preflight(args.push_to_hub)
    elif args.private:
        raise PushError("--private needs --push-to-hub REPO")
    budget = _budget(args)
    if budget and args.budget_data:
        check_spec(args.budget_data)
    model, tokenizer = load_model(args.model, **placement)
    check_not_converted(model)
    if args.eval_data:
        check_window(args.eval_max_length, {args.model: model}, "--eval-max-length")
    original = copy.deepcopy(model) if args.eval_data else None  # the reference for --eval
    if budget:
        budget, reasons = _select_within_budget(args, model, tokenizer)
    report = convert(model, to=args.to, calibration=_calibration(args, tokenizer),
                     roles=_roles(args.roles), include=exact(budget.converted) if budget else args.include,
                     exclude=None if budget else args.exclude, per_channel=args.per_channel,
                     input_scale=args.input_scale)
    if budget:  # the selection's own reasons, not the exact-name pattern the budgeted conversion used
        kept = {k["name"] for k in budget.kept}
        for entry in report.skipped:
            entry["reason"] = "kept by the quality budget" if entry["name"] in kept else reasons[entry["name"]]
        report.budget = model.config.normswap["budget"] = budget.to_dict()
    print(report)
    if budget:
        print(budget)
    if args.fold:
        print(fold(model))
    if original is not None:
        _evaluate_or_keep(args, model, original, tokenizer)
    _save_and_push(args, model, tokenizer)
    if args.report:  # after the save: a report that cannot be written must not cost the checkpoint
        try:
            Path(args.report).write_text(report.to_json())
        except OSError as error:
            saved = f" (the checkpoint is saved in {args.output})" if args.output else ""
            raise ConversionError(f"cannot write --report {args.report}: {error.strerror}{saved}") from None


def _evaluate_or_keep(args, model, original, tokenizer) -> None:
    """``--eval`` runs after the conversion: whatever stops it, the converted model is saved first, without its
    evaluation, and the error says where."""
    try:
        _evaluate_conversion(args, model, original, tokenizer)
    except Exception as error:  # noqa: BLE001 - any failure: the conversion is kept, the error named in one line
        save = functools.partial(save_pretrained, model, tokenizer=tokenizer, base_model=hub_id(args.model))
        where = _save_output(args, save) if args.output else _keep(save, "checkpoint")
        raise EvaluationError(f"--eval failed ({first_line(error)}); the converted model is saved, without its "
                              f"evaluation, in {where}") from None


def _save_output(args, save) -> str:
    """Save into ``--output``; on failure into a temporary directory that the error names."""
    try:
        save(args.output, overwrite=args.overwrite)
    except (OSError, CheckpointError) as error:
        kept = _keep(save, Path(args.output).name)
        raise CheckpointError(f"cannot save to {args.output} ({first_line(error)}); the converted model is kept "
                              f"in {kept}: move it into place") from None
    print(f"saved to {args.output}")
    return args.output


def _save_and_push(args, model, tokenizer) -> None:
    """Save and push; when either fails, the converted model is kept in a temporary directory that the error names,
    so a long conversion is never lost to a full disk, a vanished directory or a network failure."""
    save = functools.partial(save_pretrained, model, tokenizer=tokenizer, base_model=hub_id(args.model))
    if args.output:
        _save_output(args, save)
    if args.push_to_hub:
        folder = args.output or _keep(save, "checkpoint")
        try:
            print(f"pushed to {push(folder, args.push_to_hub, private=args.private)}")
        except PushError as error:
            where = "" if args.output else f"; the converted model is kept in {folder}: push it with `normswap push`"
            raise PushError(f"{error}{where}") from None
        if not args.output:
            shutil.rmtree(Path(folder).parent)


def _keep(save, name: str) -> Path:
    """Save into a fresh temporary directory (its ``name`` subfolder) and return the path."""
    folder = Path(tempfile.mkdtemp(prefix="normswap-"))
    try:
        return save(folder / name)
    except (OSError, CheckpointError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(f"cannot save the converted model, not even to a temporary directory "
                              f"({first_line(error)}); free disk space and run again") from None


def _push(args) -> None:
    print(f"pushed to {push(args.directory, args.repo, private=args.private)}")
    folder = Path(args.directory)
    kept = sorted({p.name for p in folder.iterdir()} - set(checkpoint_files(folder)))
    if kept:
        _warn(f"not uploaded, not part of the checkpoint: {', '.join(kept)}")


def _warn(message: str | None) -> None:
    if message:
        print(f"normswap: warning: {message}", file=sys.stderr)


def _check_evaluation_args(args, prefix: str = "") -> None:
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    flag = lambda name: "--" + (prefix + name).replace("_", "-")  # noqa: E731
    for name in ("max_length", "stride", "max_tokens", "batch_size"):
        if get(name) is not None:
            check_number(get(name), flag(name), minimum=1)
    if get("stride") and get("max_length") and get("stride") > get("max_length"):
        raise EvaluationError(f"{flag('stride')} {get('stride')} is longer than {flag('max_length')} {get('max_length')}")


def _run_evaluation(args, prefix: str, models, tokenizer, against, data: str, texts):
    from .evaluation.perplexity import evaluate

    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: perplexity needs one")
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    return evaluate(models, tokenizer, texts, against=against, data=data, max_length=get("max_length"),
                    stride=get("stride"), max_tokens=get("max_tokens"), batch_size=get("batch_size"))


def _original_of(model, against):
    """The model generated evaluation text is sampled from: ``--against``, or the model itself when it is an
    original (a converted model's samples would score it on its own text)."""
    if against is not None:
        return against
    converted = isinstance(getattr(getattr(model, "config", None), "normswap", None), dict)
    return None if converted else model


def evaluation_texts(spec: str, original, tokenizer, max_tokens: int | None):
    """The evaluation text; ``generated`` text is sampled from ``original``."""
    from .data import load_texts

    return load_texts(spec, default_split="evaluation", model=original, tokenizer=tokenizer, max_tokens=max_tokens)


def _calibration_overlap(calib_spec, recorded, data: str, texts) -> str | None:
    """Warning text when the evaluation data overlaps the calibration data (given, or recorded in the model)."""
    from .data import load_texts
    from .data import same_sample
    from .evaluation.perplexity import overlap_warning
    from .data import is_generated

    recorded_spec = recorded.get("data") if isinstance(recorded, dict) else None
    if is_generated(calib_spec) or is_generated(recorded_spec):
        if same_sample(calib_spec, data) or same_sample(recorded_spec, data):
            return (f"the evaluation text {data} is the calibration's own sample (the same settings draw the same "
                    "batches): set another seed, e.g. generated:seed=1")
        return None
    if calib_spec:
        return overlap_warning(calib_spec, load_texts(calib_spec, "calibration"), data, texts)
    if isinstance(recorded, dict):
        spec = recorded.get("data") if isinstance(recorded.get("data"), str) else None
        if spec or recorded.get("fingerprint"):
            return overlap_warning(spec, None, data, texts, calib_fingerprint=recorded.get("fingerprint"))
    return None


def _evaluate_conversion(args, model, original, tokenizer) -> None:
    """``convert --eval``: the side-by-side table, printed and stored for the model card."""
    texts = evaluation_texts(args.eval_data, original, tokenizer, args.eval_max_tokens)
    _warn(_calibration_overlap(args.calib, None, args.eval_data, texts))
    evaluation = _run_evaluation(args, "eval_", model, tokenizer, original, args.eval_data, texts)
    print(f"\nevaluation on {evaluation.describe()}\n{evaluation.table()}")
    if hasattr(model, "config") and isinstance(getattr(model.config, "normswap", None), dict):
        model.config.normswap["evaluation"] = evaluation.card("converted")


def _embedding_evaluation(args, model, tokenizer, against, texts):
    """``eval`` of an encoder (no LM head): agreement of its sentence embeddings with the original's."""
    from .evaluation.embeddings import evaluate_embeddings

    if against is None:
        raise EvaluationError(f"{args.model} is an encoder ({type(model).__name__}): its embeddings are compared "
                              "with the original's; pass --against ORIGINAL")
    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: sentence embeddings need one")
    if args.stride:
        raise EvaluationError("--stride applies to perplexity windows; an encoder is scored on whole sentences")
    return evaluate_embeddings(model, against, tokenizer, texts, max_tokens=args.max_tokens,
                               max_length=args.max_length, data=args.data)


def _eval(args) -> None:
    _check_evaluation_args(args)
    check_data_files(check_spec(args.data), "--data")
    placement = _placement(args)
    model, tokenizer = load_model(args.model, **placement)
    against = load_model(args.against, with_tokenizer=False, **placement)[0] if args.against else None
    check_window(args.max_length, {args.model: model, **({args.against: against} if against else {})},
                 "--max-length")
    texts = evaluation_texts(args.data, _original_of(model, against), tokenizer, args.max_tokens)
    recorded = (getattr(getattr(model, "config", None), "normswap", None) or {}).get("calibration")
    _warn(_calibration_overlap(args.calib, recorded, args.data, texts))
    if is_encoder(model):
        evaluation = _embedding_evaluation(args, model, tokenizer, against, texts)
    else:
        evaluation = _run_evaluation(args, "", model, tokenizer, against, args.data, texts)
    if args.json:
        print(json.dumps(evaluation.to_dict(), indent=2))
    else:
        print(f"{args.model} on {evaluation.describe()}\n{evaluation.table()}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"inspect": _inspect, "convert": _convert, "eval": _eval, "push": _push,
         "sensitivity": _sensitivity}[args.command](args)
    except USER_ERRORS as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
