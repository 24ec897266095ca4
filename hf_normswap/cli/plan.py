"""``normswap plan MODEL``: the memory a conversion and a recovery need, from the model's config alone
(``hf_normswap.planning``)."""

from __future__ import annotations

import argparse
import sys

from ..planning.plan_settings import PRECISIONS, SHARDING, TRAINABLE


def add_parser(commands) -> None:
    """The verb's arguments: the model and every setting :class:`~hf_normswap.planning.plan_settings.PlanSettings` takes."""
    parser = commands.add_parser("plan", help="memory a conversion and a recovery need, from the config alone")
    parser.add_argument("model", help="Hub id, model directory, config.json, .gguf or offline:NAME (only the "
                                      "config is read)")
    parser.add_argument("--processes", type=int, default=1, help="processes (GPUs) of the recipe (default 1)")
    parser.add_argument("--node-processes", type=int, default=None,
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


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 when it fits (or nothing was given to check), 1 when it does not, 2 on bad input."""
    from ..planning.plan import plan
    from ..planning.plan_settings import PlanSettings
    from ..planning.sizes import PlanError

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
