"""A stop on the wall clock, with a checkpoint: a long recovery in chunks of known length."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback


class WallClockStop(TrainerCallback):
    """Stop (and save a checkpoint) once ``minutes`` of training have passed in this launch: a time budget that
    holds whatever the machine's speed, where ``max_steps`` would have to be guessed."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        over = self.start is not None and time.monotonic() - self.start > self.seconds
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # all ranks stop at one step
            flag = torch.tensor(float(over), device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over:
            control.should_training_stop = True
            control.should_save = True
        return control


class FirstStepClock(TrainerCallback):
    """The seconds from the launch (``launched``, ``time.monotonic()`` when the recipe started) to its first step:
    loading, calibration, the first evaluation and the first batch's rows; the summary records them a launch, so a
    setup that grows with the run's length shows."""

    def __init__(self, launched: float):
        self.launched = launched
        self.seconds = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.seconds is None:
            self.seconds = time.monotonic() - self.launched
