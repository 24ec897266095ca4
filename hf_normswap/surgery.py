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

import torch
from torch import nn

from . import kernels, offload
from .calibration.calibrate import CalibrationConfig, as_config, calibrate_and_replace
from .calibration.defaults import default_calibration
from .calibration.input_scales import measured_start
from .calibration.report import fit_table
from .checkpoint.record import ConversionRecord, NormEntry, converted_config
from .checkpoint.saving import enable_save
from .discovery.norms import NormInfo, find_norms, norm_parameters
from .discovery.roles import ROLES, assign_roles
from .modules import DEFAULT_METHOD, METHODS, ElementwiseNorm, replace_module
from .validation import ValidationError, check_input_scale

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
    budget: dict | None = None  # a quality-budget conversion: the norms kept and why (sensitivity.Budget)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "converted": [asdict(c) for c in self.converted],
            "skipped": self.skipped,
            "calibration": self.calibration,
            **({"budget": self.budget} if self.budget else {}),
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


def split_roles(roles: str | Iterable[str]) -> tuple[str, ...]:
    """Roles as a user writes them: comma-separated (``--roles a,b``, a YAML string) or a list; blanks dropped."""
    return tuple(r.strip() for r in (roles.split(",") if isinstance(roles, str) else roles) if r.strip())


def check_selection(roles: Iterable[str], include: str | None, exclude: str | None) -> dict:
    """Compiled include / exclude patterns; ``ConversionError`` for an unknown role or a bad pattern (no model needed,
    so the CLI calls it before the slow load)."""
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ConversionError(f"unknown role(s) {sorted(unknown)}: choose from {', '.join(ROLES)}")
    patterns = {}
    for label, pattern in (("include", include), ("exclude", exclude)):
        try:
            patterns[label] = re.compile(pattern) if pattern else None
        except re.error as error:
            raise ConversionError(f"--{label} pattern {pattern!r} is not a valid regular expression: {error}") from None
    return patterns


def _select(norms: list[NormInfo], roles: Iterable[str], include: str | None, exclude: str | None):
    """Split norms into (selected, skipped-with-reason)."""
    roles = set(roles)
    patterns = check_selection(roles, include, exclude)
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


@dataclass
class ConvertConfig:
    """What :func:`convert` does: the method, which norms (by role and name pattern), and how the new parameters are
    set (the analytic start for inputs of RMS ``input_scale``, None: each norm's own, measured in one forward pass
    on token ids; or fitted by ``calibration``).

    Checked when made, so a bad setting is one :class:`ConversionError` before any model is touched. A converted
    model records it in ``config.json`` (``normswap.convert`` and ``normswap.calibration``);
    :meth:`from_pretrained` reads it back.
    """

    method: str = DEFAULT_METHOD
    roles: tuple[str, ...] = DEFAULT_ROLES
    include: str | None = None
    exclude: str | None = None
    per_channel: bool = False
    input_scale: float | None = None
    calibration: CalibrationConfig | None = None

    def __post_init__(self):
        self.method = str(self.method).lower()
        if self.method not in METHODS:
            raise ConversionError(f"unknown method {self.method!r}: use {' or '.join(f'--to {k}' for k in METHODS)}")
        self.roles = (self.roles,) if isinstance(self.roles, str) else tuple(self.roles)
        check_selection(self.roles, self.include, self.exclude)
        if self.input_scale is not None:
            check_input_scale(self.input_scale, "input_scale")
        if self.calibration is not None:
            try:
                self.calibration = as_config(self.calibration)
            except ValueError as error:
                raise ConversionError(str(error)) from None

    def to_dict(self) -> dict:
        """The selection and initialization, as ``config.json`` records them (calibration is recorded apart)."""
        return {"method": self.method, "roles": list(self.roles), "include": self.include, "exclude": self.exclude,
                "per_channel": self.per_channel, "input_scale": self.input_scale}

    @classmethod
    def from_record(cls, record: ConversionRecord) -> "ConvertConfig":
        """The config a conversion's record holds; token ids given as calibration data are recorded by shape only,
        so such a config names ``data`` as that shape and needs the ids again to run."""
        settings = dict(record.convert or {"method": record.method})
        calibration = record.calibration
        if calibration is not None:
            calibration = CalibrationConfig.from_summary(calibration)
        return cls(**settings, calibration=calibration)

    @classmethod
    def from_pretrained(cls, path) -> "ConvertConfig":
        """The config a converted checkpoint directory was made with."""
        if converted_config(path) is None:
            raise ConversionError(f"{path} is not a checkpoint converted by hf_normswap (no normswap block in its "
                                  "config.json)")
        try:
            return cls.from_record(ConversionRecord.read(path))
        except ValidationError as error:
            raise ConversionError(str(error)) from None


