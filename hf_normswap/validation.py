"""Checks on values that come from outside the package: a checkpoint's config.json, the command line, the API.

Nothing read from a file is executed or pasted into generated code unchecked: the class names that
``remote_code.render`` writes into ``modeling_normswap.py`` must be classes that transformers itself exports.
A ``normswap`` block is checked against the model it describes and the weights it ships with, so a tampered
block is refused instead of loading a model with uninitialized or ignored parameters. Every refusal is one
:class:`ValidationError` line that names the key or option.
"""

from __future__ import annotations

import math
import re
from numbers import Real

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
