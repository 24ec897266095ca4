"""What the verbs share: the one-line parser, the user errors, the selection / placement / evaluation flags,
warnings, and the evaluation text with its overlap check against the calibration data."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint.hub import PushError
from ..checkpoint.loading import ModelLoadError
from ..checkpoint.packaged import PackagedModelMissing
from ..checkpoint.directory import CheckpointError
from ..surgery import DEFAULT_ROLES, ConversionError
from ..data import DataError
from ..discovery.roles import ROLES
from ..evaluation.perplexity import EvaluationError
from ..fold import FoldError
from ..placement import DTYPES, check_device, default_device
from ..validation import ValidationError, check_number

USER_ERRORS = (ConversionError, ModelLoadError, PackagedModelMissing, DataError, EvaluationError, CheckpointError,
               PushError, FoldError, ValidationError)
MODEL_HELP = "Hub id, local directory, .gguf file, or a packaged model (offline:smollm2, offline:minilm)"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"normswap: error: {message} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of processes), refused as the flags are parsed."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", default=",".join(DEFAULT_ROLES),
                        help=f"comma-separated roles to convert, from {', '.join(ROLES)} (default: %(default)s)")
    parser.add_argument("--include", help="regular expression: convert only norms whose name matches")
    parser.add_argument("--exclude", help="regular expression: leave norms whose name matches")


def roles(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


def placement_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=default_device(),
                        help="where the model is loaded and every pass runs: cpu, cuda, cuda:1 (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="precision the model is loaded and computed in (default: %(default)s)")


def placement(args) -> dict:
    """``load_model``'s ``device`` and ``dtype`` from the flags; a device this machine lacks fails before the load."""
    try:
        check_device(args.device, "--device")
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return {"device": args.device, "dtype": DTYPES[args.dtype]}


def evaluation_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(f"--{prefix}max-length", type=int,
                        help="window length in tokens (default: the model's context, as lm-eval resolves it)")
    parser.add_argument(f"--{prefix}stride", type=int,
                        help="score only the last STRIDE tokens of each later window (default: non-overlapping)")
    parser.add_argument(f"--{prefix}max-tokens", type=int, help="stop after this many tokens (CPU budget)")
    parser.add_argument(f"--{prefix}batch-size", type=int, default=1, help="windows per forward pass (default: 1)")


def check_evaluation_args(args, prefix: str = "") -> None:
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    flag = lambda name: "--" + (prefix + name).replace("_", "-")  # noqa: E731
    for name in ("max_length", "stride", "max_tokens", "batch_size"):
        if get(name) is not None:
            check_number(get(name), flag(name), minimum=1)
    if get("stride") and get("max_length") and get("stride") > get("max_length"):
        raise EvaluationError(f"{flag('stride')} {get('stride')} is longer than {flag('max_length')} "
                              f"{get('max_length')}")


def run_evaluation(args, prefix: str, models, tokenizer, against, data: str, texts):
    from ..evaluation.perplexity import evaluate

    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: perplexity needs one")
    get = lambda name: getattr(args, prefix + name)  # noqa: E731
    return evaluate(models, tokenizer, texts, against=against, data=data, max_length=get("max_length"),
                    stride=get("stride"), max_tokens=get("max_tokens"), batch_size=get("batch_size"))


def warn(message: str | None) -> None:
    if message:
        print(f"normswap: warning: {message}", file=sys.stderr)


def calibration_overlap(calib_spec, recorded, data: str, texts) -> str | None:
    """Warning text when the evaluation data overlaps the calibration data (given, or recorded in the model)."""
    from ..data import load_texts, same_sample
    from ..data.sources import source
    from ..evaluation.perplexity import overlap_warning

    recorded_spec = recorded.get("data") if isinstance(recorded, dict) else None
    if any(isinstance(spec, str) and source(spec).samples_original for spec in (calib_spec, recorded_spec)):
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


def check_context_lengths(args, model, lengths: dict, sources: dict) -> None:
    """The lengths given, and the sequence length of each ``generated`` source, within the model's context, before
    any work (``model_inputs.check_context``): calibration cut a longer --calib-len silently, and an evaluation's
    samples failed only after the conversion."""
    from ..data import sample_length
    from ..model_inputs import check_context

    sampled = {f"{flag} generated: length": sample_length(spec) for flag, spec in sources.items()}
    try:
        check_context({**lengths, **sampled}, model, args.model)
    except ValueError as error:
        raise ValidationError(str(error)) from None