def check_not_converted(model: nn.Module) -> None:
    """A model holding element-wise modules already (loaded from a converted checkpoint) records them in one block,
    that a second conversion would replace with the newly converted ones alone: refused before any calibration."""
    if any(isinstance(module, ElementwiseNorm) for module in model.modules()):
        record = ConversionRecord.of(model)
        original = record.base_model if record is not None else None
        raise ConversionError(f"the model is converted already (it holds element-wise modules): convert its original"
                              f"{f' ({original})' if original else ''} instead, choosing the norms with --roles / "
                              "--include / --exclude")


def check_finite(model: nn.Module) -> None:
    """A weight holding NaN or infinity makes every output NaN: the sampler, calibration and the check fail on it
    far from the cause. Refused in one line first (weights kept on disk by offloading are not read)."""
    for name, tensor in model.named_parameters():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not torch.isfinite(tensor).all():
            raise ConversionError(f"the model's {name} holds NaN or infinite values: its weights are damaged; "
                                  "convert an intact copy of the model")


def convert(model: nn.Module, to: str | ConvertConfig = DEFAULT_METHOD, calibration="default", *, tokenizer=None,
            **settings) -> ConversionReport:
    """Replace the selected norms of ``model`` with element-wise modules, in place.

    ``to`` is a :class:`ConvertConfig`, or the method name with the config's other fields as keyword arguments
    (``convert(model, "eln", calibration=..., roles=..., include=...)``). ``calibration`` is a
    :class:`~hf_normswap.calibration.calibrate.CalibrationConfig` (or token ids, shorthand for one with default
    options): each module is per-channel and fitted to captured activations. By default (``"default"``) it is
    what ``normswap convert`` does without ``--calib`` (``calibration.defaults``): with the model's ``tokenizer``,
    calibration on the original's own samples (an encoder: on the offline text); without one, or with
    ``calibration=None``, the start measured from one forward pass on random token ids, or, with ``input_scale``,
    the theory for inputs of that RMS.
    Returns a :class:`ConversionReport`; the same summary is stored as ``model.config.normswap``.
    """
    check_finite(model)
    if isinstance(to, ConvertConfig):
        if not (isinstance(calibration, str) and calibration == "default") or settings:
            raise ConversionError("give the settings in the ConvertConfig, not beside it")
        config = to
    else:
        if isinstance(calibration, str) and calibration == "default":
            chosen = settings.get("input_scale") is None
            calibration = default_calibration(model, tokenizer)[0] if chosen else None
        config = ConvertConfig(method=to, calibration=calibration, **settings)
    check_not_converted(model)
    kernels.install()  # the fused element-wise path, for calibration and everything after
    method, calibration, roles = config.method, config.calibration, config.roles
    include, exclude, per_channel, input_scale = config.include, config.exclude, config.per_channel, config.input_scale
    norms, selected, skipped = plan(model, roles, include, exclude)
    report = ConversionReport(method=method, skipped=skipped, found=norms)
    fits = {}

    def build(source, info, *, input_scale, per_channel):
        return build_replacement(source, info, method, input_scale=input_scale, per_channel=per_channel)

    if calibration is not None:
        result = calibrate_and_replace(model, selected, calibration, build, replace_module)
        fits, report.calibration = result.fits, result.summary
    elif input_scale is None:  # no text: each norm's inputs measured in one pass on random token ids
        measured_start(model, selected, build, replace_module)
    for info in selected:
        if calibration is not None or input_scale is None:
            replacement = model.get_submodule(info.name)
        else:
            source = model.get_submodule(info.name)
            replacement = build_replacement(source, info, method, input_scale=input_scale, per_channel=per_channel)
            replace_module(model, info.name, replacement)
        with offload.weights_in(replacement):
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
        ConversionRecord(
            method=method,
            per_channel=any(getattr(model.get_submodule(c.name), "per_channel", False) for c in report.converted),
            converted={c.name: NormEntry(kind=c.kind, role=c.role, size=c.size, amplitude=c.amplitude, bias=b)
                       for c, b in zip(report.converted, (i.has_bias for i in selected))},
            calibration=report.calibration,
            convert=config.to_dict(),
        ).attach(model)
        enable_save(model)  # model.save_pretrained / push_to_hub now write the full checkpoint (remote code, card)
    return report
