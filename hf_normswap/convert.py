"""``convert(model, to=...)``: swap norms for element-wise modules in place and report what happened.

One verb, in place, like torchao's ``quantize_``: find and classify norms, select the ones to convert (by role
and name pattern), build each replacement from the source norm's weights, set it on the parent module, and
record a ``normswap`` block in ``model.config`` so a checkpoint knows how it was made.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from torch import nn

from . import __version__
from .calibrate import as_config, calibrate_and_replace, fit_table
from .discovery import NormInfo, find_norms, norm_parameters
from .modules import METHODS, ElementwiseNorm
from .roles import ROLES, assign_roles

DEFAULT_ROLES = tuple(r for r in ROLES if r not in ("qk_norm", "other"))


class ConversionError(ValueError):
    """A user-facing problem with a conversion request; the message says what to change."""


@dataclass
class ConvertedNorm:
    name: str
    source_class: str
    kind: str
    role: str
    size: int
    amplitude: float
    shape_parameter: dict  # {"beta": ...} or {"alpha": ...}: scalar value or per-channel mean
    fit: dict | None = None  # calibration: parameters, fit residual, relative error, saturation (calibrate.NormFit)


@dataclass
class ConversionReport:
    method: str
    converted: list[ConvertedNorm] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"name", "class", "reason"}
    found: list[NormInfo] = field(default_factory=list)
    calibration: dict | None = None  # calibration summary (data, strategy, time, memory), when calibrated

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "converted": [asdict(c) for c in self.converted],
            "skipped": self.skipped,
            "calibration": self.calibration,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} of {len(self.found)} norms to {self.method.upper()}"]
        for c in self.converted:
            (key, value), = c.shape_parameter.items()
            lines.append(f"  {c.name:<55} {c.kind:<9} {c.role:<15} C={c.size:<5} A={c.amplitude:<7.4g} {key}={value:.4g}")
        if self.calibration is not None:
            lines.append(fit_table(self))
        for s in self.skipped:
            lines.append(f"  skipped {s['name']} ({s['class']}): {s['reason']}")
        return "\n".join(lines)


def _select(norms: list[NormInfo], roles: Iterable[str], include: str | None, exclude: str | None):
    """Split norms into (selected, skipped-with-reason)."""
    roles = set(roles)
    unknown = roles - set(ROLES)
    if unknown:
        raise ConversionError(f"unknown role(s) {sorted(unknown)}: choose from {', '.join(ROLES)}")
    patterns = {}
    for label, pattern in (("include", include), ("exclude", exclude)):
        try:
            patterns[label] = re.compile(pattern) if pattern else None
        except re.error as error:
            raise ConversionError(f"--{label} pattern {pattern!r} is not a valid regular expression: {error}") from None
    selected, skipped = [], []
    for norm in norms:
        reason = None
        if norm.kind is None:
            reason = norm.problem
        elif norm.role not in roles:
            reason = f"role {norm.role} not selected (roles: {', '.join(sorted(roles))})"
        elif patterns["include"] and not patterns["include"].search(norm.name):
            reason = f"name does not match include pattern {include!r}"
        elif patterns["exclude"] and patterns["exclude"].search(norm.name):
            reason = f"name matches exclude pattern {exclude!r}"
        if reason:
            skipped.append({"name": norm.name, "class": norm.class_name, "reason": reason})
        else:
            selected.append(norm)
    for label, pattern in (("include", include), ("exclude", exclude)):
        if pattern and not any(patterns[label].search(n.name) for n in norms):
            raise ConversionError(f"--{label} pattern {pattern!r} matches no norm; run `normswap inspect` to see names")
    return selected, skipped


def inspect(model: nn.Module) -> list[NormInfo]:
    """All norms in ``model`` with kind and role; raises ``ConversionError`` when there are none."""
    norms = find_norms(model)
    if not norms:
        raise ConversionError(f"{type(model).__name__} has no LayerNorm or RMSNorm layers: nothing to convert")
    assign_roles(model, norms)
    return norms


def plan(
    model: nn.Module,
    roles: Iterable[str] = DEFAULT_ROLES,
    include: str | None = None,
    exclude: str | None = None,
) -> tuple[list[NormInfo], list[NormInfo], list[dict]]:
    """(all norms, norms that ``convert`` would replace, skipped with reasons), without changing the model."""
    norms = inspect(model)
    selected, skipped = _select(norms, roles, include, exclude)
    if not selected:
        raise ConversionError("the selection converts no norm; widen --roles / --include or run `normswap inspect`")
    return norms, selected, skipped


def build_replacement(
    module: nn.Module, info: NormInfo, method: str, *, input_scale: float = 1.0, per_channel: bool = False
) -> ElementwiseNorm:
    """The element-wise module for one source norm, with its weights carried over and analytic shape parameter."""
    weight, bias = norm_parameters(module, info)
    replacement = METHODS[method].from_norm(
        weight, bias, kind=info.kind, normalized_shape=info.normalized_shape,
        input_scale=input_scale, per_channel=per_channel,
    )
    source_dtype = next((p.dtype for p in module.parameters()), None)
    if source_dtype is not None:  # affine parameters follow the model; alpha / beta stay fp32 for precision
        for param in (replacement.weight, replacement.bias):
            if param is not None:
                param.data = param.data.to(source_dtype)
    return replacement


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Set ``new`` at dotted path ``name`` and return the module it replaced (instances only, no class patching)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def convert(
    model: nn.Module,
    to: str = "eln",
    calibration=None,
    *,
    roles: Iterable[str] = DEFAULT_ROLES,
    include: str | None = None,
    exclude: str | None = None,
    per_channel: bool = False,
    input_scale: float = 1.0,
) -> ConversionReport:
    """Replace the selected norms of ``model`` with DyT or ELN modules, in place.

    Without ``calibration`` the shape parameters come from the theory for inputs of scale ``input_scale``. With
    a :class:`~hf_normswap.calibrate.CalibrationConfig` (or token ids, shorthand for one with default options)
    each module is per-channel and fitted to captured activations instead; see ``calibrate.py``.
    Returns a :class:`ConversionReport`; the same summary is stored as ``model.config.normswap``.
    """
    method = to.lower()
    if method not in METHODS:
        raise ConversionError(f"unknown method {to!r}: use --to eln or --to dyt")
    if calibration is not None:
        try:
            calibration = as_config(calibration)
        except ValueError as error:
            raise ConversionError(str(error)) from None
    norms, selected, skipped = plan(model, roles, include, exclude)
    report = ConversionReport(method=method, skipped=skipped, found=norms)
    fits = {}
    if calibration is not None:
        def build(source, info, *, input_scale, per_channel):
            return build_replacement(source, info, method, input_scale=input_scale, per_channel=per_channel)

        result = calibrate_and_replace(model, selected, calibration, build, replace_module)
        fits, report.calibration = result.fits, result.summary
    for info in selected:
        if calibration is not None:
            replacement = model.get_submodule(info.name)
        else:
            source = model.get_submodule(info.name)
            replacement = build_replacement(source, info, method, input_scale=input_scale, per_channel=per_channel)
            replace_module(model, info.name, replacement)
        value = replacement.shape_parameter().detach()
        report.converted.append(
            ConvertedNorm(
                name=info.name,
                source_class=info.class_name,
                kind=info.kind,
                role=info.role,
                size=info.size,
                amplitude=replacement.amplitude,
                shape_parameter={replacement.shape_name: float(value.mean())},
                fit=fits[info.name].to_dict() if info.name in fits else None,
            )
        )
    if hasattr(model, "config"):
        model.config.normswap = {
            "version": __version__,
            "method": method,
            "per_channel": any(getattr(model.get_submodule(c.name), "per_channel", False) for c in report.converted),
            "converted": {
                c.name: {"kind": c.kind, "role": c.role, "size": c.size, "amplitude": c.amplitude, "bias": b}
                for c, b in zip(report.converted, (i.has_bias for i in selected))
            },
            "calibration": report.calibration,
        }
        from .checkpoint import enable_save

        enable_save(model)  # model.save_pretrained / push_to_hub now write the full checkpoint (remote code, card)
    return report
