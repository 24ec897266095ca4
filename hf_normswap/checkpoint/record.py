"""The record of a conversion: the ``normswap`` block of a converted model's ``config.json``.

:class:`ConversionRecord` is the block's schema and its only writer and reader; each converted norm is a
:class:`NormEntry`, the original architecture an :class:`OriginalArchitecture`. One generic pair turns these
records into JSON data and back (:func:`to_dict`, :func:`from_dict`), so a field added to a record class is
written, read and carried by every copy (the checkpoint's remote code holds :class:`NormEntry` and
:func:`from_dict` verbatim) without another edit. ``convert`` makes a record; whatever adds to a converted model's
story (the budget search, fold, an evaluation, the recovery recipe) hands its part to
:meth:`ConversionRecord.amend`; a save stores it with what a reload needs (:meth:`ConversionRecord.store`); a load
reads it back through :meth:`ConversionRecord.read`, which checks the format version first (and
``config_checks.check_block`` the values). In memory the block is
a plain dict on ``model.config`` (transformers serializes it with the config), written only from here.

Format versions: 1, the blocks written before the version was recorded (they read as 1 and load as before); 2,
the present one. A block of a later version is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..validation import ValidationError
from ..version import __version__

KEY = "normswap"  # the config attribute and config.json key
FORMAT_VERSION = 2
PARTS = ("evaluation", "budget", "training", "folded", "check", "hand_over")  # what later stages add to a record


@dataclass(kw_only=True)
class NormEntry:
    """One converted norm (``converted`` maps its module name to it): what it was (``kind``, ``role``, ``size``) and
    what rebuilds its element-wise module before the weights load. A save adds ``normalized_shape`` and
    ``per_channel``, and ``method`` where the module's differs from the block's; absent, the block's apply."""

    kind: str
    role: str | None = None
    size: int
    amplitude: float
    bias: bool = True
    normalized_shape: list[int] | None = None
    per_channel: bool | None = None
    method: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.normalized_shape or (self.size,))


