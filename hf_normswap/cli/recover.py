"""``normswap recover --config FILE [key=value ...]``: the recovery recipe (``hf_normswap.training.recipe``), the
same run as ``accelerate launch recipes/finetune.py --config FILE ...``, in this process."""

from __future__ import annotations


def add_parser(commands) -> None:
    recover = commands.add_parser("recover", help="recover a converted model against its original: the training "
                                                  "recipe, settings from a YAML config (recipes/configs/)")
    recover.add_argument("--config", required=True, metavar="FILE", help="the recipe's YAML settings")
    recover.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                         help="settings over the config's (dotted keys reach into sections, e.g. lr.base=1e-3)")


def run(args) -> int | None:
    from ..training.recipe import main  # the Trainer and its dependencies load only for this verb

    return main(["--config", args.config, *args.overrides], command="normswap recover")
