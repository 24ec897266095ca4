"""The taper (``taper.fraction`` > 0, or ``hand_over.kind: taper``): recovery that starts from the original's norms
and ends with none.

Each converted module computes ``g * norm(x) + (1 - g) * new(x)`` during training, its gate ``g`` falling from 1 to 0
over the first ``fraction`` of the run (TaperNorm, arXiv 2602.10408; the GPT-2 LayerNorm removal of Baroni et al.
2025 hands the norms over gradually too): the first step sees the original's norms, so the layers downstream adapt
while the error of the element-wise replacement grows, instead of meeting all of it at step 0. Shapes:

- ``cosine``: ``g = (1 + cos(pi * step / S)) / 2`` for every norm (``S``: the taper's steps);
- ``linear``: ``g = 1 - step / S``;
- ``progressive``: the norms in stages of ``progressive.order`` (``progressive.schedule``), each stage's gate
  falling by the cosine over its own share of ``S``, one stage after another.

``g`` is 0 from step ``S`` on, so the model saved at the end is the plain converted model. The blend is the forward
hook of :class:`~.blend.ProgressiveSwap` (original norms frozen and outside the
``state_dict``; the gradient reaches ``x`` through both branches), with the mix ``1 - g``. ``S`` is fixed when the
taper starts, from the steps the Trainer counts (an epoch-based run's too), and recorded in the Trainer's state, so
a resumed launch continues the same schedule, and one that extends a run (a larger ``max_steps`` or
``train_tokens``) keeps ``g`` at 0 once it got there; a launch that stops before step ``S`` leaves a half-tapered
model, which the recipe does not save as converted (:attr:`TaperCallback.finished`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .base import HandOver, register
from .blend import ProgressiveSwapCallback
from .progressive import schedule

SCHEDULES = ("cosine", "linear", "progressive")
LENGTH = "normswap_taper"  # the taper's entry in the Trainer state's stateful_callbacks: {"steps": S}


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

    @property
    def done_at(self) -> int:
        """The first global step at which the gate is 0."""
        return math.ceil(self.end)

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
    n = len(buckets)  # steps * i / n: the last stage ends at exactly ``steps``
    return [TaperStage(steps * i / n, steps * (i + 1) / n, names) for i, names in enumerate(buckets)]


class TaperCallback(ProgressiveSwapCallback):
    """The progressive swap's callback with the taper's length: fixed at the start of training from the Trainer's
    count of steps (``fraction`` of it; ``stages_of(S)`` builds the stages) unless the resumed state records it,
    then recorded there (:data:`LENGTH`), so that every later launch keeps it."""

    name = "taper"
    fix = ("its length was fixed when the taper started; set training.max_steps (or train_tokens) to at least that, "
           "or resume=false to start over")

    def __init__(self, swap, fraction: float, stages_of: Callable[[int], list], log: Callable = print,
                 describe: Callable | None = None):
        super().__init__(swap, describe)
        self.fraction, self.stages_of, self.log = fraction, stages_of, log
        self.steps = None

    def on_train_begin(self, args, state, control, **kwargs):
        recorded = state.stateful_callbacks.get(LENGTH)
        steps = recorded.get("steps") if isinstance(recorded, dict) else None
        kept = isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
        self.steps = steps if kept else taper_steps(self.fraction, state.max_steps)
        state.stateful_callbacks[LENGTH] = {"steps": self.steps}  # saved with every checkpoint's trainer state
        self.swap.stages = self.stages_of(self.steps)
        self.log(f"taper: g from 1 to 0 over {self.steps} steps{' (its length when it started)' if kept else ''} "
                 f"in {len(self.swap.stages)} stage(s)")
        super().on_train_begin(args, state, control, **kwargs)

    def status(self) -> str:
        return f"mean g {self.gate():.3g}"

    def gate(self) -> float:
        """The mean gate now (1: the original's norms, 0: converted)."""
        return 1.0 - self.swap.converted_fraction()


@register
class Taper(HandOver):
    key = "taper"
    title = "the taper"
    own_switch = "taper.fraction"
    own_off = "taper.fraction=0"

    @property
    def in_order(self) -> bool:
        return self.taper.schedule == "progressive"

    @classmethod
    def asked(cls, progressive, taper) -> bool:
        return bool(taper.fraction)

    def check(self) -> str | None:
        if not self.taper.fraction:
            return "hand_over.kind=taper needs taper.fraction > 0: the share of the run over which it blends"
        return super().check()  # its settings are the taper section's

    def stages(self, roles: dict[str, str], steps: int) -> list:
        return self._stages(roles, taper_steps(self.taper.fraction, max(steps, 1)))

    def _stages(self, roles: dict[str, str], length: int) -> list:
        """The stages of a taper ``length`` steps long."""
        p = self.progressive
        return taper_stages(roles, length, self.taper.schedule, order=p.order, role_order=p.role_order,
                            group=p.group)

    def callback(self, swap, roles: dict[str, str], log) -> TaperCallback:
        # its length is fixed when training starts, from the Trainer's count of steps (training.taper)
        return TaperCallback(swap, self.taper.fraction, lambda length: self._stages(roles, length), log,
                             self.describe)

    def describe(self, callback) -> str:
        return ("Each converted module was blended with its original norm, `g * norm(x) + (1 - g) * new(x)`, "
                f"`g` falling from 1 to 0 ({self.taper.schedule}) over its first {callback.steps} steps; the saved "
                "model has no norm.")
