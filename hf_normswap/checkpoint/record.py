"""The record of a conversion: the ``normswap`` block of a converted model's ``config.json``.

:class:`ConversionRecord` is the block's schema and its only writer and reader. ``convert`` makes one; whatever
adds to a converted model's story (the budget search, fold, an evaluation, the recovery recipe) hands its part to
:meth:`ConversionRecord.amend`; a save stores it with what a reload needs (:meth:`ConversionRecord.store`); a load
reads it back through :meth:`ConversionRecord.read`, which checks the format version first. In memory the block is
a plain dict on ``model.config`` (transformers serializes it with the config), written only from here.

Format versions: 1, the blocks written before the version was recorded (they read as 1 and load as before); 2,
the present one. A block of a later version is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..validation import ValidationError, shown
from ..version import __version__

KEY = "normswap"  # the config attribute and config.json key
FORMAT_VERSION = 2
PARTS = ("evaluation", "budget", "training", "folded", "check")  # what later stages add to a conversion's record


@dataclass
class ConversionRecord:
    """What a conversion made (``method``, the ``converted`` modules, the settings of ``convert`` and
    ``calibration``) and what was added to it later (the parts of :data:`PARTS`); a saved checkpoint adds the
    original architecture (``base``), the saving ``package`` and the original's Hub id (``base_model``)."""

    method: str
    converted: dict
    per_channel: bool = False
    calibration: dict | None = None
    convert: dict | None = None
    version: str = __version__  # the package version that converted
    format_version: int = FORMAT_VERSION
    base: dict | None = None
    package: dict | None = None
    base_model: str | None = None
    evaluation: dict | None = None
    budget: dict | None = None
    training: dict | None = None
    folded: dict | None = None
    check: dict | None = None  # the check after the conversion (evaluation.conversion_check)

    # --------------------------------------------------------------------------------------------- reading

    @classmethod
    def from_dict(cls, block) -> "ConversionRecord":
        """The record a ``normswap`` block holds; its format version is checked before anything else is read."""
        if not isinstance(block, dict):
            raise ValidationError(f"config.json {KEY}: expected an object, got {shown(block)}")
        version = block.get("format_version", 1)  # blocks written before the version was recorded
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValidationError(f"config.json {KEY}.format_version: {shown(version)} is not a format version")
        if version > FORMAT_VERSION:
            raise ValidationError(f"config.json {KEY}: format version {version} is newer than this hf-normswap "
                                  f"{__version__} reads (up to {FORMAT_VERSION}); upgrade hf-normswap")
        names = {f.name for f in dataclasses.fields(cls)}
        settings = {key: value for key, value in block.items() if key in names}
        if "method" not in settings or "converted" not in settings:
            raise ValidationError(f"config.json {KEY}: the block names no method or converted modules")
        return cls(**{**settings, "format_version": FORMAT_VERSION})

    @classmethod
    def of(cls, model) -> "ConversionRecord | None":
        """The record of a converted model (in memory), or None when the model was not converted."""
        block = getattr(getattr(model, "config", None), KEY, None)
        return cls.from_dict(block) if isinstance(block, dict) else None

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ConversionRecord":
        """The checked record of a checkpoint directory (format version, then structure: ``config_checks``)."""
        from .config_checks import check_block

        config = read_config(path)
        if config is None:
            raise ValidationError(f"{path} is not a checkpoint saved by hf_normswap (no config.json with a "
                                  f"{KEY} block)")
        record = cls.from_dict(config[KEY])
        check_block(record.to_dict())
        return record

    # --------------------------------------------------------------------------------------------- writing

    def to_dict(self) -> dict:
        """The block as ``config.json`` holds it; parts never given are left out."""
        out = dataclasses.asdict(self)
        return {key: value for key, value in out.items()
                if value is not None or key in ("calibration", "convert")}

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
        ``check=``) to the record of ``model``; a model that was not converted is left as it is (None)."""
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


def read_config(path: str | os.PathLike) -> dict | None:
    """config.json of a checkpoint directory saved by hf_normswap, or None when it is not one (the block is checked
    by :meth:`ConversionRecord.read`, on load)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and KEY in config else None
