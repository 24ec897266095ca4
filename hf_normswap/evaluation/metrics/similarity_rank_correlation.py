"""Similarity rank correlation: Spearman's, over all sentence pairs, of the model's pair cosines with the
original's: an STS-style score with the original's similarities standing in for human ratings."""

import torch

from .base import EmbeddingMetric, Similarities, register


def _ranks(values: torch.Tensor) -> torch.Tensor:
    return values.argsort().argsort().double()  # ties are measure-zero for float cosines


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([_ranks(a), _ranks(b)]))[0, 1])


@register
class SimilarityRankCorrelation(EmbeddingMetric):
    key, label, order = "spearman", "similarity rank correlation (Spearman, all pairs)", 30

    def value(self, reference: Similarities, model: Similarities) -> float:
        return spearman(reference.pairs, model.pairs)
