"""The scale anchor: a loss that holds the scale of the residual stream entering the final norm (``at="final"``), or
every converted norm (``at="all"``), to one value for every token.

An RMSNorm before the output head divides each token by its own RMS; an element-wise replacement cannot, so a token
whose residual stream is twice as large reaches the head with roughly twice the logits (a different softmax
temperature). TaperNorm (arXiv 2602.10408) finds that the final norm's role is this scale anchor and replaces it by
a fixed-target loss on the pre-logit scale; Baroni et al. 2025 add an auxiliary loss on the residual stream's norm
when they remove GPT-2's. Here, per token ``t`` of the converted model's final-norm input ``x_t``,

    (log rms(x_t) - c)^2,   c = mean over the batch's tokens of log rms(x_t), held fixed (no gradient),

averaged over tokens: the spread of the pre-logit scale across tokens, the part an element-wise module cannot undo.
The target is the converted model's own mean, not the original's: the calibrated final module was fitted to the
scale of the converted blocks' output, and a pull toward the original's would move every token away from it. The
first position (the attention sink) and padding do not count. With ``at="all"`` the term is the mean of the same
error over every converted norm's input (the anchors' loss generalised: a linear or element-wise module anywhere
passes a token's scale on, where the norm it replaced divided it out); a query / key norm, whose input is per
head, is left out. Nothing of this stays in the model: it is a training loss read by forward pre-hooks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from .layerwise import token_weights

FINAL = "final"  # the discovery role of the norm before the output head
PLACES = ("final", "all")  # distill.scale_at: the final norm's input, or every converted norm's
PER_HEAD = "qk_norm"  # the role whose input is per attention head, not per token


class ScaleAnchorError(ValueError):
    """The converted model has no final module to anchor."""


def log_rms(x: torch.Tensor) -> torch.Tensor:
    """``log`` of each token's root mean square over the last dimension, in fp32."""
    return 0.5 * torch.log(x.float().pow(2).mean(dim=-1).clamp_min(1e-12))


def prelogit_scale_error(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over counted tokens of ``(log rms(x_t) - c)^2`` with ``c`` their mean log rms (module doc); ``x``:
    ``(batch, seq, dim)``, ``mask``: ``(batch, seq)``."""
    weights, total = token_weights(x, mask)
    scales = log_rms(x)
    target = ((scales * weights).sum() / total).detach()
    return ((scales - target).pow(2) * weights).sum() / total


class ScaleAnchor(TrainerCallback):
    """Forward pre-hooks on converted modules that keep each one's latest input for :meth:`loss`; removed when
    training ends."""

    def __init__(self, modules: list[nn.Module]):
        self.latest: dict[int, torch.Tensor] = {}  # by module: a forward that no loss reads (evaluation) is replaced
        self.handles = [module.register_forward_pre_hook(self._keep) for module in modules]

    @classmethod
    def of(cls, model: nn.Module, converted: dict[str, str], at: str = FINAL) -> "ScaleAnchor":
        """The anchor on the norm whose role is ``final`` among ``converted`` (``{name: role}``), or with ``at="all"``
        on every one of them but the query / key norms."""
        if at not in PLACES:
            raise ScaleAnchorError(f"distill.scale_at {at!r} is unknown: choose {' or '.join(PLACES)}")
        names = [name for name, role in converted.items() if (role == FINAL if at == FINAL else role != PER_HEAD)]
        if not names:
            raise ScaleAnchorError("distill.scale anchors the input of the norm before the output head, which "
                                   "was not converted: convert it too, set distill.scale_at=all, or set "
                                   "distill.scale=0")
        return cls([model.get_submodule(name) for name in names])

    def _keep(self, module, args):
        self.latest[id(module)] = args[0]

    def loss(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over the anchored modules of :func:`prelogit_scale_error` of the latest forward (one training
        step's)."""
        if not self.latest:
            raise RuntimeError("the scale anchor needs a forward of the model before its loss")
        latest, self.latest = list(self.latest.values()), {}
        return torch.stack([prelogit_scale_error(x, mask) for x in latest]).mean()

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self.handles:
            handle.remove()
        self.handles, self.latest = [], {}
