"""The recipe's settings: the YAML config and ``key=value`` overrides, every key, type and range checked, then what
they name on disk (run directory, save directory, Hub repository), before anything is loaded; the calibration cache
once the run is resolved (``recovery_run.check_calibration_cache``)."""

from __future__ import annotations

import argparse
import contextvars
import os
import sys

from ..checkpoint import hub
from ..checkpoint.directory import CheckpointError
from ..checkpoint.loading import ModelLoadError
from ..checkpoint.packaged import PackagedModelMissing
from ..validation import ValidationError
from .config import RecipeConfig, read_recipe_config
from .run_dir import check_run_dir, check_save_dir
from .sharding import fsdp2_requested

DESCRIPTION = "Fine-tune a converted model against its original: convert with calibration, train, evaluate, save."


# the command the user ran (recipes/finetune.py, or the verb `normswap recover`): it starts every error line
COMMAND = contextvars.ContextVar("command", default="finetune")


def fail(message: str):
    """A mistake in the settings: one line on stderr, exit code 2, before anything is loaded."""
    print(f"{COMMAND.get()}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def stopped(message: str) -> SystemExit:
    """The exit of a run that cannot go on, its message starting with the command's name."""
    return SystemExit(f"{COMMAND.get()}: {message}")


def load_config(argv: list[str] | None = None) -> RecipeConfig:
    """The settings of the YAML file and the overrides, every key, type and range checked, then what they name on
    disk, before anything is loaded (the calibration cache once the run is resolved:
    ``recovery_run.check_calibration_cache``)."""
    parser = argparse.ArgumentParser(prog=COMMAND.get(), description=DESCRIPTION)
    parser.add_argument("--config", help="YAML file (recipes/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. training.max_steps=20 method=dyt")
    args = parser.parse_args(argv)
    try:
        check_sharding()  # first: a DeepSpeed environment fails the TrainingArguments check with another reason
        config = read_recipe_config(args.config, args.overrides)
        check_run_dir(config)
        check_save_dir(config)
        if config.push_to_hub:
            hub.preflight(config.push_to_hub)
    except (ValidationError, CheckpointError, hub.PushError, ModelLoadError, PackagedModelMissing) as error:
        fail(str(error))
    return config


def check_sharding() -> None:
    """FSDP2 is the sharded engine (``hf_normswap.training.sharding``); FSDP1 and DeepSpeed ZeRO-3 are refused
    before anything loads: the gather for the final evaluation and save is FSDP2's, and ZeRO-3 is untested here."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not fsdp2_requested():
        raise ValidationError("FSDP1 is not supported: launch with recipes/accelerate_configs/fsdp2.yaml "
                              "(fsdp_version: 2)")
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        raise ValidationError("DeepSpeed ZeRO-3 is not supported: shard with FSDP2 "
                              "(recipes/accelerate_configs/fsdp2.yaml)")
