"""Top-1 agreement: the fraction of scored positions where the model's most likely next token is the original's
(what greedy decoding sees)."""

from .base import AgreementMetric, ScoredPositions, register


@register
class Top1Agreement(AgreementMetric):
    key, label, order = "top1_agreement", "top-1 agreement", 60

    def total(self, scored: ScoredPositions) -> float:
        return int((scored.model.argmax(-1) == scored.reference.argmax(-1)).sum())
