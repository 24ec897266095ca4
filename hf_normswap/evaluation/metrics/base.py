"""What a metric of the side-by-side evaluation table is, and the registry the table, the JSON, the model card and
the recipe's summary read their rows from, so that none of them names a metric.

Three kinds, by what the evaluation has collected when a figure is computed:

- :class:`ModelMetric`: a figure of each model alone, from its summed loss over the scored tokens and the counts it
  is normalised by (:class:`Perplexity`); the table gives it for every model, with its ratio to the original's.
- :class:`AgreementMetric`: a figure of each model against the original, summed over the scored positions from both
  models' next-token log-probabilities (:class:`ScoredPositions`) and averaged per scored token; only against an
  original.
- :class:`EmbeddingMetric`: a figure of a sentence encoder's embeddings against the original's on the same
  sentences (:class:`Similarities`).

Each names itself (``key`` in the JSON, ``label`` in the table and the card) and formats its own cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch


def number(value) -> str:
    """A table cell: four significant digits, exponent notation from a million, ``-`` for no figure."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


def exp_or_inf(x: float) -> float:
    """``exp`` that returns inf instead of raising: broken conversions reach perplexities beyond 1e308."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


class Metric:
    """One row of the evaluation table. A metric is a subclass of one of the kinds below, decorated with
    :func:`register`."""

    key: str  # its name in the JSON (and the summary)
    label: str  # its row in the table and the model card
    order: float  # rows of a kind are sorted by it

    def format(self, value) -> str:
        """Its table cell (``None``: no figure)."""
        return number(value)


@dataclass
class Perplexity:
    """Summed negative log-likelihood (nats) and the counts it is normalised by. Each model metric's figure reads
    as an attribute named by its key (``token_perplexity``, ``bits_per_byte``, ...), as the JSON names it."""

    nll: float
    tokens: int
    words: int
    bytes: int

    def __getattr__(self, key: str) -> float:
        found = next((m for m in registered(ModelMetric) if m.key == key), None) if not key.startswith("_") else None
        if found is None:
            raise AttributeError(f"{type(self).__name__} has no metric {key!r}")
        return found.value(self)

    def to_dict(self) -> dict:
        return {"nll": self.nll, "tokens": self.tokens, "words": self.words, "bytes": self.bytes,
                **{m.key: m.value(self) for m in registered(ModelMetric)}}


class ModelMetric(Metric):
    """A figure of each model alone, from its summed loss and counts; its ratio to the original's is the table's."""

    def value(self, loss: Perplexity) -> float:
        raise NotImplementedError


@dataclass
class ScoredPositions:
    """A chunk of scored positions: the original's and one model's next-token log-probabilities (positions, vocab;
    float32, on one device) and the tokens that came next."""

    reference: torch.Tensor
    model: torch.Tensor
    targets: torch.Tensor


class AgreementMetric(Metric):
    """A figure of each model against the original: :meth:`total` over every chunk of scored positions, summed and
    divided by the scored tokens. ``row_label`` is the table's, which may list several models (the card's is
    ``label``)."""

    row_label: str | None = None

    @property
    def table_label(self) -> str:
        return self.row_label or self.label

    def total(self, scored: ScoredPositions) -> float:
        """The figure summed over the chunk's positions."""
        raise NotImplementedError


@dataclass
class Similarities:
    """One model's sentence embeddings, as the embedding metrics read them."""

    embeddings: torch.Tensor  # unit length, one row per sentence
    pairs: torch.Tensor  # cosine of every pair of distinct sentences
    neighbour: torch.Tensor  # index of each sentence's most similar other sentence


class EmbeddingMetric(Metric):
    """A figure of a model's embeddings against the original's; ``perfect`` is a perfect copy's, the figure the
    table shows for the original."""

    perfect: float = 1.0

    def value(self, reference: Similarities, model: Similarities) -> float:
        raise NotImplementedError


_REGISTERED: list[Metric] = []
Kind = TypeVar("Kind", bound=Metric)


def register(metric: type[Kind]) -> type[Kind]:
    """Add a metric to the table (a class decorator); its key must be new among the metrics of its kind."""
    kind = next((base for base in (ModelMetric, AgreementMetric, EmbeddingMetric) if issubclass(metric, base)), None)
    if kind is None:
        raise TypeError(f"{metric.__name__} is not a ModelMetric, an AgreementMetric or an EmbeddingMetric")
    if any(m.key == metric.key for m in registered(kind)):
        raise ValueError(f"two evaluation metrics are named {metric.key!r}: give {metric.__name__} another key")
    _REGISTERED.append(metric())
    return metric


def registered(kind: type[Kind]) -> list[Kind]:
    """The metrics of a kind, in their table order."""
    return sorted((m for m in _REGISTERED if isinstance(m, kind)), key=lambda m: m.order)
