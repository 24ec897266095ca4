"""``normswap plan MODEL``: the memory a conversion and a recovery need, from the model's config alone
(``hf_normswap.planning``); ``normswap plan --config RECIPE.yaml [KEY=VALUE ...]``: a recovery's, as the recipe
resolves the run (``training.recovery_run``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..planning.memory_plan import plan
from ..planning.plan_settings import PRECISIONS, SHARDING, TRAINABLE, PlanSettings, parse_bytes
from ..planning.recipe_plan import run_plan_settings
from ..planning.sizes import PlanError
from ..validation import ValidationError
from .common import positive_int


# what a recipe's config decides, which its plan takes from there
DECIDED_BY_THE_RECIPE = {"trainable": "trainable", "lora_rank": "lora.r", "precision": "precision",
                         "teacher": "shard_teacher", "gradient_checkpointing": "training.gradient_checkpointing",
                         "batch_size": "training.per_device_train_batch_size", "seq_len": "block_len",
                         "optimizer_offload": "the accelerate config",
                         "no_calibration": "model: a converted checkpoint is not calibrated again",
                         "weights_on_disk": "the recipe calibrates in memory"}


def add_parser(commands) -> None:
    """The verb's arguments: the model and every setting :class:`~hf_normswap.planning.plan_settings.PlanSettings` takes."""
    parser = commands.add_parser("plan", help="memory a conversion and a recovery need, from the config alone")
    parser.add_argument("model", nargs="?", help="Hub id, model directory, config.json, .gguf or offline:NAME (only "
                                                 "the config is read)")
    parser.add_argument("--config", metavar="RECIPE.yaml",
                        help="plan a recovery as the recipe resolves it (its model, batch, precision, calibration): "
                             "then the positional arguments are its KEY=VALUE overrides, and --processes, "
                             "--node-processes, --sharding, --device-memory, --host-memory and "
                             "--load-on-every-process say how it is launched")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --config: the recipe's overrides")
    parser.add_argument("--processes", type=positive_int, default=1, help="processes (GPUs) of the recipe (default 1)")
    parser.add_argument("--node-processes", type=positive_int, default=None,
                        help="processes on one node, sharing its host memory (default: all)")
    parser.add_argument("--sharding", choices=SHARDING, default="ddp", help="with several processes (default ddp)")
    parser.add_argument("--device-memory", default=None, help="memory of one GPU, e.g. 80GB (default: a CPU run)")
    parser.add_argument("--host-memory", default=None, help="RAM of the node, e.g. 2TB (default: not checked)")
    parser.add_argument("--trainable", choices=TRAINABLE, default="all")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="bf16: autocast over fp32 weights")
    parser.add_argument("--teacher", choices=("sharded", "whole"), default="sharded", help="under fsdp2")
    parser.add_argument("--load-on-every-process", action="store_true",
                        help="under fsdp2: every process reads the weights (fsdp_cpu_ram_efficient_loading: false)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per process and step (default 1)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens a row (default 512)")
    parser.add_argument("--optimizer-offload", action="store_true", help="FSDP2's CPU offload (fsdp_offload_params)")
    parser.add_argument("--no-calibration", action="store_true", help="the recipe starts from a converted model")
    parser.add_argument("--weights-on-disk", action="store_true",
                        help="convert as `normswap convert --max-host-memory` does below the model's size: weights in "
                             "their shards, one block in memory, no end-to-end steps")
    parser.set_defaults(plan_defaults={name: parser.get_default(name) for name in DECIDED_BY_THE_RECIPE})


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 when it fits (or nothing was given to check), 1 when it does not, 2 on bad input."""
    if args.config:
        return recipe_plan(args)
    if args.model is None or args.overrides:
        print("normswap: error: name a MODEL to plan (normswap plan MODEL), or a recipe's config and its KEY=VALUE "
              "overrides (normswap plan --config RECIPE.yaml ...)", file=sys.stderr)
        return 2
    try:
        settings = PlanSettings(processes=args.processes, node_processes=args.node_processes, sharding=args.sharding, device_memory=args.device_memory,
                                host_memory=args.host_memory, trainable=args.trainable, lora_rank=args.lora_rank,
                                precision=args.precision, shard_teacher=args.teacher == "sharded",
                                load_once=not args.load_on_every_process,
                                gradient_checkpointing=args.gradient_checkpointing, batch_size=args.batch_size,
                                seq_len=args.seq_len, optimizer_offload=args.optimizer_offload,
                                calibrate=not args.no_calibration, weights_on_disk=args.weights_on_disk)
        result = plan(args.model, settings)
    except PlanError as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0 if result.fits else 1


def recipe_plan(args: argparse.Namespace) -> int:
    """The plan of a recovery as the recipe resolves it on this launch (``RecoveryRun``): its original, its batch
    (sized in tokens on a GPU: ``step_tokens``), its calibration or converted start, its precision."""
    # lazy: the training layer brings transformers' Trainer and peft (~0.3 s), which `normswap --help` and a
    # model's plan do without
    from ..training.config import read_recipe_config
    from ..training.recovery_run import RecoveryRunError, resolve_run

    given = [name for name in DECIDED_BY_THE_RECIPE if getattr(args, name) != args.plan_defaults[name]]
    if given:
        flag = given[0].replace("_", "-")
        print(f"normswap: error: --{flag}: the recipe's config decides it ({DECIDED_BY_THE_RECIPE[given[0]]}); "
              "set it there or as an override", file=sys.stderr)
        return 2
    try:
        config = read_recipe_config(args.config, [a for a in (args.model, *args.overrides) if a is not None])
        device_memory = parse_bytes(args.device_memory) if args.device_memory else None
        run = resolve_run(config, processes=args.processes, device="cuda:0" if device_memory else "cpu",
                          cpu=device_memory is None, sharded=args.sharding == "fsdp2",
                          load_once=not args.load_on_every_process, device_memory=device_memory)
        settings = dataclasses.replace(run_plan_settings(run, device_memory), host_memory=args.host_memory,
                                       node_processes=args.node_processes)
        result = plan(run.original, settings)
    except (ValidationError, RecoveryRunError, PlanError, OSError) as error:
        print(f"normswap: error: {error}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0 if result.fits else 1
