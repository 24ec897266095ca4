"""Fine-tuning a converted model with the transformers ``Trainer``. Calibration fits each element-wise module to its
source norm one at a time; what is left is the error the modules make together, which only training on the
network's output removes. :class:`NormSwapTrainer` keeps the Trainer's machinery (DDP / FSDP2 through accelerate,
checkpoints, resume, logging) and changes these:

- ``compute_loss``: the recovery's loss (``recovery_loss.RecoveryLoss``, the sum of its terms);
- ``create_optimizer``: the element-wise modules' parameters in their own groups (``trainable.parameter_groups``);
- ``log``: ``eval_loss`` is also logged as ``eval_perplexity``;
- ``training_step``: the first step whose loss is not finite is kept (``diverged_at``), for the finiteness gate
  before the final save (``training.divergence``);
- ``_save_checkpoint``: a checkpoint that cannot be written (a full disk) is one line naming it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from torch import nn
from transformers import Trainer

from ..checkpoint.directory import CheckpointError
from ..validation import first_line
from . import sharding
from .losses import head_chunk_for
from .recovery_loss import RecoveryLoss
from .trainable import group_learning_rates, parameter_groups


def without_autocast_wrapper(model: nn.Module) -> nn.Module:
    """``model`` with the autocast wrapper that accelerate sets on its forward under bf16 taken off (an instance
    attribute over the class's method), so that it is evaluated and saved as it reloads. accelerate's own
    ``unwrap_model(keep_fp32_wrapper=False)`` also strips transformers' forward decorators: hidden states go missing."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_original_forward", None)
    return model


class NormSwapTrainer(Trainer):
    """``Trainer`` with distillation from a frozen ``teacher`` and element-wise norm parameter groups.

    ``loss`` (:class:`~hf_normswap.training.recovery_loss.RecoveryLoss`): the configured terms, summed on each
    training batch and each logged (``ce_loss``, ``kd_loss`` ...); None, or its distillation weight 0: plain
    fine-tuning, no teacher forward. The teacher is moved to the training device and never wrapped for DDP, so
    every process holds its own copy; it runs under the student's autocast (bf16 when the Trainer's ``bf16`` is
    set). The loss's ``head_chunk`` tokens at a time go through the output head (:mod:`hf_normswap.head_loss`)
    when both heads are plain linear maps (a sentence encoder has none); 0: full logits.

    Under FSDP2 (:mod:`hf_normswap.training.sharding`; on CPU too, where accelerate would fall back to DDP) the
    student is sharded by accelerate when training starts, and the teacher here at once when ``shard_teacher``
    (else every process holds it whole); the shard units are logged when training begins.
    """

    def __init__(self, *args, teacher: nn.Module | None = None, loss: RecoveryLoss | None = None,
                 shape_lr: float | None = None, gamma_lr: float | None = None, shard_teacher: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.recovery_loss = loss
        self.distill_weight = loss.distill_weight if loss is not None else 0.0
        if self.distill_weight > 0 and teacher is None:
            raise ValueError("distill_weight > 0 needs the original model as teacher")
        self.teacher = teacher
        for callback in loss.callbacks() if loss is not None else ():
            self.add_callback(callback)
        self.shape_lr, self.gamma_lr = shape_lr, gamma_lr
        distilled = teacher is not None and self.distill_weight > 0
        self.teacher_sharded = self.fsdp2 and distilled and shard_teacher
        # loaded once a node, the teacher is on the meta device outside the main process until it is sharded
        from_main = self.teacher_sharded and sharding.loads_once()
        if distilled:
            (self.teacher if from_main else self.teacher.to(self.args.device)).eval().requires_grad_(False)
            self.loss_is_scaled_for_ga = False  # compute_loss returns a per-batch mean: let the Trainer divide
        # decided here, before accelerate wraps the forward in autocast: the check compares fp32 logits exactly; by
        # the main process's forward where the others hold models on the meta device
        from_main_forward = distilled and sharding.loads_once() and self.accelerator.num_processes > 1
        measured = distilled and (self.accelerator.is_main_process or not from_main_forward)
        chunk = [head_chunk_for(self.model, teacher, loss.head_chunk) if measured else 0]
        if from_main_forward:
            chunk = broadcast_object_list(chunk)
        self.head_chunk = chunk[0]
        self.logged = RecoveryLoss.logged()
        self._component_sums = dict.fromkeys(self.logged, 0.0) | {"count": 0}
        self.diverged_at: int | None = None  # the first step whose loss was not finite
        if self.fsdp2:
            sharding.vectors_for_scalars(self.model)  # before the optimizer is made on its parameters
            if from_main:
                sharding.shard_from_main(self.teacher, self.accelerator.is_main_process, self.args.device)
            elif self.teacher_sharded:
                sharding.shard(self.teacher)
            self.add_callback(sharding.ShardingLog(self.teacher if distilled else None))

    @property
    def fsdp2(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and plugin.fsdp_version == 2

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if sharding.adopt_fsdp2_on_cpu(self.accelerator):  # accelerate would run DDP here (module doc)
            self.is_fsdp_enabled = True

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            groups = parameter_groups(opt_model, lr=self.args.learning_rate, weight_decay=self.args.weight_decay,
                                      shape_lr=self.shape_lr, gamma_lr=self.gamma_lr,
                                      decay_names=set(self.get_decay_parameter_names(opt_model)))
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            optimizer_kwargs.pop("lr", None)  # each group carries its own
            self.optimizer = optimizer_cls(groups, lr=self.args.learning_rate, **optimizer_kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.distill_weight == 0 or not model.training:  # evaluation: plain cross-entropy, for perplexity
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():  # the teacher and the head loss as the student's forward (bf16 or not)
            loss, logged = self.recovery_loss(model, self.teacher, inputs, self.head_chunk)
        if self.teacher_sharded:  # its root kept its gathered weights for the head loss until here (its blocks
            self.teacher.reshard()  # free theirs after their forward)
        for key, value in logged.items():
            self._component_sums[key] += float(value.detach())
        self._component_sums["count"] += 1
        return (loss, None) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.diverged_at is None and not bool(torch.isfinite(loss).all()):
            self.diverged_at = self.state.global_step + 1
        return loss

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint; a write that fails (a full disk: an OSError, safetensors' own error, torch's
        writer's RuntimeError) is one line naming the folder, the checkpoints before it kept."""
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, CheckpointError, RuntimeError) as error:
            if isinstance(error, RuntimeError) and "inline_container" not in str(error):  # not torch.save's writer
                raise
            folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            raise CheckpointError(f"cannot write the Trainer checkpoint {folder} ({first_line(error)})") from None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 700.0))
        if "loss" in logs and self._component_sums["count"]:
            count = self._component_sums.pop("count")
            for key in self.logged:
                logs[key] = round(self._component_sums[key] / count, 6)
            self._component_sums = dict.fromkeys(self.logged, 0.0) | {"count": 0}
        if "loss" in logs and self.optimizer is not None:
            logs.update(group_learning_rates(self.optimizer))
        super().log(logs, start_time)
