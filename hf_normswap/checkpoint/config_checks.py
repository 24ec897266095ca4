"""Checks of a checkpoint's ``config.json``: its ``normswap`` block and the original architecture it names.

Nothing read from a file is executed or pasted into generated code unchecked: the class names that
``remote_code.render`` writes into ``modeling_normswap.py`` must be classes that transformers itself exports.
A ``normswap`` block is checked against the model it describes and the weights it ships with, so a tampered
block is refused instead of loading a model with uninitialized or ignored parameters.
"""

from __future__ import annotations

import math
import re
from numbers import Real

import transformers
from torch import nn
from transformers import CONFIG_MAPPING, PreTrainedConfig, PreTrainedModel

from ..discovery.norms import is_norm_candidate
from ..discovery.roles import ROLES
from ..modules import METHODS
from ..validation import ValidationError, shown
from .record import ConversionRecord, OriginalArchitecture

MODEL_TYPE = re.compile(r"[a-z0-9_\-]+")
KINDS = ("layernorm", "rmsnorm")  # what the probe classifies a norm as (``discovery.norms.probe``)


# ------------------------------------------------------------------------------------------- names in code


def transformers_class(name, base: type, key: str) -> type:
    """The class ``transformers.<name>``, refused unless ``name`` is a plain identifier transformers exports as a
    subclass of ``base`` (PreTrainedConfig or PreTrainedModel)."""
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        kind = "configuration" if base is PreTrainedConfig else "model"
        raise ValidationError(f"config.json {key}: {shown(name)} is not a {kind} class that transformers "
                              f"{transformers.__version__} exports; the checkpoint is damaged or was tampered with")
    return cls


def check_base(base: OriginalArchitecture | None) -> OriginalArchitecture:
    """The ``normswap.base`` record (original architecture, config class, model type), every name checked."""
    if not isinstance(base, OriginalArchitecture):
        raise ValidationError(f"config.json normswap.base: expected an object, got {shown(base)}")
    model_type = base.model_type
    if not (isinstance(model_type, str) and MODEL_TYPE.fullmatch(model_type) and model_type in CONFIG_MAPPING):
        raise ValidationError(f"config.json normswap.base.model_type: {shown(model_type)} is not a model type that "
                              f"transformers {transformers.__version__} knows")
    config_class = transformers_class(base.config_class, PreTrainedConfig, "normswap.base.config_class")
    transformers_class(base.architecture, PreTrainedModel, "normswap.base.architecture")
    if CONFIG_MAPPING[model_type] is not config_class:
        raise ValidationError(f"config.json normswap.base.config_class: {config_class.__name__} is not the "
                              f"configuration of model type {model_type} ({CONFIG_MAPPING[model_type].__name__})")
    return base


# ------------------------------------------------------------------------------------- the normswap block


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_block(record: ConversionRecord) -> ConversionRecord:
    """The values of a checkpoint's record: known methods, each converted norm with its kind, size and shape, a
    bias flag and a finite positive amplitude. Returns the record."""
    check_base(record.base)
    methods = ", ".join(METHODS)
    if record.method not in METHODS:
        raise ValidationError(f"config.json normswap.method: {shown(record.method)} is not one of {methods}")
    if not isinstance(record.converted, dict) or not record.converted:
        raise ValidationError("config.json normswap.converted: expected an object naming the converted modules")
    for name, entry in record.converted.items():
        key = f"normswap.converted.{name}"
        if entry.method is not None and entry.method not in METHODS:
            raise ValidationError(f"config.json {key}.method: {shown(entry.method)} is not one of {methods}")
        if entry.kind not in KINDS:  # the card and the recipe read them
            raise ValidationError(f"config.json {key}.kind: {shown(entry.kind)} is not a norm kind "
                                  f"({', '.join(KINDS)})")
        if entry.role is not None and not (isinstance(entry.role, str) and entry.role in ROLES):
            raise ValidationError(f"config.json {key}.role: {shown(entry.role)} is not a role ({', '.join(ROLES)})")
        if not _positive_int(entry.size):
            raise ValidationError(f"config.json {key}.size: {shown(entry.size)} is not a positive size")
        shape = entry.normalized_shape or [entry.size]
        if not (isinstance(shape, list) and shape and all(_positive_int(n) for n in shape)):
            raise ValidationError(f"config.json {key}.normalized_shape: {shown(shape)} is not a list of positive sizes")
        if shape[-1] != entry.size:  # a norm's size is its normalized shape's last dimension
            raise ValidationError(f"config.json {key}.size: {entry.size} is not the last size of "
                                  f"{key}.normalized_shape {shape}")
        for flag in ("bias", "per_channel"):
            if not isinstance(getattr(entry, flag) or False, bool):
                raise ValidationError(f"config.json {key}.{flag}: expected true or false, got "
                                      f"{shown(getattr(entry, flag))}")
        amplitude = entry.amplitude
        if not (isinstance(amplitude, Real) and not isinstance(amplitude, bool) and math.isfinite(amplitude)
                and amplitude > 0):
            raise ValidationError(f"config.json {key}.amplitude: {shown(amplitude)} is not a finite positive number")
    return record


