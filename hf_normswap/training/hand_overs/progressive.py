"""The progressive hand-over (``progressive.enabled``, or ``hand_over.kind: progressive``): the norms converted a
few at a time, a stage every ``progressive.every`` steps (``training.progressive``)."""

from __future__ import annotations

from ..progressive import ProgressiveSwapCallback, end_step, schedule
from .base import HandOver, register


@register
class Progressive(HandOver):
    key = "progressive"
    title = "progressive conversion"
    in_order = fits_before_training = True
    own_switch = "progressive.enabled"
    own_off = "progressive.enabled=false"
    fix = ProgressiveSwapCallback.fix

    @classmethod
    def asked(cls, progressive, taper) -> bool:
        return bool(progressive.enabled)

    def switch_on(self) -> None:
        self.progressive.enabled = True

    def check(self) -> str | None:
        return super().check()  # its settings are the progressive section's (its order: progressive.check_order)

    def stages(self, roles: dict[str, str], steps: int) -> list:
        p = self.progressive
        return schedule(roles, start=p.start, every=p.every, ramp=p.ramp, order=p.order, role_order=p.role_order,
                        group=p.group)

    def callback(self, swap, roles: dict[str, str], log) -> ProgressiveSwapCallback:
        return ProgressiveSwapCallback(swap, self.describe)

    def started(self, stages: list) -> str:
        p = self.progressive
        return (f"progressive: {len(stages)} stages by {p.order}, every {p.every} steps, all converted from step "
                f"{end_step(stages)}")

    def describe(self, callback) -> str:
        return ("The norms were handed over from the original to the converted modules progressively "
                f"({self.progressive.order} order).")
