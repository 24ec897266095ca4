"""Step 3 of the recipe: the training rows, the trainable parameters, the hand-over, the precision, the loss's
settings, then :class:`NormSwapTrainer` from the last checkpoint when resuming."""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

from accelerate.utils import broadcast_object_list
from datasets import Dataset, IterableDataset
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_utils import TrainOutput

from ..checkpoint.record import ConversionRecord
from ..model_inputs import ends_in_hidden_states
from ..precision import PrecisionChoice
from .compiled_blocks import compile_blocks
from .first_scale import FirstScaleHandover
from .hand_overs import converted_roles
from .hand_overs.blend import HandOverError, ProgressiveSwap, ProgressiveSwapCallback
from .recipe_data import recipe_datasets, sentence_steps
from .recipe_models import skeleton_to_gather
from .recipe_settings import fail
from .recovery_loss import RecoveryLoss
from .recovery_run import RecoveryRun
from .run_dir import ResumePoint
from .saturation import SaturationLog
from .step_precision import training_precision
from .trainable import apply_lora, disable_dropout, freeze_embeddings, set_trainable
from .trainer import NormSwapTrainer
from .wall_clock import FirstStepClock, WallClockStop


@dataclasses.dataclass
class TrainingRun:
    """What step 3 leaves for step 4: the trainer after training and what the summary records of the launch."""
    trainer: NormSwapTrainer
    result: TrainOutput
    precision: PrecisionChoice
    skeleton: nn.Module | None  # the parameterless copy the sharded student is gathered into (FSDP2)
    eval_set: Dataset | None  # the eval blocks; None for a sentence encoder
    encoder: bool
    wall: float
    last: str | None
    resumed: dict
    first_step: float | None  # seconds from the launch to its first step
    hand_over: ProgressiveSwapCallback | None = None  # the taper's or the progressive swap's callback


