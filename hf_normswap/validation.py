"""Checks on values that come from outside the package: a checkpoint's config.json, the command line, the API.

Nothing read from a file is executed or pasted into generated code unchecked: the class names that
``remote_code.render`` writes into ``modeling_normswap.py`` must be classes that transformers itself exports.
A ``normswap`` block is checked against the model it describes and the weights it ships with, so a tampered
block is refused instead of loading a model with uninitialized or ignored parameters. Every refusal is one
:class:`ValidationError` line that names the key or option.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from numbers import Real
from pathlib import Path

import transformers
from torch import nn
from transformers import CONFIG_MAPPING, PreTrainedConfig, PreTrainedModel

from .discovery import is_norm_candidate
from .modules import METHODS

MODEL_TYPE = re.compile(r"[a-z0-9_\-]+")


class ValidationError(ValueError):
    """A value from a file, the command line or the API is not allowed; the message names the key and the fix."""


def _shown(value, limit: int = 60) -> str:
    """``repr`` of a value on one line, shortened: untrusted text must not break the one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------- names in code


def transformers_class(name, base: type, key: str) -> type:
    """The class ``transformers.<name>``, refused unless ``name`` is a plain identifier transformers exports as a
    subclass of ``base`` (PreTrainedConfig or PreTrainedModel)."""
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        kind = "configuration" if base is PreTrainedConfig else "model"
        raise ValidationError(f"config.json {key}: {_shown(name)} is not a {kind} class that transformers "
                              f"{transformers.__version__} exports; the checkpoint is damaged or was tampered with")
    return cls


def check_base(base) -> dict:
    """The ``normswap.base`` record (original architecture, config class, model type), every name checked."""
    if not isinstance(base, dict):
        raise ValidationError(f"config.json normswap.base: expected an object, got {_shown(base)}")
    model_type = base.get("model_type")
    if not (isinstance(model_type, str) and MODEL_TYPE.fullmatch(model_type) and model_type in CONFIG_MAPPING):
        raise ValidationError(f"config.json normswap.base.model_type: {_shown(model_type)} is not a model type that "
                              f"transformers {transformers.__version__} knows")
    config_class = transformers_class(base.get("config_class"), PreTrainedConfig, "normswap.base.config_class")
    transformers_class(base.get("architecture"), PreTrainedModel, "normswap.base.architecture")
    if CONFIG_MAPPING[model_type] is not config_class:
        raise ValidationError(f"config.json normswap.base.config_class: {config_class.__name__} is not the "
                              f"configuration of model type {model_type} ({CONFIG_MAPPING[model_type].__name__})")
    return base


# ------------------------------------------------------------------------------------- the normswap block


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_block(block) -> dict:
    """The structure of a checkpoint's ``normswap`` block: known methods, one object per converted module with
    a shape, a bias flag and a finite positive amplitude. Returns the block."""
    if not isinstance(block, dict):
        raise ValidationError(f"config.json normswap: expected an object, got {_shown(block)}")
    check_base(block.get("base"))
    methods = ", ".join(METHODS)
    if block.get("method") not in METHODS:
        raise ValidationError(f"config.json normswap.method: {_shown(block.get('method'))} is not one of {methods}")
    converted = block.get("converted")
    if not isinstance(converted, dict) or not converted:
        raise ValidationError("config.json normswap.converted: expected an object naming the converted modules")
    for name, entry in converted.items():
        key = f"normswap.converted.{name}"
        if not isinstance(entry, dict):
            raise ValidationError(f"config.json {key}: expected an object, got {_shown(entry)}")
        if entry.get("method", block["method"]) not in METHODS:
            raise ValidationError(f"config.json {key}.method: {_shown(entry['method'])} is not one of {methods}")
        shape = entry.get("normalized_shape") or [entry.get("size")]
        if not (isinstance(shape, list) and shape and all(_positive_int(n) for n in shape)):
            raise ValidationError(f"config.json {key}.normalized_shape: {_shown(shape)} is not a list of positive sizes")
        for flag in ("bias", "per_channel"):
            if not isinstance(entry.get(flag, False), bool):
                raise ValidationError(f"config.json {key}.{flag}: expected true or false, got {_shown(entry[flag])}")
        amplitude = entry.get("amplitude")
        if not (isinstance(amplitude, Real) and not isinstance(amplitude, bool) and math.isfinite(amplitude)
                and amplitude > 0):
            raise ValidationError(f"config.json {key}.amplitude: {_shown(amplitude)} is not a finite positive number")
    return block


