"""The layer-wise term: every block's output pulled toward the original's (``training.layerwise``), the first
position weighted by ``distill.sink_weight``."""

from __future__ import annotations

import torch

from ..layerwise import relative_hidden_error
from .base import LossTerm, Step, register


@register
class HiddenStates(LossTerm):
    """``distill.hidden`` times the mean relative squared error of the blocks' outputs."""

    key = "hidden"
    logged = {"hidden_loss": "layer-wise"}
    hidden_states = grouped = True
    own_setting = True

    @classmethod
    def setting(cls, distill) -> tuple[float, dict]:
        return distill.hidden, {"sink_weight": distill.sink_weight}

    @classmethod
    def memory(cls, sizes, tokens: int, value_bytes: int, seq_len: int) -> dict[str, int]:
        # the teacher's output of every block (and the embeddings) is kept for the step, where without this
        # term it holds one block's values at a time
        return {"teacher outputs": (sizes.layers + 1) * tokens * sizes.hidden * value_bytes}

    def value(self, step: Step) -> torch.Tensor:
        return relative_hidden_error(step.outputs.hidden_states, step.reference.hidden_states, step.mask,
                                     self.options["sink_weight"])

    def describe(self) -> str:
        return f"every block's output toward the original's (weight {self.weight:.4g})"
