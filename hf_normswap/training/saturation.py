"""Where the element-wise functions saturate over a run: the share of each converted module's elements in the flat
part of its squash (``|f(x)| > 0.95``, calibration's ``sat.`` column) on a training step's own inputs, at every
logging step.

A saturated element passes no gradient to its input and carries no information about it; arXiv 2604.23434 traces
DyT's collapse in Llama-style models to saturation where SwiGLU's gate reads its input. The calibration report gives
the share at the start; this gives it along the run, per norm, in ``OUTPUT/saturation.jsonl`` (one line a logging
step: step, tokens seen, ``{norm: share}``), with the mean over the norms in the Trainer's log as ``saturation``.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from ..calibration.fitting import saturated_share
from ..modules import ElementwiseNorm


class SaturationLog(TrainerCallback):
    """Forward hooks that, on the steps the Trainer logs, measure each converted module's saturated share."""

    def __init__(self, model, path: Path | None):
        self.path = path  # None: measured and logged, not written (processes other than the main one)
        self.armed = False
        self.shares: dict[str, list[float]] = {}
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
                        if isinstance(module, ElementwiseNorm)]

    def _hook(self, name: str):
        def hook(module, args, output):
            if self.armed:
                self.shares.setdefault(name, []).append(saturated_share(module, args[0].detach()))
        return hook

    def on_step_begin(self, args, state, control, **kwargs):
        every = args.logging_steps
        self.armed = bool(every) and (state.global_step + 1) % every == 0

    def on_step_end(self, args, state, control, **kwargs):
        self.armed = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.shares or logs is None or "loss" not in logs:
            return
        shares = {name: round(sum(v) / len(v), 5) for name, v in self.shares.items()}
        self.shares = {}
        if state.log_history:
            state.log_history[-1]["saturation"] = round(sum(shares.values()) / len(shares), 5)
        if self.path is not None:
            with self.path.open("a") as stream:
                stream.write(json.dumps({"step": state.global_step, "tokens": state.num_input_tokens_seen,
                                         "saturation": shares}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self.handles:
            handle.remove()
        self.handles = []
