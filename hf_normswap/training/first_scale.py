"""The first position's own scale handed over to the common one: the anchors' uniform-scale step at the end of a run.

A ``linear`` module passes a token on in proportion to its size: the attention sink (10-180x the RMS of other tokens
in SmolLM2) comes out 10-180x too large and, squared by the next MLP, grows without bound through the blocks. So
calibration gives position 0 a scale of its own (``modules.Linear.log_first``, ``calibration.first_scale``), as
Heimersheim 2024 and Baroni et al. 2025 kept separate statistics for it while fine-tuning. The saved model is to
have one scale: over the last ``first_scale_handover`` of the run's steps ``log_first`` falls linearly from its
calibrated value to 0 (0: at the end of the run), and the blocks learn to live with the sink at the common scale.
Nothing trains ``log_first`` (its learning rate is 0); this callback alone moves it.

A run resumed in chunks reads where the hand-over stood from the value itself (``log_first / (1 - progress)``), so
no state of its own needs saving; the schedule follows the run's ``max_steps``, so a run extended beyond its first
length keeps the one scale it handed over to.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..modules import Linear


def handover_progress(step: int, total: int, fraction: float) -> float:
    """Share of the hand-over done while training step ``step`` (0-based) of ``total``: 0 before the last
    ``fraction`` of the steps, 1 at the last step."""
    begin = total * (1 - fraction)
    if step + 1 >= total:
        return 1.0
    if total - begin <= 0:
        return 0.0
    return min(max((step + 1 - begin) / (total - begin), 0.0), 1.0)


class FirstScaleHandover(TrainerCallback):
    """Moves each linear module's ``log_first`` to 0 over the end of the run (module doc)."""

    def __init__(self, modules: list[Linear], fraction: float):
        self.modules, self.fraction = modules, float(fraction)
        self.start: list[torch.Tensor] = []

    @classmethod
    def of(cls, model, fraction: float) -> "FirstScaleHandover | None":
        """The hand-over for the linear modules of ``model`` whose first position has a scale of its own (None:
        there are none)."""
        modules = [m for m in model.modules() if isinstance(m, Linear) and bool(m.log_first.detach().ne(0).any())]
        return cls(modules, fraction) if modules else None

    def on_train_begin(self, args, state, control, **kwargs):
        done = handover_progress(state.global_step - 1, state.max_steps, self.fraction) if state.global_step else 0.0
        self.start = [m.log_first.detach().clone() / (1 - done) if done < 1 else torch.zeros_like(m.log_first)
                      for m in self.modules]

    def on_step_begin(self, args, state, control, **kwargs):
        self._set(1 - handover_progress(state.global_step, state.max_steps, self.fraction))

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # a chunk stopped early goes on with the hand-over where it stood
            self._set(0.0)

    def _set(self, left: float) -> None:
        with torch.no_grad():
            for module, start in zip(self.modules, self.start):
                module.log_first.copy_(start * left)