def check_block_against_weights(record: ConversionRecord, shapes: dict[str, tuple[int, ...]]) -> None:
    """Each converted module's weight, bias and shape parameter are in the checkpoint's weights with the recorded
    shapes, and no weight belongs to a converted module the block leaves out: otherwise the load would leave
    parameters uninitialized or weights unused."""
    shape_params: dict[str, str] = {}  # "log_alpha" -> "dyt or derf": methods that share a shape parameter
    for key, cls in METHODS.items():
        name = f"log_{cls.shape_name}"
        shape_params[name] = f"{shape_params[name]} or {key}" if name in shape_params else key
    extra_params = {p for cls in METHODS.values() for p in cls.squash_extras}  # Derf's shift tells it from DyT
    converted = record.norms()
    for name, entry in converted.items():
        key = f"config.json normswap.converted.{name}"
        method, shape = entry.method, entry.shape
        if not any(weight.rpartition(".")[0] == name for weight in shapes):
            raise ValidationError(f"{key}: the weights hold no norm of that name")
        if shapes.get(f"{name}.weight") != shape:
            found = shapes.get(f"{name}.weight")
            raise ValidationError(f"{key}.normalized_shape: {list(shape)}, but the weights hold "
                                  + (f"{name}.weight of shape {list(found)}" if found else f"no {name}.weight"))
        if (f"{name}.bias" in shapes) != entry.bias:
            raise ValidationError(f"{key}.bias: {str(entry.bias).lower()}, but the weights "
                                  f"{'have no' if entry.bias else 'hold a'} {name}.bias")
        held = [p for p in shape_params if f"{name}.{p}" in shapes]
        wanted = f"log_{METHODS[method].shape_name}"
        if held != [wanted]:
            raise ValidationError(f"{key}.method: {method}, but the weights hold "
                                  + (f"{name}.{held[0]} ({shape_params[held[0]]})" if held else f"no {name}.{wanted}"))
        held_extras = sorted(p for p in extra_params if f"{name}.{p}" in shapes)
        if held_extras != sorted(METHODS[method].squash_extras):
            raise ValidationError(f"{key}.method: {method}, but the weights hold "
                                  + (", ".join(f"{name}.{p}" for p in held_extras) if held_extras
                                     else f"no {name}.{', '.join(METHODS[method].squash_extras)}"))
        per_channel = entry.per_channel
        if shapes[f"{name}.{wanted}"] != (shape if per_channel else ()):
            raise ValidationError(f"{key}.per_channel: {str(per_channel).lower()}, but {name}.{wanted} has shape "
                                  f"{list(shapes[f'{name}.{wanted}'])}")
    for weight in shapes:
        module, _, param = weight.rpartition(".")
        if param in shape_params and module not in converted:
            raise ValidationError(f"config.json normswap.converted: {module} is missing, but the weights hold {weight} "
                                  "(a converted module); the checkpoint is damaged or was tampered with")


def check_block_against_model(model: nn.Module, record: ConversionRecord) -> None:
    """Each converted name is a norm of ``model`` (the original architecture, before its norms are rebuilt) with the
    recorded shape."""
    for name, entry in record.converted.items():
        key = f"config.json normswap.converted.{name}"
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValidationError(f"{key}: {type(model).__name__} has no module of that name") from None
        if not is_norm_candidate(module):
            raise ValidationError(f"{key}: is a {type(module).__name__}, not a LayerNorm or RMSNorm")
        weight = getattr(module, "weight", None)
        shape = entry.shape
        if isinstance(weight, nn.Parameter) and tuple(weight.shape) != shape:
            raise ValidationError(f"{key}.normalized_shape: {list(shape)}, but the model's norm has shape "
                                  f"{list(weight.shape)}")
