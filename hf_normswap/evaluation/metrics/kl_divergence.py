"""``KL(original || model)`` of the next-token distributions, nats per scored token: how far the model's whole
distribution is from the original's, not only at the next token."""

from .base import AgreementMetric, ScoredPositions, register


@register
class KLDivergence(AgreementMetric):
    key, order = "kl", 50
    label = "KL(original ‖ converted), nats/token"  # not "||": a Markdown table cell
    row_label = "KL(original ‖ model), nats/token"

    def total(self, scored: ScoredPositions) -> float:
        reference = scored.reference
        return (reference.exp() * (reference - scored.model)).sum(-1).double().sum().item()
