"""``normswap inspect``: the norms of a model, their kind and role, and what ``convert`` would do with each."""

from __future__ import annotations

import json

from ..checkpoint.loading import load_model
from ..surgery import check_selection, plan, split_roles
from .common import MODEL_HELP, placement, placement_args, selection_args


def add_parser(commands) -> None:
    inspect = commands.add_parser("inspect", help="list the norms of a model and what convert would do")
    inspect.add_argument("model", help=MODEL_HELP)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    selection_args(inspect)
    placement_args(inspect)


def run(args) -> None:
    check_selection(split_roles(args.roles), args.include, args.exclude)
    model, _ = load_model(args.model, with_tokenizer=False, **placement(args))
    norms, selected, skipped = plan(model, split_roles(args.roles), args.include, args.exclude)
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
