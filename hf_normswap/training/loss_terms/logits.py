"""The logit terms: cross-entropy on the next token and the KL divergence to the original's logits (knowledge
distillation, Hinton et al. 2015: soft targets at temperature ``T``, scaled by ``T^2``). One term, not two: through
the chunked output head (``head_loss``) both come from one fused pass over the vocabulary."""

from __future__ import annotations

import torch

from ..head_loss import head_loss
from ..losses import distillation_loss
from .base import LossTerm, Step, register


@register
class LogitTerms(LossTerm):
    """``(1 - w) * CE + w * KD``, KD left out with ``distill.logits`` false (hidden states alone)."""

    key = "logits"
    logged = {"ce_loss": "cross-entropy", "kd_loss": "distillation KL"}
    own_setting = True

    def __init__(self, temperature: float = 1.0, logits: bool = True):
        super().__init__(1.0 if logits else 0.0)
        self.temperature, self.logits = float(temperature), bool(logits)

    @classmethod
    def setting(cls, distill) -> tuple[float, dict]:
        return 1.0, {"temperature": distill.temperature, "logits": distill.logits}

    @classmethod
    def build(cls, distill, model) -> "LogitTerms":
        return cls(distill.temperature, distill.logits)  # always: CE stays when KD is off

    def parts(self, step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        w, inputs, zero = step.distill_weight, step.inputs, step.zero
        kd_weight = w if self.logits else 0.0
        if step.heads is not None:
            if not (1.0 - w or kd_weight):  # hidden states alone: nothing goes through the heads
                loss, ce, kd = zero, zero, zero
            else:
                loss, ce, kd = head_loss(step.outputs.logits, step.heads[0].weight, inputs["labels"],
                                         teacher=(step.reference.logits, step.heads[1].weight), kd_mask=step.mask,
                                         weights=(1.0 - w, kd_weight), temperature=self.temperature,
                                         chunk=step.head_chunk)
            return loss, {"ce_loss": ce, "kd_loss": kd}
        ce = getattr(step.outputs, "loss", None)
        if ce is None and w < 1:
            raise ValueError("the model computes no loss of its own (a sentence encoder): set distill weight 1")
        ce = zero if ce is None else ce
        kd = distillation_loss(step.outputs.logits, step.reference.logits, self.temperature, step.mask) \
            if self.logits else zero
        return (1.0 - w) * ce + w * kd, {"ce_loss": ce, "kd_loss": kd}

    def describe(self) -> str | None:
        return (f"KL divergence to the original's logits (temperature {self.temperature:.4g})" if self.logits
                else None)
