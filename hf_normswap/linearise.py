"""Linearise a recovered element-wise model: each module that rarely saturates becomes its linear part.

``w * f(x) + b`` near ``x = 0`` is ``w * f(0) + w * f'(0) * x + b``; the method's own derivatives
(``ElementwiseNorm.grads``) give ``f(0)`` and ``f'(0)`` (DyT: ``alpha``; ELN: ``1 / sqrt(beta)``; Derf:
``2 / sqrt(pi) * alpha * exp(-shift^2)``, with ``f(0) = erf(shift)``), so the ``linear`` module keeps ``alpha`` at the
mean slope and puts the per-channel rest into ``weight``. Where a module saturates on more than ``max_saturation``
of its inputs (measured on the given batches, as the recipe's ``saturation.jsonl`` measures it along a run), its
flat part does work a line cannot, and it is kept. A LayerNorm's linear module centres its input, which the
element-wise module did not: the recipe's brief training after this (``recipes/finetune.py model=OUT
original=ORIGINAL``) absorbs that and the rest of the change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from .calibration.fitting import saturated_share
from .checkpoint.record import ConversionRecord
from .modules import ElementwiseNorm, Linear

DEFAULT_MAX_SATURATION = 0.01


class LineariseError(ValueError):
    """The model has nothing to linearise; the message says why."""


@dataclass
class LineariseReport:
    linearised: dict[str, float] = field(default_factory=dict)  # name -> saturated share measured
    kept: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"linearised {len(self.linearised)} of {len(self.linearised) + len(self.kept)} element-wise modules"]
        lines += [f"  kept {name}: saturated on {share:.2%} of its inputs" for name, share in self.kept.items()]
        return "\n".join(lines)


def saturation_shares(model: nn.Module, batches: list[dict]) -> dict[str, float]:
    """Each element-wise module's saturated share over ``batches`` (mean over them)."""
    shares: dict[str, list[float]] = {}
    handles = [module.register_forward_hook(
        lambda module, args, output, name=name: shares.setdefault(name, []).append(
            saturated_share(module, args[0].detach())))
        for name, module in model.named_modules() if isinstance(module, ElementwiseNorm)]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return {name: sum(values) / len(values) for name, values in shares.items()}


@torch.no_grad()
def linear_part(module: ElementwiseNorm, kind: str) -> Linear:
    """The ``linear`` module of ``module``'s slope and value at 0 (module doc)."""
    if type(module).grads is ElementwiseNorm.grads:
        raise LineariseError(f"{type(module).__name__} gives no derivatives (ElementwiseNorm.grads) to linearise by")
    zero = torch.zeros(module.normalized_shape)
    shape = module.shape_parameter().detach().float()
    value, slope, *_ = type(module).grads(zero, shape.expand_as(zero), *(e.detach().float() for e in module.extras()))
    alpha = float(slope.abs().mean().clamp_min(1e-30))
    weight = module.weight.detach().float()
    linear = Linear(module.normalized_shape, alpha, bias=module.bias is not None or bool(value.ne(0).any()),
                    kind=kind)
    linear.weight.copy_(weight * slope / alpha)
    if linear.bias is not None:
        linear.bias.copy_(weight * value + (module.bias.detach().float() if module.bias is not None else 0))
    linear.to(device=module.weight.device)
    for param in (linear.weight, linear.bias):
        if param is not None:
            param.data = param.data.to(module.weight.dtype)
    return linear


def linearise(model: nn.Module, batches: list[dict],
              max_saturation: float = DEFAULT_MAX_SATURATION) -> LineariseReport:
    """Replace, in place, each element-wise module saturating on at most ``max_saturation`` of its inputs over
    ``batches`` by its linear part; the record follows (``method`` becomes ``linear`` when all are)."""
    record = ConversionRecord.of(model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, ElementwiseNorm) and not isinstance(m, Linear)}
    if record is None or not modules:
        raise LineariseError("the model holds no element-wise module to linearise: convert it (--to dyt or eln) and "
                             "recover it first")
    shares = saturation_shares(model, batches)
    report = LineariseReport()
    for name, module in modules.items():
        share = shares.get(name, 0.0)
        if share > max_saturation:
            report.kept[name] = share
            continue
        parent, _, child = name.rpartition(".")
        replacement = linear_part(module, record.converted[name].kind)
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
        report.linearised[name] = share
    entries = {name: dataclasses.replace(entry, method="linear" if name in report.linearised else entry.method)
               for name, entry in record.converted.items()}
    method = "linear" if not report.kept and all(
        isinstance(model.get_submodule(n), Linear) for n in record.converted) else record.method
    dataclasses.replace(record, method=method, converted=entries, per_channel=False if method == "linear" else
                        record.per_channel).attach(model)
    return report
