"""The taper: recovery that starts from the original's norms and ends with none.

Each converted module computes ``g * norm(x) + (1 - g) * new(x)`` during training, its gate ``g`` falling from 1 to 0
over the first ``fraction`` of the run (TaperNorm, arXiv 2602.10408; the GPT-2 LayerNorm removal of Baroni et al.
2025 hands the norms over gradually too): the first step sees the original's norms, so the layers downstream adapt
while the error of the element-wise replacement grows, instead of meeting all of it at step 0. Shapes:

- ``cosine``: ``g = (1 + cos(pi * step / S)) / 2`` for every norm (``S``: the taper's steps);
- ``linear``: ``g = 1 - step / S``;
- ``progressive``: the norms in stages of ``progressive.order`` (``progressive.schedule``), each stage's gate
  falling by the cosine over its own share of ``S``, one stage after another.

``g`` is 0 from step ``S`` on, so the model saved at the end is the plain converted model. The blend is the forward
hook of :class:`~hf_normswap.training.progressive.ProgressiveSwap` (original norms frozen and outside the
``state_dict``; the gradient reaches ``x`` through both branches), with the mix ``1 - g``. The gate is a function
of the global step and the run's ``max_steps``, so a resumed launch continues the schedule; a launch that stops
before step ``S`` leaves a half-tapered model, which the recipe does not save as converted (:attr:`TaperCallback.finished`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .progressive import ProgressiveSwapCallback, schedule

SCHEDULES = ("cosine", "linear", "progressive")


def taper_steps(fraction: float, max_steps: int) -> int:
    """The steps over which ``g`` falls: ``fraction`` of the run, at least one."""
    return max(1, min(max_steps, round(fraction * max_steps)))


@dataclass
class TaperStage:
    """Norms whose gate falls from 1 at step ``start`` to 0 at ``end`` (global steps, fractional bounds allowed)."""

    start: float
    end: float
    names: list[str]
    shape: str = "cosine"

    def gate(self, step: int) -> float:
        t = (step - self.start) / (self.end - self.start)
        if t <= 0:
            return 1.0
        if t >= 1:
            return 0.0
        return 0.5 * (1 + math.cos(math.pi * t)) if self.shape == "cosine" else 1.0 - t

    def mix(self, step: int) -> float:
        """The converted module's share, as :class:`ProgressiveSwap` reads it."""
        return 1.0 - self.gate(step)


def taper_stages(roles: dict[str, str], steps: int, shape: str, *, order: str = "depth",
                 role_order: list[str] | None = None, group: int = 1) -> list[TaperStage]:
    """The stages of a taper over ``steps`` steps for the norms in ``roles`` (``{name: role}``): one stage of
    every norm (``cosine``, ``linear``), or ``progressive``'s stages in ``order`` each over an equal share."""
    if shape not in SCHEDULES:
        raise ValueError(f"taper.schedule must be one of {SCHEDULES}, got {shape!r}")
    if shape != "progressive":
        return [TaperStage(0, steps, list(roles), shape)]
    buckets = [stage.names for stage in schedule(roles, order=order, role_order=role_order, group=group)]
    share = steps / len(buckets)
    return [TaperStage(i * share, (i + 1) * share, names) for i, names in enumerate(buckets)]


class TaperCallback(ProgressiveSwapCallback):
    """The progressive swap's callback (gates set from the global step, the converted share logged) that also knows
    where the taper ends: :attr:`finished` is False when training stopped before every gate reached 0, and then the
    hooks stay, so the model is not mistaken for the converted one."""

    def __init__(self, swap, steps: int):
        super().__init__(swap)
        self.steps = steps
        self.finished = False
        self.stopped_at = None

    def on_train_end(self, args, state, control, **kwargs):
        self.stopped_at = state.global_step
        self.finished = state.global_step >= self.steps
        if self.finished:
            super().on_train_end(args, state, control, **kwargs)

    def gate(self) -> float:
        """The mean gate now (1: the original's norms, 0: converted)."""
        return 1.0 - self.swap.converted_fraction()
