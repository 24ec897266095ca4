"""Linearise a recovered element-wise model: each module that rarely saturates becomes a line.

The line is each channel's least-squares fit of the module's output to its input, over the tokens it sees on the
given batches, position 0 left out (the attention sink, whose input is 10-180x the others' in SmolLM2, would
otherwise set every slope). The tangent at 0, the other obvious line, is far off the curve where the inputs
actually lie (BENCHMARKS.md, "Linear"). The ``linear`` module keeps ``alpha`` at the mean slope and puts the
per-channel rest into ``weight``. Where a module saturates on more than ``max_saturation`` of its inputs (as the
recipe's ``saturation.jsonl`` measures it along a run), its flat part does work a line cannot, and it is kept. A
LayerNorm's line is fitted to its centred input, as the ``linear`` module centres it. The recipe's brief training
after this (``recipes/finetune.py model=OUT original=ORIGINAL``) absorbs the rest of the change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from .calibration.fitting import saturated_share
from .checkpoint.record import ConversionRecord
from .modules import ElementwiseNorm, Linear, replace_module

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


@dataclass
class LineStatistics:
    """Per-channel sums over the ordinary tokens a module saw: enough for the least-squares line."""

    count: float = 0.0
    x: torch.Tensor | float = 0.0
    y: torch.Tensor | float = 0.0
    xx: torch.Tensor | float = 0.0
    xy: torch.Tensor | float = 0.0
    saturated: list[float] = field(default_factory=list)

    def add(self, module: ElementwiseNorm, kind: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.saturated.append(saturated_share(module, x))
        y = y.double()
        if x.dim() >= 3 and x.shape[-2] > 1:  # a sequence axis: position 0 left out
            x, y = x[..., 1:, :], y[..., 1:, :]
        x = x.double()
        if kind == "layernorm":  # the linear module centres its input
            x = x - x.mean(-1, keepdim=True)
        x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        self.count += x.shape[0]
        self.x, self.y = self.x + x.sum(0), self.y + y.sum(0)
        self.xx, self.xy = self.xx + (x * x).sum(0), self.xy + (x * y).sum(0)

    def line(self, through_origin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Slope and intercept of each channel (slope 0 for a channel whose input never varied); ``through_origin``:
        intercept 0, for a module with no offset (an odd curve and no bias, as an RMSNorm's)."""
        if through_origin:
            slope = torch.where(self.xx > 0, self.xy / torch.as_tensor(self.xx).clamp_min(1e-300), 0.0)
            return slope, torch.zeros_like(slope)
        mean_x, mean_y = self.x / self.count, self.y / self.count
        variance = self.xx / self.count - mean_x * mean_x
        slope = torch.where(variance > 0, (self.xy / self.count - mean_x * mean_y) / variance.clamp_min(1e-300), 0.0)
        return slope, mean_y - slope * mean_x


def line_statistics(model: nn.Module, modules: dict[str, ElementwiseNorm], kinds: dict[str, str],
                    batches: list[dict]) -> dict[str, LineStatistics]:
    """Each module's :class:`LineStatistics` over ``batches``, in one pass of the model."""
    stats = {name: LineStatistics() for name in modules}
    handles = [module.register_forward_hook(
        lambda module, args, output, name=name: stats[name].add(module, kinds[name], args[0].detach(), output.detach()))
        for name, module in modules.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return stats


@torch.no_grad()
def fitted_line(module: ElementwiseNorm, kind: str, stats: LineStatistics) -> Linear:
    """The ``linear`` module of ``stats``' least-squares line (module doc); through the origin where the module has
    no offset, so a source without a bias (an RMSNorm) keeps none and still exports as its architecture."""
    zero = torch.zeros(module.normalized_shape, device=module.weight.device, dtype=module.weight.dtype)
    offset = module.bias is not None or bool(module(zero).ne(0).any())
    slope, intercept = stats.line(through_origin=not offset)
    alpha = float(slope.abs().mean().clamp_min(1e-30))
    linear = Linear(module.normalized_shape, alpha, bias=offset, kind=kind)
    linear.weight.copy_(slope / alpha)
    if offset:
        linear.bias.copy_(intercept)
    return linear.to(device=module.weight.device, dtype=module.weight.dtype)


def linearise(model: nn.Module, batches: list[dict],
              max_saturation: float = DEFAULT_MAX_SATURATION) -> LineariseReport:
    """Replace, in place, each element-wise module saturating on at most ``max_saturation`` of its inputs over
    ``batches`` by its linear part; the record follows (``method`` becomes ``linear`` when all are)."""
    record = ConversionRecord.of(model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, ElementwiseNorm) and not isinstance(m, Linear)}
    if record is None or not modules:
        raise LineariseError("the model holds no element-wise module to linearise: convert it (--to dyt or eln) and "
                             "recover it first")
    kinds = {name: record.converted[name].kind for name in modules}
    stats = line_statistics(model, modules, kinds, batches)
    report = LineariseReport()
    for name, module in modules.items():
        share = sum(stats[name].saturated) / max(len(stats[name].saturated), 1)
        if share > max_saturation or not stats[name].count:
            report.kept[name] = share
            continue
        replace_module(model, name, fitted_line(module, kinds[name], stats[name]))
        report.linearised[name] = share
    entries = {name: dataclasses.replace(entry, method="linear" if name in report.linearised else entry.method)
               for name, entry in record.converted.items()}
    method = "linear" if not report.kept and all(
        isinstance(model.get_submodule(n), Linear) for n in record.converted) else record.method
    dataclasses.replace(record, method=method, converted=entries, per_channel=False if method == "linear" else
                        record.per_channel).attach(model)
    return report