def from_dict(cls, data, where: str):
    """The record class ``cls`` read from JSON data: each field by its name (a key no field names is left out, a
    missing field without a default is refused naming it); a field typed as a record class, or as a mapping of
    names to one, is read the same way. Values are not checked here (``config_checks`` does)."""
    if not isinstance(data, dict):
        raise ValueError(f"config.json {where}: expected an object, got {reprlib.repr(data)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in dataclasses.fields(cls):
        key = f"{where}.{spec.name}"
        if spec.name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ValueError(f"config.json {key}: missing")
            continue
        value = data[spec.name]
        hint = hints[spec.name]  # X, X | None, dict[str, X] or dict[str, X] | None
        kinds = [hint] if typing.get_origin(hint) is dict else [hint, *typing.get_args(hint)]
        record = next((k for k in kinds if dataclasses.is_dataclass(k)), None)
        mapped = next((typing.get_args(k)[1] for k in kinds if typing.get_origin(k) is dict
                       and dataclasses.is_dataclass(typing.get_args(k)[1])), None)
        if record is not None and value is not None:
            value = from_dict(record, value, key)
        elif mapped is not None and value is not None:
            if not isinstance(value, dict):
                raise ValueError(f"config.json {key}: expected an object, got {reprlib.repr(value)}")
            value = {name: from_dict(mapped, item, f"{key}.{name}") for name, item in value.items()}
        values[spec.name] = value
    return cls(**values)


def to_dict(record) -> dict:
    """A record as JSON data (a copy): nested records and mappings of them written the same way; a field at None
    is left out unless its metadata says ``written`` (the reader then tells "none" from "never recorded")."""
    def plain(value):
        if dataclasses.is_dataclass(value):
            return to_dict(value)
        if isinstance(value, dict):
            return {name: plain(item) for name, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(plain(item) for item in value)
        return value

    return {spec.name: plain(getattr(record, spec.name)) for spec in dataclasses.fields(record)
            if getattr(record, spec.name) is not None or spec.metadata.get("written")}


def norm_entries(block: dict) -> dict[str, NormEntry]:
    """Each converted norm of a ``normswap`` block, its method and per-channel flag filled in from the block's
    where the entry leaves them out: what rebuilds the modules (``remote_code.rebuild_norms``)."""
    entries = {name: from_dict(NormEntry, data, f"normswap.converted.{name}")
               for name, data in block["converted"].items()}
    return {name: dataclasses.replace(entry, method=entry.method or block["method"],
                                      per_channel=block.get("per_channel", False) if entry.per_channel is None
                                      else entry.per_channel)
            for name, entry in entries.items()}


def _refuse_unknown_fields(data, where: str) -> None:
    """A converted norm of this format version holds only :class:`NormEntry`'s fields: another key is a typo or
    tampering, which :func:`from_dict` (kept lenient: it is the checkpoint's remote code too) leaves out silently."""
    names = {spec.name for spec in dataclasses.fields(NormEntry)}
    unknown = sorted(map(str, set(data) - names)) if isinstance(data, dict) else []
    if unknown:
        raise ValidationError(f"config.json {where}.{unknown[0]}: not a field of a converted norm "
                              f"({', '.join(sorted(names))}); the checkpoint is damaged or was tampered with")


@dataclass
class OriginalArchitecture:
    """The architecture a converted checkpoint rebuilds: transformers class names, each checked on load
    (``config_checks.check_base``)."""

    architecture: str
    config_class: str
    model_type: str


@dataclass
class ConversionRecord:
    """What a conversion made (``method``, the ``converted`` norms, the settings of ``convert`` and
    ``calibration``) and what was added to it later (the parts of :data:`PARTS`); a saved checkpoint adds the
    original architecture (``base``), the saving ``package`` and the original's Hub id (``base_model``)."""

    method: str
    converted: dict[str, NormEntry]
    per_channel: bool = False
    calibration: dict | None = field(default=None, metadata={"written": True})
    convert: dict | None = field(default=None, metadata={"written": True})
    version: str = __version__  # the package version that converted
    format_version: int = FORMAT_VERSION
    base: OriginalArchitecture | None = None
    package: dict | None = None
    base_model: str | None = None
    evaluation: dict | None = None
    budget: dict | None = None
    training: dict | None = None
    folded: dict | None = None
    check: dict | None = None  # the check after the conversion (evaluation.conversion_check)
    # a Trainer checkpoint saved while the norms were still blended with the original's (training.progressive)
    hand_over: dict | None = None
    stock: dict | None = None  # a stock export (stock_export.py): the norms' epsilon and its config keys

    # --------------------------------------------------------------------------------------------- reading

    @classmethod
    def from_dict(cls, block) -> "ConversionRecord":
        """The record a ``normswap`` block holds; its format version is checked before anything else is read."""
        if not isinstance(block, dict):
            raise ValidationError(f"config.json {KEY}: expected an object, got {reprlib.repr(block)}")
        version = block.get("format_version", 1)  # blocks written before the version was recorded
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValidationError(f"config.json {KEY}.format_version: {reprlib.repr(version)} is not a format "
                                  "version")
        if version > FORMAT_VERSION:
            raise ValidationError(f"config.json {KEY}: format version {version} is newer than this hf-normswap "
                                  f"{__version__} reads (up to {FORMAT_VERSION}); upgrade hf-normswap")
        converted = block.get("converted")
        for name, entry in (converted.items() if isinstance(converted, dict) else ()):
            _refuse_unknown_fields(entry, f"{KEY}.converted.{name}")
        try:
            record = from_dict(cls, block, KEY)
        except ValueError as error:
            raise ValidationError(str(error)) from None
        return dataclasses.replace(record, format_version=FORMAT_VERSION)

    def norms(self) -> dict[str, NormEntry]:
        """Each converted norm with its method and per-channel flag (the block's where the entry has none)."""
        return norm_entries(self.to_dict())

    @classmethod
    def of(cls, model) -> "ConversionRecord | None":
        """The record of a converted model (in memory) or of its config, or None when the model was not converted."""
        block = getattr(getattr(model, "config", model), KEY, None)
        return cls.from_dict(block) if isinstance(block, dict) else None

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ConversionRecord":
        """The record of a checkpoint directory, its format version checked (its values: ``config_checks``)."""
        config = converted_config(path)
        if config is None:
            raise ValidationError(f"{path} is not a checkpoint saved by hf_normswap (no config.json with a "
                                  f"{KEY} block)")
        return cls.in_config(config)

    @classmethod
    def in_config(cls, config: dict) -> "ConversionRecord":
        """The record a ``config.json`` mapping holds (the card renders a saved one)."""
        return cls.from_dict(config[KEY])

    # --------------------------------------------------------------------------------------------- writing

    def to_dict(self) -> dict:
        """The block as ``config.json`` holds it; parts never given are left out."""
        return to_dict(self)

    def attach(self, model) -> None:
        """Make this the record of ``model`` (its ``config.normswap``)."""
        setattr(model.config, KEY, self.to_dict())

    def store(self, config: dict) -> dict:
        """Put this record into a ``config.json`` mapping (a save's last step); returns the mapping."""
        config[KEY] = json.loads(json.dumps(self.to_dict()))  # a copy, and proof that it is JSON
        return config

    @classmethod
    def amend(cls, model, **parts) -> "ConversionRecord | None":
        """Add later stages' parts (:data:`PARTS`: ``evaluation=``, ``budget=``, ``training=``, ``folded=``,
        ``check=``, ``hand_over=``; None removes one) to the record of ``model``; a model that was not converted is
        left as it is (None)."""
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise TypeError(f"a conversion record has no part {', '.join(sorted(unknown))}; parts: {', '.join(PARTS)}")
        record = cls.of(model)
        if record is None:
            return None
        if "folded" in parts:  # folding again adds to what was folded before
            parts["folded"] = {**(record.folded or {}), **parts["folded"]}
        record = dataclasses.replace(record, **parts)
        record.attach(model)
        return record


def converted_config(path: str | os.PathLike) -> dict | None:
    """config.json of a checkpoint directory saved by hf_normswap, or None when it is not one (the block is checked
    by ``config_checks.check_block``, on load)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and KEY in config else None
