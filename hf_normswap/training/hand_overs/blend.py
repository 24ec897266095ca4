"""The blend every hand-over trains through: each converted module gets a forward hook that returns

    (1 - m) * original_norm(x) + m * converted(x)

with the mix ``m`` of its stage (:class:`Stage`: from 0 to 1 over ``ramp`` steps from its start step), and the hook
does nothing once ``m = 1``. The original norms are frozen and kept outside the model (not in its ``state_dict``), so
Trainer checkpoints hold the converted modules alone, resuming needs nothing saved, the optimizer sees the converted
parameters from step 0, and DDP never finds an unused parameter (both branches run while ``m < 1``). The gradient
reaches the norm's input through both branches, as it would through the blend's own formula. The mix is a
function of the global step only, so every process and every resumed run agrees on it.

A hand-over must end within the run (:class:`HandOverError` otherwise, at the start of training): the model saved
at its end is then the one trained converted. A Trainer checkpoint saved before the end records how far it was
(``hand_over`` in its record), so it is not taken for the converted model: without the original's norms it is not
the model that was training.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import TrainerCallback

from ...checkpoint.record import ConversionRecord


class HandOverError(ValueError):
    """A hand-over that would not end within the run; the message names the settings to change."""


@dataclass
class Stage:
    """Norms whose mix ramps from 0 to 1 between ``start`` and ``start + ramp`` (global steps)."""

    start: int
    ramp: int
    names: list[str]

    def mix(self, step: int) -> float:
        if step < self.start:
            return 0.0
        if self.ramp <= 0:
            return 1.0
        return min(1.0, (step - self.start + 1) / self.ramp)

    @property
    def done_at(self) -> int:
        """The first global step at which the mix is 1."""
        return self.start + max(self.ramp - 1, 0)


def end_step(stages) -> int:
    """The first global step at which every stage's mix is 1: a run of that many steps ends converted (its last
    step still blends, as the taper's last step does)."""
    return max((stage.done_at for stage in stages), default=0)


def check_fits(name: str, end: int, steps: int, fix: str) -> None:
    """Refuse a hand-over (``name``: progressive, taper) that ends at step ``end``, after a run of ``steps``: its
    last norms would still be blended when training ends, so the run could not save a converted model (swapping
    them in then, untrained, saved one that was never trained converted)."""
    if end > steps:
        raise HandOverError(f"{name}: the norms are handed over until step {end}, after the run's {steps} steps: "
                            f"{fix}")


class ProgressiveSwap:
    """Forward hooks blending each converted module with a frozen copy of its original norm (see module doc)."""

    def __init__(self, model: nn.Module, originals: dict[str, nn.Module], stages: list[Stage]):
        missing = {n for s in stages for n in s.names} - set(originals)
        if missing:
            raise ValueError(f"no original norm for {sorted(missing)}")
        self.model = model
        self.stages = stages
        self.mix = {n: 0.0 for s in stages for n in s.names}
        self.originals = {}
        self.handles = []
        for name in self.mix:
            source = copy.deepcopy(originals[name]).requires_grad_(False).eval()
            target = model.get_submodule(name)
            param = next(target.parameters())
            self.originals[name] = source.to(param.device)
            self.handles.append(target.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args, output):
            m = self.mix[name]
            if m >= 1.0:
                return None
            source = self.originals[name](args[0])  # frozen, but the gradient reaches x through it too
            return output * m + source.to(output.dtype) * (1.0 - m)
        return hook

    def set_step(self, step: int) -> dict[str, float]:
        for stage in self.stages:
            m = stage.mix(step)
            for name in stage.names:
                self.mix[name] = m
        return self.mix

    def converted_fraction(self, step: int | None = None) -> float:
        """The mean mix as set, or at global ``step`` (without setting it)."""
        mixes = self.mix.values() if step is None else [s.mix(step) for s in self.stages for _ in s.names]
        return sum(mixes) / max(1, len(self.mix))

    def remove(self) -> None:
        """Drop the hooks and the originals: the model is then the plain converted model."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.originals = [], {}


class ProgressiveSwapCallback(TrainerCallback):
    """Sets every hook's mix from ``state.global_step`` before each step (and at the start, for resumed runs), logs
    the converted fraction, records in the model's record how far the hand-over is (what a Trainer checkpoint
    saves), and removes the hooks when training ends at the hand-over's end: :attr:`finished` is False when
    training stopped before it, and then the hooks stay, so the model is not mistaken for the converted one."""

    name = "progressive"
    # what to change when the schedule would end after the run (:func:`check_fits`)
    fix = ("set training.max_steps (or train_tokens) to at least that, or a shorter schedule (progressive.every, "
           "progressive.ramp, progressive.start, progressive.group)")

    def __init__(self, swap: ProgressiveSwap, describe: Callable[["ProgressiveSwapCallback"], str] | None = None):
        self.swap, self._describe = swap, describe
        self.finished = False
        self.stopped_at = None

    def describe(self) -> str:
        """The hand-over in a sentence, for the model card (its kind's words, ``hand_overs``)."""
        return self._describe(self) if self._describe else f"The norms were handed over ({self.name})."

    @property
    def end(self) -> int:
        """The first global step at which every norm is converted."""
        return end_step(self.swap.stages)

    def status(self) -> str:
        return f"converted fraction {self.swap.converted_fraction():.3g}"

    def on_train_begin(self, args, state, control, **kwargs):
        check_fits(self.name, self.end, state.max_steps, self.fix)
        self.swap.set_step(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.swap.set_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        # a checkpoint of this step holds the converted modules alone; its record says where the blend is
        fraction = self.swap.converted_fraction(state.global_step)
        ConversionRecord.amend(self.swap.model, hand_over=None if fraction >= 1 else {
            "schedule": self.name, "step": state.global_step, "converted_fraction": fraction,
            "ends_at_step": self.end})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and state.log_history:
            # the Trainer has already stored this entry in log_history: record the fraction there
            state.log_history[-1]["converted_fraction"] = round(self.swap.converted_fraction(), 4)

    def on_train_end(self, args, state, control, **kwargs):
        self.stopped_at = state.global_step
        self.finished = state.global_step >= self.end
        if self.finished:
            self.swap.set_step(10 ** 12)  # fully converted
            self.swap.remove()
            ConversionRecord.amend(self.swap.model, hand_over=None)
