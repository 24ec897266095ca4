"""Checks on values that come from outside the package (the command line, the API, settings files), and the
one-line form every refusal takes: a :class:`ValidationError` that names the key or option and the fix.

A checkpoint's ``config.json`` is checked in ``checkpoint/config_checks.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from numbers import Real
from pathlib import Path



class ValidationError(ValueError):
    """A value from a file, the command line or the API is not allowed; the message names the key and the fix."""


def shown(value, limit: int = 60) -> str:
    """``repr`` of a value on one line, shortened: untrusted text must not break the one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, for one-line user errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ------------------------------------------------------------------------------------------ numeric options

# Input RMS of real models runs from about 0.1 to a few thousand; inside this range alpha and beta stay far from
# the clamps of modules.py in fp32, outside it the analytic initialization over- or underflows.
INPUT_SCALE_RANGE = (1e-6, 1e6)


def check_number(value, name: str, minimum: float | None = None, maximum: float | None = None):
    """``value`` unless it is not a finite number within [minimum, maximum]; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {shown(value)}")
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


def _holds_text(file: Path, chunk: int = 1 << 20) -> bool:
    """Whether ``file`` has a byte other than whitespace (read until the first one: at once for real text)."""
    with open(file, "rb") as handle:
        while block := handle.read(chunk):
            if block.strip():
                return True
    return False


def check_output_folder(path, flag: str) -> None:
    """A folder the command fills as it works (``--plots``): a directory, or one that can be made; the probe removes
    what it made, so a command refused later leaves nothing."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValidationError(f"{flag} {path} is a file; give a directory")
        return
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True)
    except OSError as error:
        raise ValidationError(f"{flag} {path}: cannot create it ({error.strerror}); pick a folder you can write") from None
    for folder in made:
        folder.rmdir()


def check_data_files(paths, flag: str) -> None:
    """Local data files (as ``data.local_paths`` returns them) that hold text: an empty or blank file scores
    nothing, and would fail only after the conversion."""
    files = [f for p in paths or () for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]
    if paths and not any(_holds_text(f) for f in files):
        raise ValidationError(f"{flag} {', '.join(map(str, paths))}: no text (the files are empty or blank)")


# ------------------------------------------------------------------------------------------- typed settings


def _matches(value, hint) -> bool:
    """``value`` is of the annotated type ``hint`` (the forms settings use: plain classes, ``X | None``, ``Literal``,
    ``list[X]`` / ``tuple[X, ...]``, ``dict`` and ``Any``); an int stands for a float."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, Real) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


def check_known(key, known, prefix: str = "") -> None:
    """An unknown setting is refused with the nearest known one suggested, so a typo cannot be ignored silently."""
    if key not in known:
        close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
        hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(map(str, known)))}"
        raise ValidationError(f"unknown setting {prefix}{key}: {hint}")


def settings_from_mapping(cls, settings: dict, prefix: str = "", start=None):
    """A ``cls`` dataclass from a mapping such as a YAML section: every key must be a field (an unknown one is refused
    with the nearest field suggested), every value of its field's annotated type, and nested dataclass fields are
    read the same way from nested mappings. ``start``: the instance whose values the mapping updates (default: the
    class's defaults). ``__post_init__`` then checks ranges; its ValueError becomes a ValidationError."""
    if not isinstance(settings, dict):
        raise ValidationError(f"setting {prefix.rstrip('.') or 'config'} must be a mapping, got {shown(settings)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        check_known(key, known, prefix)
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            nested_start = getattr(start, key) if start is not None else known[key].default_factory()
            value = settings_from_mapping(hint, value, name + ".", start=nested_start)
        elif not _matches(value, hint):
            raise ValidationError(f"setting {name} must be {_type_name(hint)}, got {shown(value)}")
        values[key] = value
    try:
        return dataclasses.replace(start, **values) if start is not None else cls(**values)
    except ValidationError:
        raise
    except ValueError as error:
        raise ValidationError(f"{prefix}{error}" if prefix else str(error)) from None
