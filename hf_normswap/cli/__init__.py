"""The normswap command line: inspect, convert, recover, evaluate, plan and push models. User mistakes exit non-zero
with one line on stderr."""

from __future__ import annotations

import sys

from . import convert, evaluate, inspect, plan, push, recover, sensitivity
from .common import USER_ERRORS, Parser

VERBS = {"inspect": inspect, "convert": convert, "recover": recover, "eval": evaluate, "sensitivity": sensitivity,
         "plan": plan, "push": push}


def build_parser() -> Parser:
    parser = Parser(prog="normswap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for verb in VERBS.values():
        verb.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = VERBS[args.command].run(args)
    except USER_ERRORS as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