def check_block_against_weights(block: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Each converted module's weight, bias and shape parameter are in the checkpoint's weights with the recorded
    shapes, and no weight belongs to a converted module the block leaves out: otherwise the load would leave
    parameters uninitialized or weights unused."""
    shape_params = {f"log_{cls.shape_name}": key for key, cls in METHODS.items()}
    converted = block["converted"]
    for name, entry in converted.items():
        key = f"config.json normswap.converted.{name}"
        method = entry.get("method", block["method"])
        shape = tuple(entry.get("normalized_shape") or (entry["size"],))
        if not any(weight.rpartition(".")[0] == name for weight in shapes):
            raise ValidationError(f"{key}: the weights hold no norm of that name")
        if shapes.get(f"{name}.weight") != shape:
            found = shapes.get(f"{name}.weight")
            raise ValidationError(f"{key}.normalized_shape: {list(shape)}, but the weights hold "
                                  + (f"{name}.weight of shape {list(found)}" if found else f"no {name}.weight"))
        if (f"{name}.bias" in shapes) != entry.get("bias", True):
            raise ValidationError(f"{key}.bias: {str(entry.get('bias', True)).lower()}, but the weights "
                                  f"{'have no' if entry.get('bias', True) else 'hold a'} {name}.bias")
        held = [p for p in shape_params if f"{name}.{p}" in shapes]
        wanted = f"log_{METHODS[method].shape_name}"
        if held != [wanted]:
            raise ValidationError(f"{key}.method: {method}, but the weights hold "
                                  + (f"{name}.{held[0]} ({shape_params[held[0]]})" if held else f"no {name}.{wanted}"))
        per_channel = entry.get("per_channel", block.get("per_channel", False))
        if shapes[f"{name}.{wanted}"] != (shape if per_channel else ()):
            raise ValidationError(f"{key}.per_channel: {str(per_channel).lower()}, but {name}.{wanted} has shape "
                                  f"{list(shapes[f'{name}.{wanted}'])}")
    for weight in shapes:
        module, _, param = weight.rpartition(".")
        if param in shape_params and module not in converted:
            raise ValidationError(f"config.json normswap.converted: {module} is missing, but the weights hold {weight} "
                                  "(a converted module); the checkpoint is damaged or was tampered with")


def check_block_against_model(model: nn.Module, block: dict) -> None:
    """Each converted name is a norm of ``model`` (the original architecture, before its norms are rebuilt) with the
    recorded shape."""
    for name, entry in block["converted"].items():
        key = f"config.json normswap.converted.{name}"
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValidationError(f"{key}: {type(model).__name__} has no module of that name") from None
        if not is_norm_candidate(module):
            raise ValidationError(f"{key}: is a {type(module).__name__}, not a LayerNorm or RMSNorm")
        weight = getattr(module, "weight", None)
        shape = tuple(entry.get("normalized_shape") or (entry["size"],))
        if isinstance(weight, nn.Parameter) and tuple(weight.shape) != shape:
            raise ValidationError(f"{key}.normalized_shape: {list(shape)}, but the model's norm has shape "
                                  f"{list(weight.shape)}")


# ------------------------------------------------------------------------------------------ numeric options

# Input RMS of real models runs from about 0.1 to a few thousand; inside this range alpha and beta stay far from
# the clamps of modules.py in fp32, outside it the analytic initialization over- or underflows.
INPUT_SCALE_RANGE = (1e-6, 1e6)


def check_number(value, name: str, minimum: float | None = None, maximum: float | None = None):
    """``value`` unless it is not a finite number within [minimum, maximum]; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise ValidationError(f"{name} must be at least {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ValidationError(f"{name} must be at most {maximum:g}, got {value:g}")
    return value


def check_input_scale(value, name: str = "input_scale") -> float:
    """A typical input RMS for the analytic initialization: positive, finite, within :data:`INPUT_SCALE_RANGE`."""
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and value <= 0:
        raise ValidationError(f"{name} must be positive (a typical input RMS), got {value:g}")
    return check_number(value, name, *INPUT_SCALE_RANGE)


# ------------------------------------------------------------------------------------------------ output paths


def check_output_file(path, flag: str) -> None:
    """A file the command will write at the end (``--report``): not a directory, in an existing writable one."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValidationError(f"{flag} {path} is a directory; give a file path such as {path / 'report.json'}")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ValidationError(f"{flag} {path}: its directory does not exist; create it or pick another path")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise ValidationError(f"{flag} {path}: permission denied; pick a path you can write")


def check_data_files(paths, flag: str) -> None:
    """Local data files (as ``data.local_paths`` returns them) that hold text: an empty file scores nothing."""
    files = [f for p in paths or () for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]
    if paths and all(f.stat().st_size == 0 for f in files):
        raise ValidationError(f"{flag} {', '.join(map(str, paths))}: no text (the files are empty)")


# ------------------------------------------------------------------------------------------- nested settings


def check_keys(settings: dict, known: dict, prefix: str = "") -> None:
    """Every key of ``settings`` is in ``known`` (key -> nested ``known`` dict, or None for a leaf); an unknown
    key is refused with the nearest known one suggested, so a typo cannot be ignored silently."""
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(map(str, known)))}"
            raise ValidationError(f"unknown setting {name}: {hint}")
        if isinstance(known[key], dict):
            if not isinstance(value, dict):
                raise ValidationError(f"setting {name} must be a mapping of {', '.join(sorted(known[key]))}, "
                                      f"got {_shown(value)}")
            check_keys(value, known[key], name + ".")
