"""Progressive conversion: during training, hand each norm over from the original to its element-wise replacement.

Removing all norms at once moves every layer's input at the same time; removing them one group at a time lets the
rest of the network adapt to each change (the schedule of the LayerNorm-removal work on GPT-2, Heimersheim 2024).
Here the model already holds the converted modules; each one gets a forward hook that returns

    (1 - m) * original_norm(x) + m * converted(x)

with the mix ``m`` going from 0 to 1 over ``ramp`` steps from its start step, and the hook does nothing once
``m = 1``. The original norms are frozen and kept outside the model (not in its ``state_dict``), so Trainer
checkpoints are ordinary converted checkpoints, resuming needs nothing saved, the optimizer sees the converted
parameters from step 0, and DDP never finds an unused parameter (both branches run while ``m < 1``). The gradient
reaches the norm's input through both branches, as it would through the blend's own formula. The mix is a
function of the global step only, so every process and every resumed run agrees on it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn
from transformers import TrainerCallback

from ..discovery.roles import layer_of
from ..evaluation.sensitivity import load_order

ORDERS = ("depth", "role", "reverse_depth")
def _depth(name: str) -> int:
    layer = layer_of(name)
    return 10 ** 6 if layer is None else layer  # outside the blocks (final norm): last


@dataclass
class Stage:
    """Norms whose mix ramps from 0 to 1 between ``start`` and ``start + ramp`` (global steps)."""

    start: int
    ramp: int
    names: list[str]

    def mix(self, step: int) -> float:
        if step < self.start:
            return 0.0
        if self.ramp <= 0:
            return 1.0
        return min(1.0, (step - self.start + 1) / self.ramp)


def schedule(roles: dict[str, str], *, start: int = 0, every: int = 10, ramp: int | None = None,
             order: str = "depth", role_order: list[str] | None = None, group: int = 1) -> list[Stage]:
    """Stages for the norms in ``roles`` (``{name: role}``, e.g. from ``model.config.normswap["converted"]``).

    ``order="depth"``: block by block from the input (``group`` blocks per stage; norms outside the blocks last);
    ``"reverse_depth"``: from the output; ``"role"``: one stage per role in ``role_order`` (default: the roles
    as they first appear), each all depths at once; a path to a ``.json`` sensitivity map (``normswap
    sensitivity --json``): least damage first, ``group`` norms per stage. A new stage starts every ``every`` steps from ``start``;
    each stage's mix ramps over ``ramp`` steps (default ``every``).
    """
    if order not in ORDERS and not str(order).endswith(".json"):
        raise ValueError(f"progressive order must be one of {ORDERS} or a sensitivity map .json file, got {order!r}")
    ramp = every if ramp is None else ramp
    names = list(roles)
    if str(order).endswith(".json"):
        buckets = _sensitivity_buckets(order, names, max(1, group))
    elif order == "role":
        ordering = role_order or list(dict.fromkeys(roles.values()))
        unknown = set(roles.values()) - set(ordering)
        ordering = list(ordering) + sorted(unknown)
        buckets = [[n for n in names if roles[n] == role] for role in ordering]
    else:
        depths = sorted({_depth(n) for n in names}, reverse=order == "reverse_depth")
        chunks = [depths[i:i + max(1, group)] for i in range(0, len(depths), max(1, group))]
        buckets = [[n for n in names if _depth(n) in chunk] for chunk in chunks]
    buckets = [b for b in buckets if b]
    return [Stage(start + i * every, ramp, b) for i, b in enumerate(buckets)]


def _sensitivity_buckets(path: str, names: list[str], group: int) -> list[list[str]]:
    """``names`` in the order of a sensitivity map (least damage first), ``group`` a stage; the map may list norms
    that were not converted (a budgeted conversion keeps some), but must rank every converted one."""
    converted = set(names)
    ranked = [n for n in load_order(path) if n in converted]
    missing = sorted(set(names) - set(ranked))
    if missing:
        raise ValueError(f"{path} does not rank {len(missing)} converted norm(s), e.g. {missing[0]}: measure the map "
                         "on the same model and norm selection")
    return [ranked[i:i + group] for i in range(0, len(ranked), group)]


class ProgressiveSwap:
    """Forward hooks blending each converted module with a frozen copy of its original norm (see module doc)."""

    def __init__(self, model: nn.Module, originals: dict[str, nn.Module], stages: list[Stage]):
        missing = {n for s in stages for n in s.names} - set(originals)
        if missing:
            raise ValueError(f"no original norm for {sorted(missing)}")
        self.stages = stages
        self.mix = {n: 0.0 for s in stages for n in s.names}
        self.originals = {}
        self.handles = []
        for name in self.mix:
            source = copy.deepcopy(originals[name]).requires_grad_(False).eval()
            target = model.get_submodule(name)
            param = next(target.parameters())
            self.originals[name] = source.to(param.device)
            self.handles.append(target.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args, output):
            m = self.mix[name]
            if m >= 1.0:
                return None
            source = self.originals[name](args[0])  # frozen, but the gradient reaches x through it too
            return output * m + source.to(output.dtype) * (1.0 - m)
        return hook

    def set_step(self, step: int) -> dict[str, float]:
        for stage in self.stages:
            m = stage.mix(step)
            for name in stage.names:
                self.mix[name] = m
        return self.mix

    def converted_fraction(self) -> float:
        return sum(self.mix.values()) / max(1, len(self.mix))

    def remove(self) -> None:
        """Drop the hooks and the originals: the model is then the plain converted model."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.originals = [], {}


class ProgressiveSwapCallback(TrainerCallback):
    """Sets every hook's mix from ``state.global_step`` before each step (and at the start, for resumed runs), logs
    the converted fraction, and removes the hooks when training ends."""

    def __init__(self, swap: ProgressiveSwap):
        self.swap = swap

    def on_train_begin(self, args, state, control, **kwargs):
        self.swap.set_step(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.swap.set_step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and state.log_history:
            # the Trainer has already stored this entry in log_history: record the fraction there
            state.log_history[-1]["converted_fraction"] = round(self.swap.converted_fraction(), 4)

    def on_train_end(self, args, state, control, **kwargs):
        self.swap.set_step(10 ** 12)  # fully converted, whatever the budget allowed
        self.swap.remove()
