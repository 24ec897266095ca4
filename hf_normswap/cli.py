"""The normswap command line: inspect, convert, evaluate and push models. User mistakes exit non-zero with one line
on stderr."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

from .convert import DEFAULT_ROLES, ConversionError, convert, plan
from .data import DataError, local_paths
from .evaluate import EvaluationError, is_encoder
from .fold import FoldError, fold
from .checkpoint import CheckpointError, check_output_dir, save_pretrained
from .hub import PushError, preflight, push
from .loading import ModelLoadError, load_model
from .model_card import hub_id
from .modules import METHODS
from .packaged import PackagedModelMissing
from .roles import ROLES

USER_ERRORS = (ConversionError, ModelLoadError, PackagedModelMissing, DataError, EvaluationError, CheckpointError,
               PushError, FoldError)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"normswap: error: {message} (see `{self.prog} --help`)\n")


def _selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", default=",".join(DEFAULT_ROLES),
                        help=f"comma-separated roles to convert, from {', '.join(ROLES)} (default: %(default)s)")
    parser.add_argument("--include", help="regular expression: convert only norms whose name matches")
    parser.add_argument("--exclude", help="regular expression: leave norms whose name matches")


def _calibration_args(parser: argparse.ArgumentParser) -> None:
    from .calibrate import DEFAULT_STRATEGY, STRATEGIES, CalibrationConfig, strategy_help

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
    group.add_argument("--precision", choices=("auto", "fp32", "bf16"), default=defaults.precision,
                       help="forward / backward passes of calibration in fp32, bf16 autocast, or auto: bf16 where a "
                            "timed probe finds it faster on this machine (default: %(default)s)")


def _check_calibration_args(args) -> None:
    """Flag mistakes that need no model, so they fail before the (slow) load."""
    if not args.calib:
        for flag, value in (("--plots", args.plots), ("--strategy", args.strategy)):
            if value:
                raise ConversionError(f"{flag} needs --calib SPEC (e.g. --calib builtin)")
        return
    for flag, value in (("--calib-blocks", args.calib_blocks), ("--calib-len", args.calib_len),
                        ("--max-tokens-per-norm", args.max_tokens_per_norm)):
        if value < 1:
            raise ConversionError(f"{flag} must be at least 1, got {value}")


def _calibration(args, tokenizer):
    if not args.calib:
        return None
    from .calibrate import DEFAULT_STRATEGY, CalibrationConfig

    if tokenizer is None:
        raise ConversionError("--calib needs a model with a tokenizer")
    return CalibrationConfig(data=args.calib, num_blocks=args.calib_blocks, block_len=args.calib_len,
                             strategy=args.strategy or DEFAULT_STRATEGY, max_tokens_per_norm=args.max_tokens_per_norm,
                             plots=args.plots, precision=args.precision, tokenizer=tokenizer)


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
    _calibration_args(conv)
    _selection_args(conv)
    conv.add_argument("--eval", metavar="DATA", dest="eval_data",
                      help="after converting, evaluate against the original on DATA (same forms as `eval --data`) "
                           "and print the side-by-side table; it is stored in config.json and the model card")
    _evaluation_args(conv, prefix="eval-")

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
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _evaluation_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(f"--{prefix}max-length", type=int,
                        help="window length in tokens (default: the model's context, as lm-eval resolves it)")
    parser.add_argument(f"--{prefix}stride", type=int,
                        help="score only the last STRIDE tokens of each later window (default: non-overlapping)")
    parser.add_argument(f"--{prefix}max-tokens", type=int, help="stop after this many tokens (CPU budget)")
    parser.add_argument(f"--{prefix}batch-size", type=int, default=1, help="windows per forward pass (default: 1)")


def _inspect(args) -> None:
    model, _ = load_model(args.model, with_tokenizer=False)
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


def _check_report_path(path: str | None) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise ConversionError(f"--report {path}: its directory does not exist; create it or pick another path")


def _convert(args) -> None:
    if args.output:  # refuse a bad destination before any loading or conversion work
        check_output_dir(args.output, args.overwrite)
    _check_report_path(args.report)
    for spec in (args.calib, args.eval_data):  # a mistyped data path fails before the model loads
        if spec:
            local_paths(spec)
    if args.input_scale <= 0:
        raise ConversionError(f"--input-scale must be positive (a typical input RMS), got {args.input_scale}")
    _check_calibration_args(args)
    _check_evaluation_args(args, "eval_")
    if args.push_to_hub:
        preflight(args.push_to_hub)
    elif args.private:
        raise PushError("--private needs --push-to-hub REPO")
    model, tokenizer = load_model(args.model)
    original = copy.deepcopy(model) if args.eval_data else None  # the reference for --eval
    report = convert(model, to=args.to, calibration=_calibration(args, tokenizer),
                     roles=_roles(args.roles), include=args.include, exclude=args.exclude,
                     per_channel=args.per_channel, input_scale=args.input_scale)
    print(report)
    if args.fold:
        print(fold(model))
    if original is not None:
        _evaluate_conversion(args, model, original, tokenizer)
    if args.report:
        try:
            Path(args.report).write_text(report.to_json())
        except OSError as error:
            raise ConversionError(f"cannot write --report {args.report}: {error.strerror}") from None
    _save_and_push(args, model, tokenizer)


def _save_and_push(args, model, tokenizer) -> None:
    if args.output:
        save_pretrained(model, args.output, tokenizer=tokenizer, overwrite=args.overwrite, base_model=hub_id(args.model))
        print(f"saved to {args.output}")
    if args.push_to_hub:
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.output or save_pretrained(model, Path(scratch) / "checkpoint", tokenizer=tokenizer,
                                                    base_model=hub_id(args.model))
            print(f"pushed to {push(folder, args.push_to_hub, private=args.private)}")


def _push(args) -> None:
    print(f"pushed to {push(args.directory, args.repo, private=args.private)}")


def _warn(message: str | None) -> None:
    if message:
        print(f"normswap: warning: {message}", file=sys.stderr)


def _check_evaluation_args(args, prefix: str = "") -> None:
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    flag = lambda name: "--" + (prefix + name).replace("_", "-")  # noqa: E731
    for name in ("max_length", "stride", "max_tokens", "batch_size"):
        if get(name) is not None and get(name) < 1:
            raise EvaluationError(f"{flag(name)} must be at least 1, got {get(name)}")
    if get("stride") and get("max_length") and get("stride") > get("max_length"):
        raise EvaluationError(f"{flag('stride')} {get('stride')} is longer than {flag('max_length')} {get('max_length')}")


def _run_evaluation(args, prefix: str, models, tokenizer, against, data: str, texts):
    from .evaluate import evaluate

    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: perplexity needs one")
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    return evaluate(models, tokenizer, texts, against=against, data=data, max_length=get("max_length"),
                    stride=get("stride"), max_tokens=get("max_tokens"), batch_size=get("batch_size"))


def _calibration_overlap(calib_spec, recorded, data: str, texts) -> str | None:
    """Warning text when the evaluation data overlaps the calibration data (given, or recorded in the model)."""
    from .data import load_texts
    from .evaluate import overlap_warning

    if calib_spec:
        return overlap_warning(calib_spec, load_texts(calib_spec, "calibration"), data, texts)
    if isinstance(recorded, dict):
        spec = recorded.get("data") if isinstance(recorded.get("data"), str) else None
        if spec or recorded.get("fingerprint"):
            return overlap_warning(spec, None, data, texts, calib_fingerprint=recorded.get("fingerprint"))
    return None


def _evaluate_conversion(args, model, original, tokenizer) -> None:
    """``convert --eval``: the side-by-side table, printed and stored for the model card."""
    from .data import load_texts

    texts = load_texts(args.eval_data, default_split="evaluation")
    _warn(_calibration_overlap(args.calib, None, args.eval_data, texts))
    evaluation = _run_evaluation(args, "eval_", model, tokenizer, original, args.eval_data, texts)
    print(f"\nevaluation on {evaluation.describe()}\n{evaluation.table()}")
    if hasattr(model, "config") and isinstance(getattr(model.config, "normswap", None), dict):
        model.config.normswap["evaluation"] = evaluation.card("converted")


def _embedding_evaluation(args, model, tokenizer, against, texts):
    """``eval`` of an encoder (no LM head): agreement of its sentence embeddings with the original's."""
    from .embeddings import evaluate_embeddings

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
    from .data import load_texts

    _check_evaluation_args(args)
    model, tokenizer = load_model(args.model)
    against = load_model(args.against, with_tokenizer=False)[0] if args.against else None
    texts = load_texts(args.data, default_split="evaluation")
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
        {"inspect": _inspect, "convert": _convert, "eval": _eval, "push": _push}[args.command](args)
    except USER_ERRORS as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
