"""The plan of a recipe run from the run it resolved (``training.recovery_run.RecoveryRun``), so the recipe can log at
start what it is about to need. Read by attribute: the run is resolved in the training stage, above this one."""

from __future__ import annotations

from ..calibration.calibrate import STRATEGIES, CalibrationConfig
from .plan_settings import PlanSettings


def run_plan_settings(run, device_memory: int | None = None) -> PlanSettings:
    """:class:`PlanSettings` of a resolved recovery run (``training.recovery_run.RecoveryRun``): its processes,
    sharding (FSDP2 or DDP), whether the main process alone reads the weights, whether it calibrates, and its settings.
    ``precision: auto`` is planned as fp32, the larger of its two answers' activations."""
    config, training = run.settings, run.settings.training
    return PlanSettings(
        processes=run.processes, sharding="fsdp2" if run.sharded else "ddp", device_memory=device_memory,
        trainable=config.trainable, lora_rank=config.lora.r,
        precision="bf16" if config.precision == "bf16" else "fp32", shard_teacher=config.shard_teacher,
        load_once=run.load_once,
        gradient_checkpointing=bool(training.get("gradient_checkpointing", False)),
        batch_size=run.batch_size, seq_len=config.block_len,
        hidden_distill=config.distill.hidden_states, loss_terms=config.distill.active_terms,
        head_chunk=config.head_chunk,
        calibrate=run.calibrates, eval_len=config.final_eval.max_length or 512,
        **calibration_settings(run.calibration))


def calibration_settings(calibration: CalibrationConfig) -> dict:
    """The :class:`PlanSettings` fields of a ``CalibrationConfig``; what it leaves to its strategy is the block
    strategy's (the language models' default)."""
    block = STRATEGIES["block"]

    def preset(name):
        value = getattr(calibration, name, None)
        return getattr(block, name) if value is None else value

    tune_steps = preset("tune_steps")
    return dict(calibration_blocks=calibration.num_blocks, calibration_len=calibration.block_len,
                calibration_batch=calibration.batch_size, tune_rows=preset("tune_blocks") if tune_steps else 0,
                block_rows=preset("block_steps") * preset("block_rows"), block_weights=preset("block_weights_lr") > 0,
                cache_on_disk=calibration.cache_memory_mb == 0)
