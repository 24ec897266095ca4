"""The pieces of the recipe's training step (``RecoveryRecipe.train``), each a function of plain values: how each
process reads its rows, the hand-over's blend, the loss, the trainable parameters, the Trainer's callbacks; and
:class:`TrainingRun`, what the step leaves for the next."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from accelerate.utils import broadcast_object_list
from datasets import Dataset, IterableDataset
from torch import nn
from transformers.trainer_utils import TrainOutput

from ..checkpoint.record import ConversionRecord
from ..precision import PrecisionChoice
from .first_scale import FirstScaleHandover
from .hand_overs import converted_roles
from .hand_overs.blend import ProgressiveSwap, ProgressiveSwapCallback
from .recipe_settings import fail
from .recovery_loss import RecoveryLoss
from .saturation import SaturationLog
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


def training_callbacks(student, first_step: FirstStepClock, max_minutes: float | None, saturation_log: Path | None,
                       first_scale_handover, hand_over) -> list:
    """The clock to the first step, the wall-clock stop (``max_minutes``; None: none), the saturation log (written to
    ``saturation_log`` where given: the main process), the first-scale hand-over and the run's hand-over
    (``hand_over``; None: none)."""
    callbacks = [first_step, *([WallClockStop(max_minutes)] if max_minutes else [])]
    callbacks.append(SaturationLog(student, saturation_log))
    callbacks += [c for c in [FirstScaleHandover.of(student, first_scale_handover)] if c is not None]
    return callbacks + ([hand_over] if hand_over is not None else [])


def own_share(train_set, hub_stream: bool) -> dict:
    """Every process reads a stream of ours whole and the Trainer gives each its slice of every global batch
    (accelerate's ``dispatch_batches`` off), so each draws its own share of the original's samples; a Hub stream
    is read by the main process and dispatched (accelerate's default for a stream)."""
    ours = isinstance(train_set, IterableDataset) and not hub_stream
    return {"accelerator_config": {"dispatch_batches": False}} if ours else {}


def progressive_swap(hand_over, steps: int, from_main: bool, student, original,
                     is_main: bool) -> tuple[ProgressiveSwap | None, str | None]:
    """The :class:`ProgressiveSwap` of the run's ``hand_over`` (``hand_overs.HandOver``; None: none) and the line
    that says how it starts: the converted norms blended with the original's (the main process's, ``from_main``,
    where the others hold the original on the meta device) along its stages (``steps`` the run's where known, -1 in
    an epoch-based run: the taper's callback fixes its length when training starts)."""
    ConversionRecord.amend(student, hand_over=None)  # a start saved mid hand-over: this run records its own
    if hand_over is None:
        return None, None
    roles = converted_roles(student)
    stages = hand_over.stages(roles, steps)
    norms = {n: original.get_submodule(n) for n in roles}
    if from_main:
        weights = broadcast_object_list([{n: m.state_dict() for n, m in norms.items()}
                                         if is_main else None])[0]
        for name, module in norms.items():  # a copy: the original is sharded on the meta device
            norms[name] = copy.deepcopy(module)
            norms[name].load_state_dict(weights[name], assign=True)
    return ProgressiveSwap(student, norms, stages), hand_over.started(stages)


def recovery_loss(distill, head_chunk: int, student):
    """The loss of the ``distill`` settings (:class:`RecoveryLoss`), built before LoRA wraps the student: a term's
    hooks (the scale anchor's) sit on the modules themselves."""
    try:
        return RecoveryLoss.of(distill, student, head_chunk)
    except ValueError as error:  # a term that cannot work here (the scale anchor without a converted final norm)
        fail(str(error))


def choose_trainable(student, which: str, lora, freeze: bool) -> tuple[nn.Module, int, int]:
    """Dropout off, then the parameters ``which`` names (norms, all, or ``lora``'s adapters), the embeddings frozen
    if ``freeze``; returns the student (LoRA wraps it), how many parameters train, and in how many places dropout
    was turned off."""
    dropout = disable_dropout(student)  # before LoRA, whose own dropout is the lora config's
    if which == "lora":
        student = apply_lora(student, **dataclasses.asdict(lora))
        trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    else:
        trainable = set_trainable(student, which)
    return student, freeze_embeddings(student) if freeze else trainable, dropout
