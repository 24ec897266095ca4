"""Embedding cosine: the mean over sentences of the cosine between the model's embedding and the original's."""

from .base import EmbeddingMetric, Similarities, register


@register
class EmbeddingCosine(EmbeddingMetric):
    key, label, order = "cosine", "embedding cosine to original (mean)", 10

    def value(self, reference: Similarities, model: Similarities) -> float:
        return float((reference.embeddings * model.embeddings).sum(-1).mean())
