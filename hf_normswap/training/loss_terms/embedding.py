"""The embedding term: ``1 - cosine`` of the mean-pooled last hidden states to the original's
(``training.layerwise.embedding_cosine_error``), what a sentence encoder's users compare."""

from __future__ import annotations

import torch

from ..layerwise import embedding_cosine_error
from .base import LossTerm, Step, register
from .hidden_states import HiddenStates


@register
class Embedding(LossTerm):
    """``distill.embedding`` times the pooled embedding's cosine error."""

    key = "embedding"
    logged = {"embedding_loss": "1 - embedding cosine"}
    hidden_states = grouped = True
    own_setting = True

    @classmethod
    def setting(cls, distill) -> tuple[float, dict]:
        return distill.embedding, {}

    memory = HiddenStates.memory  # the forwards return every block's output for it too

    def value(self, step: Step) -> torch.Tensor:
        return embedding_cosine_error(step.outputs.hidden_states[-1], step.reference.hidden_states[-1], step.mask)

    def describe(self) -> str:
        return f"1 - cosine of the pooled embedding to the original's (weight {self.weight:.4g})"
