"""The taper (``taper.fraction`` > 0, or ``hand_over.kind: taper``): every norm blended with its original, the
original's share falling to 0 over the first ``taper.fraction`` of the run (``training.taper``)."""

from __future__ import annotations

from ..taper import TaperCallback, taper_stages, taper_steps
from .base import HandOver, register


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
