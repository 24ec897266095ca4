"""Fit an element-wise module to a source norm's input -> output data by weighted least squares.

One routine serves both the model calibration (``calibrate.py``) and the paper's simulation
(``scripts/analyses/reproduce_paper.py``): start from the analytic value of the theory, then minimize

    sum_{t,i} w_{t,i} * (module(x)_{t,i} - norm(x)_{t,i})^2 / sum w

over the module's own parameters (the shape parameter ``log_alpha`` / ``log_beta`` with the method's scalar extras
such as Derf's shift, and optionally ``weight``, which carries gamma times the amplitude, and ``bias``) with L-BFGS
in float64. The residual lives in output space, after the affine map, so every channel counts in proportion to its
output weight: a channel the next layer multiplies by 3 matters 9 times as much as one it multiplies by 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..modules import METHODS, ElementwiseNorm, amplitude_for

SATURATION = 0.95  # |f(x)| above this share of the amplitude counts as saturated
FIT_PARAMS = ("shape", "weight", "bias")


@dataclass
class FitStats:
    """What a fit did, for the conversion report. Errors are measured on all rows given, unweighted."""

    loss_before: float  # weighted MSE at the initial parameters
    loss: float  # weighted MSE after the fit (the fit residual)
    mean_abs_residual: float  # mean |module(x) - target| over the rows the fit weighted (w > 0)
    rel_error: float  # ||module(x) - target|| / ||target|| over ordinary (not first-position) rows
    rel_error_first: float | None  # the same over first-position rows, when there are any
    saturation: float  # share of elements with |f(x)| > SATURATION
    iterations: int

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def analytic_input_scale(x: torch.Tensor, kind: str, is_first: torch.Tensor | None = None) -> float:
    """Typical per-token scale of the norm's input: median std (LayerNorm) or RMS (RMSNorm) over ordinary tokens.

    The median, not the mean: first-position tokens with 170x the RMS would otherwise set the scale for all.
    """
    if is_first is not None and (~is_first).any():
        x = x[~is_first]
    x = x.double()
    scale = x.std(-1, unbiased=False) if kind == "layernorm" else x.pow(2).mean(-1).sqrt()
    return max(float(scale.median()), 1e-6)


def saturating_init(module: ElementwiseNorm, x: torch.Tensor, kind: str, input_scale: float,
                    is_first: torch.Tensor | None = None, knee: float = 0.7) -> None:
    """Per-channel start that squashes tokens far above the typical scale instead of passing them through.

    The theory's initialization is linear up to ``amplitude * sigma``: a token with 10x the median RMS (SmolLM2's
    secondary sinks, layers 3-9) or 200x (its attention sinks, layer 12 on) comes out 10-200x too large, and the
    error compounds over 61 norms to perplexity above 1e100. Here channel ``c`` keeps the norm's slope at zero for
    a token of the typical scale ``input_scale`` (:func:`analytic_input_scale`) but saturates at ``knee * s_c``
    times the source weight, where ``s_c`` is the RMS of the channel's normalized value over ordinary tokens (about
    1, larger for channels that are large in every token). The module must be per-channel; its ``weight`` becomes
    ``w * knee * s_c``.
    """
    if not module.saturates:
        return  # a linear module keeps the theory's start: nothing to squash
    if not module.per_channel:
        raise ValueError("saturating_init needs a per-channel module (per_channel=True)")
    if is_first is not None and (~is_first).any():
        x = x[~is_first]
    x = x.double()
    centred = x - x.mean(-1, keepdim=True) if kind == "layernorm" else x
    token_scale = centred.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    ceiling = knee * (centred / token_scale).pow(2).mean(0).sqrt().clamp_min(1e-3)
    ceiling = ceiling.to(module.weight.device)  # the samples are on the CPU, the module where its block is computed
    with torch.no_grad():
        source_weight = module.weight.detach().double() / module.amplitude
        module.weight.copy_((source_weight * ceiling).to(module.weight.dtype))
        # slope at zero weight * f'(0) = source_weight / input_scale, i.e. f'(0) = 1 / (ceiling * input_scale)
        knee_input = ceiling * input_scale
        module.set_shape_parameter(module.knee_shape(knee_input))  # e.g. alpha = 1 / knee_input, beta = knee_input^2


def squash_share(module: ElementwiseNorm, x: torch.Tensor) -> torch.Tensor:
    """f(x) with |f| < 1 for each element, in the module's current parameters, computed where ``x`` is (the samples
    stay on the CPU while the module sits on the device that computes its block)."""
    with torch.no_grad():
        extras = (e.detach().float().to(x.device) for e in module.extras())
        return module.squash(x.float(), module.shape_parameter().float().to(x.device), *extras)


def saturated_share(module: ElementwiseNorm, x: torch.Tensor) -> float:
    """Share of the elements of ``x`` in the flat part of the module's squash (``|f| > SATURATION``); 0 for a method
    without one (``ElementwiseNorm.saturates``)."""
    if not module.saturates:
        return 0.0
    return float((squash_share(module, x).abs() > SATURATION).double().mean())


def _weighted_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    err = (pred - target).pow(2)
    if weight is None:
        return err.mean()
    weight = weight.expand_as(err)
    return (err * weight).sum() / weight.sum().clamp_min(1e-30)


def fit_module(
    module: ElementwiseNorm,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    params: tuple[str, ...] = ("shape",),
    is_first: torch.Tensor | None = None,
    max_iter: int = 200,
    dtype: torch.dtype | None = None,
) -> FitStats:
    """Least-squares fit of ``module``'s ``params`` (subset of ``shape``, with its scalar extras, ``weight``,
    ``bias``) so that ``module(x) ~ target``; ``weight`` broadcasts to ``x`` (per row ``(N, 1)`` or per element
    ``(N, C)``).

    Updates the module in place (its parameters keep their dtype and device) and returns :class:`FitStats`.
    ``dtype``: arithmetic of the fit; float64 for small problems (the paper's), float32 above a million elements.
    """
    unknown = set(params) - set(FIT_PARAMS)
    if unknown:
        raise ValueError(f"unknown fit parameter(s) {sorted(unknown)}: choose from {FIT_PARAMS}")
    dtype = dtype or (torch.float64 if x.numel() <= 1_000_000 else torch.float32)
    x = x.detach().to(dtype)
    target = target.detach().to(dtype)
    weight = None if weight is None else weight.detach().to(dtype)
    names = {"shape": f"log_{module.shape_name}", "weight": "weight", "bias": "bias"}
    originals = dict(module.named_parameters(recurse=False))
    work = {n: p.detach().to("cpu", dtype).clone() for n, p in originals.items()}
    trainable = [work[names[p]] for p in params if names[p] in work]
    if "shape" in params:
        trainable += [work[name] for name in module.squash_extras]
    for t in trainable:
        t.requires_grad_(True)

    def forward() -> torch.Tensor:
        log = work[names["shape"]].clamp(-module.log_limit, module.log_limit)
        y = module.squash(x, log.exp(), *(work[name] for name in module.squash_extras)) * work["weight"]
        return y + work["bias"] if "bias" in work else y

    with torch.no_grad():
        loss_before = float(_weighted_mse(forward(), target, weight))
    iterations = 0
    if trainable and max_iter > 0:
        optimizer = torch.optim.LBFGS(trainable, max_iter=max_iter, line_search_fn="strong_wolfe",
                                      tolerance_grad=1e-12, tolerance_change=1e-15, history_size=20)

        def closure():
            optimizer.zero_grad()
            loss = _weighted_mse(forward(), target, weight)
            loss.backward()
            return loss

        optimizer.step(closure)
        iterations = int(optimizer.state[optimizer._params[0]].get("n_iter", 0))
    with torch.no_grad():
        fitted = forward()
        loss = float(_weighted_mse(fitted, target, weight))
        if not math.isfinite(loss) or loss > loss_before:  # never leave the module worse than the start
            for name, value in work.items():
                value.copy_(originals[name].detach().to("cpu", dtype))
            fitted, loss = forward(), loss_before
        else:
            for name, value in work.items():
                originals[name].data.copy_(value.to(originals[name].device, originals[name].dtype))
    return FitStats(loss_before=loss_before, loss=loss, iterations=iterations,
                    **_residual_stats(module, x, target, fitted, weight, is_first))


def _residual_stats(module, x, target, fitted, weight, is_first) -> dict:
    """The fields of :class:`FitStats` that measure what the fit left: its residual and the module's saturation."""
    with torch.no_grad():
        diff = fitted - target
        used = torch.ones_like(diff, dtype=torch.bool) if weight is None else (weight > 0).expand_as(diff)
        mean_abs = float(diff.abs()[used].mean()) if used.any() else float("nan")
        first = is_first if is_first is not None else torch.zeros(x.shape[0], dtype=torch.bool)

        def rel(rows):
            if not rows.any():
                return None
            return float(diff[rows].norm() / target[rows].norm().clamp_min(1e-30))

        rel_ordinary = rel(~first)
        return dict(mean_abs_residual=mean_abs, rel_error=rel_ordinary if rel_ordinary is not None else float("nan"),
                    rel_error_first=rel(first), saturation=saturated_share(module, x))


def fit_curve(
    kind: str,
    method: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    size: int,
    amplitude: float | None = None,
    input_scale: float = 1.0,
    max_iter: int = 500,
) -> tuple[float, FitStats]:
    """Fit a scalar alpha (DyT, Derf) or beta (ELN) to points ``(x, y)`` of a norm's curve, amplitude fixed.

    This is the paper's experiment (C channels, amplitude sqrt(C-1) for LayerNorm). Returns (alpha or beta, stats).
    """
    cls = METHODS[method]
    amplitude = amplitude_for(kind, size) if amplitude is None else amplitude
    module = cls(1, cls.analytic_shape_value(kind, size, input_scale), bias=False, amplitude=amplitude)
    stats = fit_module(module, x.reshape(-1, 1), y.reshape(-1, 1), params=("shape",), max_iter=max_iter)
    return float(module.shape_parameter().detach()), stats
