"""The scale anchor's term: the spread of the converted norms' input scale across tokens
(``training.scale_anchor``), read by hooks on the student's modules."""

from __future__ import annotations

import torch

from ...checkpoint.record import ConversionRecord
from ..scale_anchor import ScaleAnchor
from .base import LossTerm, Step, register


@register
class Scale(LossTerm):
    """``distill.scale`` times the pre-logit scale error at ``distill.scale_at`` (the final norm or every one)."""

    key = "scale"
    logged = {"scale_loss": "pre-logit scale spread"}
    own_setting = True

    @classmethod
    def setting(cls, distill) -> tuple[float, dict]:
        return distill.scale, {"at": distill.scale_at}

    @classmethod
    def build(cls, distill, model) -> "Scale | None":
        """The anchor's hooks on the converted modules of ``model`` (ScaleAnchorError: none to anchor)."""
        weight, options = cls.setting(distill)
        if not weight:
            return None
        term = cls(weight, options)
        roles = {name: entry.role for name, entry in ConversionRecord.of(model).converted.items()}
        term.anchor = ScaleAnchor.of(model, roles, options["at"])
        return term

    def value(self, step: Step) -> torch.Tensor:
        return self.anchor.loss(step.mask)

    def describe(self) -> str:
        where = "every converted norm's" if self.options["at"] == "all" else "the final norm's"
        return f"the spread of {where} input scale across tokens (weight {self.weight:.4g})"

    def callbacks(self) -> list:
        return [self.anchor]  # its hooks go when training ends
