"""A recovery run resolved once: what the recipe decides from its settings and its launch, before anything loads.

The recipe's settings (``hf_normswap.training.config.RecipeConfig``) say what the user asked; a run also decides
whether it calibrates or loads a converted checkpoint, which original it trains toward, where it runs, how the
weights are placed, and where it writes. Each of these was decided where it was needed, some of them several times
(the converted checkpoint's ``config.json`` read at six call sites) and some by changing the settings in place
(``use_cpu``, ``max_steps``, ``bf16``, ``calibration.device``); the plan decided "calibrates?" by another rule than
the recipe. :func:`resolve_run` decides them once, and the recipe, its memory plan and the benchmarks read the
frozen :class:`RecoveryRun`. Read by attribute: this stage sits below training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path



STEP_TOKENS_ON_CUDA = 65536  # llm.c trains GPT-2 124M at 2^19 tokens a step; 2^16 keeps 30M tokens at 450+ steps
BATCHES = (64, 32, 16, 8, 4, 2, 1)  # sequences a process a micro-batch, tried largest first


class RecoveryRunError(ValueError):
    """The settings name a run that cannot be resolved (a converted checkpoint without its original)."""


@dataclass(frozen=True)
class RecoveryRun:
    """What a recovery run decides, and the settings it was resolved from (read, never changed)."""

    settings: object  # the checked RecipeConfig
    converted: dict | None  # the converted checkpoint's config.json; None: the run calibrates ``settings.model``
    original: str  # the original the converted model trains toward (teacher and reference)
    calibration: object  # the CalibrationConfig the run calibrates with (its device set where FSDP2 shards)
    cpu: bool  # no GPU, or ``training.use_cpu``
    device: str  # where accelerate trains this process: cpu, cuda:N
    processes: int
    is_main: bool  # this process is the main one
    sharded: bool  # FSDP2
    load_once: bool  # under FSDP2 with ``fsdp_cpu_ram_efficient_loading``: the main process alone reads weights
    teacher_sharded: bool  # the original sharded as the teacher (distilled from, ``shard_teacher``)
    batch_size: int  # sequences a process a micro-batch (``per_device_train_batch_size``)
    accumulation: int  # micro-batches a step (``gradient_accumulation_steps``)
    tokens_per_step: int  # tokens of a global batch of packed blocks
    steps: int  # ``max_steps``: ``train_tokens`` over ``tokens_per_step`` where given, else ``training.max_steps``
    output_dir: Path
    save_path: Path

    @property
    def calibrates(self) -> bool:
        return self.converted is None

    @property
    def calibrated_cache(self) -> Path:
        """Where the calibrated model is kept so that a resumed run does not calibrate again."""
        return self.output_dir / "calibrated"

    @property
    def original_read_once(self) -> bool:
        """Whether the processes but the main one hold the original on the meta device until it is sharded: what
        is drawn from it before then (its samples, the progressive swap's norms) comes from the main process."""
        return self.load_once and self.processes > 1 and self.teacher_sharded

    @property
    def loaded_by_main(self) -> bool:
        """Whether this process reads no weights (loading once a node, every process but the main one)."""
        return self.load_once and self.processes > 1 and not self.is_main


def converted_checkpoint(config) -> dict | None:
    """config.json of ``model`` when it is a checkpoint converted by hf_normswap (no calibration then), else None:
    the one rule by which the plan and the recipe decide whether the run calibrates."""
    from ..checkpoint.record import converted_config

    return converted_config(config.model) if Path(config.model).is_dir() else None


def resolve_run(config, *, processes: int = 1, is_main: bool = True, device: str = "cpu", cpu: bool = True,
                sharded: bool = False, load_once: bool = False, device_memory: int | None = None) -> RecoveryRun:
    """The :class:`RecoveryRun` of checked settings launched on ``processes`` processes, this one training on
    ``device`` (of ``device_memory`` bytes); :class:`RecoveryRunError` for a converted checkpoint that names no
    original. With ``step_tokens`` (on CUDA by default :data:`STEP_TOKENS_ON_CUDA`) the micro-batch is the largest
    the memory plan fits on the device and the rest of the step is accumulated; else the training section's."""
    converted = converted_checkpoint(config)
    original = config.model
    if converted is not None:
        from ..checkpoint.record import ConversionRecord

        original = config.original or ConversionRecord.in_config(converted).base_model
        if not original:
            raise RecoveryRunError("the checkpoint does not name its original; set original: in the config")
    calibration = config.calibration
    if sharded and device != "cpu" and calibration.device is None:  # the model stays in CPU memory for FSDP2 to
        calibration = dataclasses.replace(calibration, device=device)  # shard: its blocks visit the device in turn
    training = config.training
    run = _stepped(RecoveryRun(
        settings=config, converted=converted, original=original, calibration=calibration, cpu=bool(cpu),
        device=str(device), processes=processes, is_main=is_main, sharded=sharded, load_once=load_once,
        teacher_sharded=bool(config.shard_teacher) and config.distill.weight > 0,
        batch_size=training["per_device_train_batch_size"],
        accumulation=training.get("gradient_accumulation_steps", 1), tokens_per_step=0, steps=0,
        output_dir=Path(config.output_dir), save_path=config.save_path))
    step_tokens = config.step_tokens or (STEP_TOKENS_ON_CUDA if device.startswith("cuda") else None)
    if not step_tokens:
        return run
    from .plan import plan
    from .recipe_plan import recipe_settings
    from .sizes import PlanError

    try:
        memory = plan(run.original, recipe_settings(run, device_memory))
    except (PlanError, OSError, ValueError):  # a model the plan cannot read: the configured batch, accumulated
        batch = run.batch_size
        accumulation = math.ceil(step_tokens / (batch * config.block_len * processes))
    else:
        batch, accumulation = step_batches(memory, step_tokens, config.block_len, processes)
    return _stepped(dataclasses.replace(run, batch_size=batch, accumulation=accumulation))


def step_batches(memory, step_tokens: int, seq_len: int, processes: int) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` for at least ``step_tokens`` tokens a step over ``processes``: the largest of
    :data:`BATCHES` whose memory plan (``memory``, a :class:`~hf_normswap.planning.MemoryPlan` with the device's
    memory) fits, then as many accumulated micro-batches as the rest needs."""
    from .plan import replan

    whole = max(1, step_tokens // (seq_len * processes))
    batch = next((b for b in BATCHES if b <= whole and replan(memory, batch_size=b).fits), 1)
    return batch, math.ceil(step_tokens / (batch * seq_len * processes))


def _stepped(run: RecoveryRun) -> RecoveryRun:
    """``run`` with its tokens a step and its steps (``train_tokens`` over the tokens a step where given, else
    ``training.max_steps``) from its batch, accumulation and processes."""
    config = run.settings
    tokens_per_step = config.block_len * run.batch_size * run.accumulation * run.processes
    steps = (max(1, math.ceil(config.train_tokens / tokens_per_step)) if config.train_tokens is not None
             else config.training.get("max_steps", -1))
    return dataclasses.replace(run, tokens_per_step=tokens_per_step, steps=steps)
