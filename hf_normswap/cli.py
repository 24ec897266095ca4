"""``normswap`` command line: inspect and convert models. User mistakes exit non-zero with one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .convert import DEFAULT_ROLES, ConversionError, convert, plan
from .checkpoint import CheckpointError, check_output_dir, save_pretrained
from .hub import PushError, preflight, push
from .loading import ModelLoadError, load_model
from .model_card import hub_id
from .modules import METHODS
from .packaged import PackagedModelMissing
from .roles import ROLES

USER_ERRORS = (ConversionError, ModelLoadError, PackagedModelMissing, CheckpointError, PushError)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", default=",".join(DEFAULT_ROLES),
                        help=f"comma-separated roles to convert, from {', '.join(ROLES)} (default: %(default)s)")
    parser.add_argument("--include", help="regular expression: convert only norms whose name matches")
    parser.add_argument("--exclude", help="regular expression: leave norms whose name matches")


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
    conv.add_argument("--output", help="directory to save the converted checkpoint to (written atomically)")
    conv.add_argument("--overwrite", action="store_true", help="replace --output when it exists and is not empty")
    conv.add_argument("--push-to-hub", metavar="REPO", help="push the checkpoint to this Hub repo (NAME or OWNER/NAME)")
    conv.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    conv.add_argument("--report", help="write the conversion report as JSON to this file")
    _selection_args(conv)

    hub = commands.add_parser("push", help="upload a saved checkpoint to the Hugging Face Hub")
    hub.add_argument("directory", help="checkpoint directory written by `normswap convert --output`")
    hub.add_argument("repo", help="Hub repository, NAME or OWNER/NAME (created if missing)")
    hub.add_argument("--private", action="store_true", help="create the repo private")
    return parser


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


def _convert(args) -> None:
    if args.output:  # refuse a bad destination before any loading or conversion work
        check_output_dir(args.output, args.overwrite)
    if args.push_to_hub:
        preflight(args.push_to_hub)
    elif args.private:
        raise PushError("--private needs --push-to-hub REPO")
    model, tokenizer = load_model(args.model)
    report = convert(model, to=args.to, roles=_roles(args.roles), include=args.include, exclude=args.exclude,
                     per_channel=args.per_channel, input_scale=args.input_scale)
    print(report)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report.to_json())
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"inspect": _inspect, "convert": _convert, "push": _push}[args.command](args)
    except USER_ERRORS as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
