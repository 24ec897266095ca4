"""fp32 or bf16 autocast for the recovery's step, ``auto`` timing the step itself in both (on the main process, its
answer sent to the others)."""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list
from datasets import IterableDataset
from torch import nn

from ..model_inputs import ends_in_hidden_states
from ..precision import choose_precision
from .losses import head_chunk_for
from .recovery_loss import RecoveryLoss


def training_step_precision(precision: str, student: nn.Module, teacher: nn.Module, inputs: dict, *,
                            device: torch.device | str = "cpu", loss: RecoveryLoss | None = None):
    """``precision`` ('auto' | 'fp32' | 'bf16') for training ``student``; ``auto`` times the training step
    (``loss``, or the model's own loss without one or at distillation weight 0, then backward) on the batch
    ``inputs`` (``input_ids``, optionally ``attention_mask``) in fp32 and under bf16 autocast
    (:func:`precision.choose_precision`)."""
    if precision != "auto":
        return choose_precision(precision)
    student.to(device).train()
    teacher.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    if not ends_in_hidden_states(teacher):
        inputs["labels"] = inputs["input_ids"]
    distilled = loss is not None and loss.distill_weight > 0
    chunk = head_chunk_for(student, teacher, loss.head_chunk) if distilled else 0

    def step():
        value = loss(student, teacher, inputs, chunk)[0] if distilled else student(**inputs).loss
        value.backward()
        student.zero_grad(set_to_none=True)

    return choose_precision("auto", step, device=device, repetitions=2)


def training_precision(asked: str, loss, batch: int, student, original, train_set, tokenizer, state):
    """fp32 or bf16 autocast (``asked``: the ``precision`` setting); ``auto`` times the recipe's own step (forward,
    the ``loss``, backward; ``batch`` training rows) in both on the main process, and every process takes its
    answer."""
    choice = [None]
    # a stream's first rows are read by every process: each draws its own batches of the original's samples, and
    # one process reading alone would wait for the others' while they wait for its answer
    rows = ([row["input_ids"] for row in train_set.take(batch)] if isinstance(train_set, IterableDataset)
            else train_set[:batch]["input_ids"])
    if state.is_main_process or asked != "auto":
        inputs = tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # sentences differ in length
        choice = [training_step_precision(asked, student, original, dict(inputs), device=state.device, loss=loss)]
    if state.num_processes > 1 and asked == "auto":
        choice = broadcast_object_list(choice)
    return choice[0]
