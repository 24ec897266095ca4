"""A recovery run resolved once: what the recipe decides from its settings and its launch, before anything loads.

The recipe's settings (``hf_normswap.training.config.RecipeConfig``) say what the user asked; a run also decides
whether it calibrates or loads a converted checkpoint, which original it trains toward, where it runs, how the
weights are placed, and where it writes. :func:`resolve_run` decides them once, without changing the settings, so
that the recipe, its memory plan (``planning.recipe_plan``, which reads it by attribute) and the benchmarks read one
frozen :class:`RecoveryRun` and cannot disagree. A resumed run's calibration cache is checked against the settings
here too (:func:`check_calibration_cache`), before anything loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ..calibration.calibrate import CalibrationConfig
from ..checkpoint.config_checks import check_block
from ..checkpoint.record import ConversionRecord, converted_config
from ..data import DataError, sample_length
from ..data.sources import source
from ..planning import PlanError, plan, run_plan_settings
from ..planning.memory_plan import MemoryPlan, replan
from ..surgery import ConvertConfig
from ..validation import ValidationError
from .config import RecipeConfig

STEP_TOKENS_ON_CUDA = 65536  # llm.c trains GPT-2 124M at 2^19 tokens a step; 2^16 keeps 30M tokens at 450+ steps
BATCHES = (64, 32, 16, 8, 4, 2, 1)  # sequences a process a micro-batch, tried largest first


@dataclass(frozen=True)
class TrainingText:
    """The run's text, decided with its steps: each training source and the tokens read of it, and how its rows are
    drawn. The data stage reads these plain values, never the settings."""

    sources: tuple[str, ...]  # ``train_data``: one source, or a mix in equal shares
    shares: tuple[int | None, ...]  # tokens read of each source (None: all of it): :func:`training_shares`
    capped: bool  # ``max_train_tokens`` given: a streamed source stops at its share too
    block_len: int
    hub_stream: bool  # ``train_data`` streamed from the Hub (``streaming``)
    seed: int
    drawn_first: bool  # the original's samples drawn before training: a teacher sharded by FSDP2 cannot sample
    from_main: bool  # the main process draws what comes from the original and sends it (``original_read_once``)
    eval_data: str
    eval_blocks: int


class RecoveryRunError(ValueError):
    """The settings name a run that cannot be resolved (a converted checkpoint without its original)."""


@dataclass(frozen=True)
class RecoveryRun:
    """What a recovery run decides, and the settings it was resolved from (read, never changed)."""

    settings: RecipeConfig  # the checked settings
    converted: dict | None  # the converted checkpoint's config.json; None: the run calibrates ``settings.model``
    original: str  # the original the converted model trains toward (teacher and reference)
    calibration: CalibrationConfig  # what the run calibrates with (its device set where FSDP2 shards)
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
    context: dict  # tokens each setting asks of the model's context (:data:`CONTEXT_SETTINGS`)
    text: TrainingText | None = None  # the training and evaluation text, sized by the steps (set last)

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


def converted_checkpoint(model: str) -> dict | None:
    """config.json of ``model`` when it is a checkpoint converted by hf_normswap (no calibration then), else None:
    the one rule by which the plan and the recipe decide whether the run calibrates."""
    return converted_config(model) if Path(model).is_dir() else None


def check_calibration_cache(cache: Path, method: str, calibration: CalibrationConfig,
                            roles: tuple[str, ...]) -> None:
    """A resumed run that calibrates reuses its ``cache`` only if it was converted as the config asks (``method``,
    ``calibration``, the ``roles`` converted, in any order): other settings in the same output_dir would otherwise
    train a start the config does not describe. The cached model's own record (its ``ConvertConfig``) is compared
    with the config."""
    cached = converted_config(cache)
    if not cached:
        return
    record = ConversionRecord.in_config(cached)
    made = ConvertConfig.from_record(record)
    names = [f.name for f in dataclasses.fields(calibration) if f.name not in CalibrationConfig.run_time()]
    asked = {"method": method, "roles": tuple(sorted(roles)), **{name: getattr(calibration, name) for name in names}}
    recorded = {"method": made.method, "roles": tuple(sorted(made.roles)),
                **{name: getattr(made.calibration, name) for name in names}}
    filled_in = (None, "auto")  # left to the strategy: recorded as the strategy resolved them
    differ = [f"{key} {recorded[key]!r} (the config: {value!r})" for key, value in asked.items()
              if value not in filled_in and recorded[key] != value]
    if differ:
        raise ValidationError(f"{cache} was calibrated with {', '.join(differ)}: name another output_dir, or set "
                              "resume=false to calibrate again")


def resolve_run(config: RecipeConfig, *, processes: int = 1, is_main: bool = True, device: str = "cpu",
                cpu: bool = True, sharded: bool = False, load_once: bool = False,
                device_memory: int | None = None) -> RecoveryRun:
    """The :class:`RecoveryRun` of checked settings launched on ``processes`` processes, this one training on
    ``device`` (of ``device_memory`` bytes); :class:`RecoveryRunError` for a converted checkpoint that names no
    original. With ``step_tokens`` (on CUDA by default :data:`STEP_TOKENS_ON_CUDA`) the micro-batch is the largest
    the memory plan fits on the device and the rest of the step is accumulated; else the training section's."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise RecoveryRunError(f"processes must be a whole number of at least 1, got {processes!r}")
    converted = converted_checkpoint(config.model)  # read here alone: the recipe reads the run's ``converted``
    original = config.model
    if converted is not None:
        try:  # the record's every entry, before a model loads (a malformed one failed at the first save)
            record = ConversionRecord.in_config(converted)
            check_block(record)
        except ValidationError as error:
            raise RecoveryRunError(f"{config.model}: {error}") from None
        original = config.original or record.base_model
        if config.roles is not None:
            raise RecoveryRunError(f"roles: {config.model} is converted already, its norms fixed; leave roles unset, "
                                   "or name its original as model")
        if not original:
            raise RecoveryRunError("the checkpoint does not name its original; set original: in the config")
    calibration = config.calibration
    if sharded and device != "cpu" and calibration.device is None:  # the model stays in CPU memory for FSDP2 to
        calibration = dataclasses.replace(calibration, device=device)  # shard: its blocks visit the device in turn
    training = config.training
    batch, accumulation = training["per_device_train_batch_size"], training.get("gradient_accumulation_steps", 1)
    max_steps = training.get("max_steps", -1)
    run = RecoveryRun(
        settings=config, converted=converted, original=original, calibration=calibration, cpu=bool(cpu),
        device=str(device), processes=processes, is_main=is_main, sharded=sharded, load_once=load_once,
        teacher_sharded=bool(config.shard_teacher) and config.distill.weight > 0, batch_size=batch,
        accumulation=accumulation, output_dir=Path(config.output_dir), save_path=config.save_path,
        **step_count(config.block_len, batch, accumulation, processes, config.train_tokens, max_steps),
        context=context_lengths(converted is None, config.block_len, config.final_eval.max_length,
                                calibration.block_len, calibration.data, config.train_sources, config.eval_data))
    step_tokens = config.step_tokens or (STEP_TOKENS_ON_CUDA if device.startswith("cuda") else None)
    if step_tokens:
        try:
            memory = plan(run.original, run_plan_settings(run, device_memory))
        except (PlanError, OSError, ValueError):  # a model the plan cannot read: the configured batch, accumulated
            accumulation = math.ceil(step_tokens / (batch * config.block_len * processes))
        else:
            batch, accumulation = step_batches(memory, step_tokens, config.block_len, processes)
        run = dataclasses.replace(run, batch_size=batch, accumulation=accumulation, **step_count(
            config.block_len, batch, accumulation, processes, config.train_tokens, max_steps))
    run_tokens = config.train_tokens or (run.steps * run.tokens_per_step if run.steps > 0 else None)
    return dataclasses.replace(run, text=TrainingText(
        sources=tuple(config.train_sources), capped=config.max_train_tokens is not None,
        shares=training_shares(config.train_sources, config.block_len, run_tokens, config.max_train_tokens),
        block_len=config.block_len, hub_stream=bool(config.streaming), seed=config.seed,
        drawn_first=run.sharded and run.teacher_sharded, from_main=run.original_read_once,
        eval_data=config.eval_data, eval_blocks=config.eval_blocks))


