"""Nearest-neighbour agreement: the fraction of sentences whose most similar other sentence is the same for both
models (what a retrieval user sees)."""

from .base import EmbeddingMetric, Similarities, register


@register
class NeighbourAgreement(EmbeddingMetric):
    key, label, order = "nearest_neighbour_agreement", "nearest-neighbour agreement", 20

    def value(self, reference: Similarities, model: Similarities) -> float:
        return float((reference.neighbour == model.neighbour).double().mean())
