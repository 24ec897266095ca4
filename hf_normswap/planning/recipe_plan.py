"""The plan of a recipe run from its own settings (``hf_normswap.training.config.RecipeConfig``), so the recipe can
log at start what it is about to need. Read by attribute: this stage sits below training."""

from __future__ import annotations

from ..calibration.calibrate import STRATEGIES
from .plan import MemoryPlan, plan
from .plan_settings import PlanSettings


def recipe_settings(config, processes: int, sharded: bool, device_memory: int | None = None,
                    load_once: bool = True) -> PlanSettings:
    """:class:`PlanSettings` of ``config`` launched on ``processes`` processes (FSDP2 when ``sharded``, the weights
    read by the main process alone when ``load_once``).
    ``precision: auto`` is planned as fp32, the larger of its two answers' activations."""
    training = config.training
    return PlanSettings(
        processes=processes, sharding="fsdp2" if sharded else "ddp", device_memory=device_memory,
        trainable=config.trainable, lora_rank=config.lora.r,
        precision="bf16" if config.precision == "bf16" else "fp32", shard_teacher=config.shard_teacher,
        load_once=load_once,
        gradient_checkpointing=bool(training.get("gradient_checkpointing", False)),
        batch_size=int(training.get("per_device_train_batch_size", 1)), seq_len=config.block_len,
        hidden_distill=bool(config.distill.hidden or config.distill.embedding), head_chunk=config.head_chunk,
        calibrate=config.original is None, eval_len=config.final_eval.max_length or 512,
        **calibration_settings(config.calibration))


def calibration_settings(calibration) -> dict:
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


def recipe_plan(config, processes: int, sharded: bool, device_memory: int | None = None,
                load_once: bool = True) -> MemoryPlan:
    """The memory plan of a recipe run: its original model (``original``, else ``model``) under its settings."""
    return plan(config.original or config.model, recipe_settings(config, processes, sharded, device_memory, load_once))