def step_batches(memory: MemoryPlan, step_tokens: int, seq_len: int, processes: int) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` for at least ``step_tokens`` tokens a step over ``processes``: the largest of
    :data:`BATCHES` whose memory plan (``memory``, a :class:`~hf_normswap.planning.MemoryPlan` with the device's
    memory) fits, then as many accumulated micro-batches as the rest needs."""
    whole = max(1, step_tokens // (seq_len * processes))
    batch = next((b for b in BATCHES if b <= whole and replan(memory, batch_size=b).fits), 1)
    return batch, math.ceil(step_tokens / (batch * seq_len * processes))


def step_count(block_len: int, batch: int, accumulation: int, processes: int, train_tokens: int | None,
               max_steps: int) -> dict:
    """The run's ``tokens_per_step`` (a global batch of packed blocks) and ``steps``: ``train_tokens`` over the
    tokens a step where given, else ``max_steps``."""
    tokens_per_step = block_len * batch * accumulation * processes
    steps = max(1, math.ceil(train_tokens / tokens_per_step)) if train_tokens is not None else max_steps
    return {"tokens_per_step": tokens_per_step, "steps": steps}


def training_shares(sources: list[str], block_len: int, run_tokens: int | None,
                    max_train_tokens: int | None) -> tuple[int | None, ...]:
    """Tokens to read of each training source: its share of ``max_train_tokens`` (None: all of it); for the
    original's samples, which have no end, its share of what the run trains on over every launch (``run_tokens``)
    within that cap. A share is at least a block."""
    def share(tokens):
        return None if tokens is None else max(tokens // len(sources), block_len)

    cap = share(max_train_tokens)
    return tuple(min(share(run_tokens), cap or share(run_tokens))
                 if source(spec).samples_original and run_tokens is not None else cap for spec in sources)


# The settings that must fit in the model's context: token lengths, and each generated source's sequence length.
CONTEXT_SETTINGS = ("block_len", "calibration.block_len", "final_eval.max_length", "calibration.data", "train_data",
                    "eval_data")


def context_lengths(calibrates: bool, block_len: int, eval_length: int | None, calibration_len: int,
                    calibration_data: str | None, train_sources: list[str], eval_data: str) -> dict[str, int | None]:
    """Each of :data:`CONTEXT_SETTINGS` with the tokens it asks of the model's context (None: unset or unused; the
    calibration's only when the run calibrates); :class:`RecoveryRunError` naming the key of a malformed spec."""
    def length(key: str, spec: str | None) -> int | None:
        try:
            return sample_length(spec)
        except DataError as error:
            raise RecoveryRunError(f"{key}: {error}") from None

    lengths = {"block_len": block_len, "final_eval.max_length": eval_length,
               "calibration.block_len": calibration_len if calibrates else None,
               "calibration.data": length("calibration.data", calibration_data) if calibrates else None,
               "train_data": max(filter(None, (length("train_data", s) for s in train_sources)), default=None),
               "eval_data": length("eval_data", eval_data)}
    return {key if key.endswith(("len", "length")) else f"{key} generated: length": lengths[key]
            for key in CONTEXT_SETTINGS}