def train(run: RecoveryRun, student, original, tokenizer, state, log, launched: float,
          resume_from: ResumePoint) -> TrainingRun:
    """Step 3: the training rows, the trainable parameters (norms, all, LoRA; progressive conversion), the
    precision, then :class:`NormSwapTrainer` from ``resume_from`` (the run folder's last checkpoint when resuming;
    ``launched``: when the launch started, ``time.monotonic()``, for the seconds to its first step)."""
    config = run.settings
    encoder = ends_in_hidden_states(original)
    distill = config.distill
    if encoder and not (distill.weight == 1 and not distill.logits and (distill.hidden or distill.embedding)):
        fail("a sentence encoder has no logits: train it on hidden states alone, distill.weight=1 "
             "distill.logits=false and distill.hidden or distill.embedding > 0 (recipes/configs/minilm-eln.yaml)")
    train_set, eval_set = recipe_datasets(run.text, tokenizer, original, state, encoder)
    steps = (sentence_steps(config.train_tokens, run.tokens_per_step // config.block_len, train_set)
             if encoder and config.train_tokens is not None else run.steps)
    if steps <= 0 and not hasattr(train_set, "__len__"):
        fail(f"train_data {config.train_data} is read as a stream, which has no epochs: set train_tokens or "
             "training.max_steps")
    dispatch = own_share(train_set, config.streaming)  # how each process reads its rows
    kind = config.hand_over.chosen(config.progressive, config.taper, config.trainable)
    swap = progressive_swap(kind, steps, run.original_read_once, student, original, state, log)
    hand_over = kind.callback(swap, converted_roles(student), log) if swap is not None else None
    loss = recovery_loss(distill, config.head_chunk, student)
    student, trainable = choose_trainable(student, config.trainable, config.lora, config.freeze_embeddings, log)
    rows = f"sentences (at most {config.block_len} tokens)" if encoder else f"blocks of {config.block_len} tokens"
    mix = f", a mix of {' + '.join(run.text.sources)}" if len(run.text.sources) > 1 else ""
    log(f"training {trainable:,} parameters ({config.trainable}) on "
        + (f"{config.train_data} streamed in {rows}" if not hasattr(train_set, "__len__") else
           f"{len(train_set)} {rows}{mix}"))
    precision = training_precision(config.precision, loss, run.batch_size, student, original, train_set,
                                   tokenizer, state)
    log(precision.describe())
    if config.compile if config.compile is not None else state.device.type == "cuda":
        log(f"compiled: {compile_blocks([student, original])} blocks of the student and the original")
    args = TrainingArguments(output_dir=str(Path(config.output_dir)), seed=config.seed, learning_rate=config.lr.base,
                             prediction_loss_only=True, eval_on_start=not encoder,
                             **{"include_num_input_tokens_seen": "non_padding" if encoder else "all",
                                # a loss that is not finite is logged as it is, not as the average of the rest
                                "logging_nan_inf_filter": False,
                                **dispatch,
                                **config.training, "per_device_train_batch_size": run.batch_size,
                                "gradient_accumulation_steps": run.accumulation, "use_cpu": run.cpu,
                                "max_steps": steps, "bf16": precision.bf16})
    first_step = FirstStepClock(launched)
    callbacks = [first_step, *([WallClockStop(config.max_minutes)] if config.max_minutes else [])]
    callbacks.append(SaturationLog(student, Path(config.output_dir) / "saturation.jsonl" if state.is_main_process
                                   else None))
    callbacks += [c for c in [FirstScaleHandover.of(student, config.first_scale_handover)] if c is not None]
    if hand_over is not None:
        callbacks.append(hand_over)
    skeleton = skeleton_to_gather(student)  # after LoRA and the trainable choice: the model as it is sharded
    trainer = NormSwapTrainer(model=student, args=args, train_dataset=train_set, eval_dataset=eval_set,
                              processing_class=tokenizer, callbacks=callbacks,
                              teacher=original if distill.weight > 0 else None, loss=loss,
                              shape_lr=config.lr.shape, gamma_lr=config.lr.gamma, shard_teacher=config.shard_teacher)
    last = resume_from.checkpoint
    log(f"resuming from {last}" if last else "training from the calibrated model")
    start = time.time()
    try:
        result = trainer.train(resume_from_checkpoint=last)
    except HandOverError as error:  # checked with the Trainer's count of steps: an epoch-based run's, a resume's
        fail(str(error))
    return TrainingRun(trainer=trainer, result=result, precision=precision, skeleton=skeleton, eval_set=eval_set,
                       encoder=encoder, wall=time.time() - start, last=last, resumed=resume_from.state,
                       first_step=first_step.seconds, hand_over=hand_over)


def own_share(train_set, hub_stream: bool) -> dict:
    """Every process reads a stream of ours whole and the Trainer gives each its slice of every global batch
    (accelerate's ``dispatch_batches`` off), so each draws its own share of the original's samples; a Hub stream
    is read by the main process and dispatched (accelerate's default for a stream)."""
    ours = isinstance(train_set, IterableDataset) and not hub_stream
    return {"accelerator_config": {"dispatch_batches": False}} if ours else {}


def progressive_swap(hand_over, steps: int, from_main: bool, student, original, state, log):
    """The :class:`ProgressiveSwap` of the run's ``hand_over`` (``hand_overs.HandOver``; None: none): the
    converted norms blended with the original's (the main process's, ``from_main``, where the others hold the
    original on the meta device) along its stages (``steps`` the run's where known, -1 in an epoch-based run:
    the taper's callback fixes its length when training starts)."""
    ConversionRecord.amend(student, hand_over=None)  # a start saved mid hand-over: this run records its own
    if hand_over is None:
        return None
    roles = converted_roles(student)
    stages = hand_over.stages(roles, steps)
    norms = {n: original.get_submodule(n) for n in roles}
    if from_main:
        weights = broadcast_object_list([{n: m.state_dict() for n, m in norms.items()}
                                         if state.is_main_process else None])[0]
        for name, module in norms.items():  # a copy: the original is sharded on the meta device
            norms[name] = copy.deepcopy(module)
            norms[name].load_state_dict(weights[name], assign=True)
    swap = ProgressiveSwap(student, norms, stages)
    started = hand_over.started(stages)
    if started:
        log(started)
    return swap


def recovery_loss(distill, head_chunk: int, student):
    """The loss of the ``distill`` settings (:class:`RecoveryLoss`), built before LoRA wraps the student: a term's
    hooks (the scale anchor's) sit on the modules themselves."""
    try:
        return RecoveryLoss.of(distill, student, head_chunk)
    except ValueError as error:  # a term that cannot work here (the scale anchor without a converted final norm)
        fail(str(error))


def choose_trainable(student, which: str, lora, freeze: bool, log):
    """Dropout off, then the parameters ``which`` names (norms, all, or ``lora``'s adapters), the embeddings frozen
    if ``freeze``; returns the student (LoRA wraps it) and how many parameters train."""
    dropout = disable_dropout(student)  # before LoRA, whose own dropout is the lora config's
    if dropout:
        log(f"dropout off in {dropout} places of the student: it is fitted to the original's exact outputs")
    if which == "lora":
        student = apply_lora(student, **dataclasses.asdict(lora))
        trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    else:
        trainable = set_trainable(student, which)
    return student, freeze_embeddings(student) if freeze else trainable
