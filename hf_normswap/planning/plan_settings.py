"""The settings that change how much memory a conversion and a recovery take, checked before anything is built."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .sizes import PlanError

TRAINABLE = ("all", "norms", "lora")
PRECISIONS = ("fp32", "bf16")
SHARDING = ("ddp", "fsdp2")
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int | float | None, what: str = "memory") -> int | None:
    """``80GB``, ``80GiB``, ``512MB`` or a number of bytes; None stays None."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        if text is not None and text <= 0:
            raise PlanError(f"{what} must be more than 0 bytes, not {text}")
        return None if text is None else int(text)
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = found.group(2).upper() if found else None
    if not found or unit not in UNITS or float(found.group(1)) <= 0:
        raise PlanError(f"{what} {text!r} is not a size: write it as e.g. 80GB, 80GiB or 512MB")
    return int(float(found.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class PlanSettings:
    """One run's memory-relevant settings (the recipe's keys in brackets).

    ``device_memory``: bytes of one accelerator (None: the run is on the CPU, everything in host memory);
    ``host_memory``: bytes of the node's RAM, shared by its processes (None: not checked). ``calibrate``: the recipe
    converts with calibration first (False: it starts from a converted checkpoint).
    """

    processes: int = 1
    node_processes: int | None = None  # processes on one node (None: all of them): what shares its host memory
    sharding: str = "ddp"  # with processes > 1: "ddp" (every process whole) or "fsdp2"
    device_memory: int | None = None
    host_memory: int | None = None
    trainable: str = "all"  # (trainable)
    lora_rank: int = 16  # (lora.r)
    precision: str = "fp32"  # (precision): bf16 is autocast over fp32 weights
    shard_teacher: bool = True  # (shard_teacher), under fsdp2
    load_once: bool = True  # under fsdp2 (fsdp_cpu_ram_efficient_loading): only the main process reads the weights
    gradient_checkpointing: bool = False  # (training.gradient_checkpointing)
    batch_size: int = 1  # rows per process and step (training.per_device_train_batch_size)
    seq_len: int = 512  # tokens a row (block_len)
    optimizer_offload: bool = False  # FSDP2's CPU offload (fsdp_offload_params): shards, gradients, AdamW on the host
    hidden_distill: bool = True  # the layer-wise term (distill.hidden > 0): the teacher returns every block's output
    head_chunk: int = 256  # (head_chunk): tokens whose logits the head loss holds at a time (0: all of them)
    # the recipe's loss terms that are on (distill): each says what it holds in a step, memory(sizes, tokens, bytes)
    loss_terms: tuple = ()
    calibrate: bool = True
    calibration_blocks: int = 64  # (calibration.num_blocks)
    calibration_len: int = 512  # (calibration.block_len)
    calibration_batch: int = 8  # (calibration.batch_size)
    tune_rows: int = 16  # (calibration.tune_blocks; 0 with calibration.tune_steps=0): end-to-end KL sequences
    block_rows: int = 60  # block_steps x block_rows: the sequences block tuning reads
    block_weights: bool = True  # calibration.block_weights_lr > 0: each block's weights tuned with Adam
    cache_on_disk: bool = False  # calibration.cache_memory_mb=0: the hidden states between blocks in files
    weights_on_disk: bool = False  # convert --max-host-memory: weights in their shards, one block in memory
    eval_len: int = 512  # (final_eval.max_length)

    def __post_init__(self):
        if isinstance(self.head_chunk, bool) or not isinstance(self.head_chunk, int) or self.head_chunk < 0:
            raise PlanError(f"head-chunk must be a whole number of at least 0, not {self.head_chunk!r}")
        whole = ("processes", "batch_size", "seq_len", "lora_rank", "calibration_blocks",
                 "calibration_len", "calibration_batch", "eval_len")
        for name in whole:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name.replace('_', '-')} must be a whole number of at least 1, not {value!r}")
        if self.node_processes is not None and not (isinstance(self.node_processes, int)
                                                    and 1 <= self.node_processes <= self.processes):
            raise PlanError(f"node-processes must be a whole number from 1 to processes ({self.processes}), "
                            f"not {self.node_processes!r}")
        for name, allowed in (("trainable", TRAINABLE), ("precision", PRECISIONS), ("sharding", SHARDING)):
            if getattr(self, name) not in allowed:
                raise PlanError(f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.optimizer_offload and self.sharding != "fsdp2":
            raise PlanError("optimizer offload is FSDP2's (fsdp_offload_params): add sharding fsdp2")
        for name in ("device_memory", "host_memory"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name.replace("_", " ")))

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp2"

    @property
    def per_node(self) -> int:
        return self.node_processes or self.processes

    def replace(self, **changes) -> "PlanSettings":
        return dataclasses.replace(self, **changes)
