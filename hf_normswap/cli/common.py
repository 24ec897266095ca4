"""What the verbs share: the one-line parser, the user errors, and the selection / placement / evaluation flags.
A verb that maps its flags onto a job (``convert``) adds them ``given_only``: an absent flag is None, so the job's
own default, or its YAML file's setting, stands."""

from __future__ import annotations

import argparse

from ..checkpoint.hub import PushError
from ..checkpoint.loading import ModelLoadError
from ..checkpoint.packaged import PackagedModelMissing
from ..checkpoint.directory import CheckpointError
from ..surgery import DEFAULT_ROLES, ConversionError
from ..data import DataError
from ..discovery.roles import ROLES
from ..evaluation.perplexity import EvaluationError, PerplexitySettings, evaluate
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


def selection_args(parser: argparse.ArgumentParser, given_only: bool = False) -> None:
    default = ",".join(DEFAULT_ROLES)
    parser.add_argument("--roles", default=None if given_only else default,
                        help=f"comma-separated roles to convert, from {', '.join(ROLES)} (default: {default})")
    parser.add_argument("--include", help="regular expression: convert only norms whose name matches")
    parser.add_argument("--exclude", help="regular expression: leave norms whose name matches")


def placement_args(parser: argparse.ArgumentParser, given_only: bool = False) -> None:
    device = default_device()
    parser.add_argument("--device", default=None if given_only else device,
                        help=f"where the model is loaded and every pass runs: cpu, cuda, cuda:1 (default: {device})")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None if given_only else "float32",
                        help="precision the model is loaded and computed in (default: float32)")


def placement(args) -> dict:
    """``load_model``'s ``device`` and ``dtype`` from the flags; a device this machine lacks fails before the load."""
    try:
        check_device(args.device, "--device")
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return {"device": args.device, "dtype": DTYPES[args.dtype]}


def evaluation_args(parser: argparse.ArgumentParser, prefix: str = "", given_only: bool = False) -> None:
    parser.add_argument(f"--{prefix}max-length", type=int,
                        help="window length in tokens (default: the model's context, as lm-eval resolves it)")
    parser.add_argument(f"--{prefix}stride", type=int,
                        help="score only the last STRIDE tokens of each later window (default: non-overlapping)")
    parser.add_argument(f"--{prefix}max-tokens", type=int, help="stop after this many tokens (CPU budget)")
    parser.add_argument(f"--{prefix}batch-size", type=int, default=None if given_only else 1,
                        help="windows per forward pass (default: 1)")


def check_evaluation_args(args) -> None:
    for name in ("max_length", "stride", "max_tokens", "batch_size"):
        if getattr(args, name) is not None:
            check_number(getattr(args, name), "--" + name.replace("_", "-"), minimum=1)
    if args.stride and args.max_length and args.stride > args.max_length:
        raise EvaluationError(f"--stride {args.stride} is longer than --max-length {args.max_length}")


def run_evaluation(args, models, tokenizer, against, data: str, texts):
    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: perplexity needs one")
    scoring = PerplexitySettings(max_length=args.max_length, stride=args.stride, max_tokens=args.max_tokens,
                                 batch_size=args.batch_size)
    return evaluate(models, tokenizer, texts, against=against, data=data, settings=scoring)
