"""One reader for settings: a YAML file, ``key=value`` overrides and the command line's flags are read into the
dataclasses that declare them (the recipe's ``RecipeConfig``, a conversion's ``ConversionJob``,
``CalibrationConfig``), by OmegaConf's structured configs. OmegaConf checks each value against its field's type (``lr.base=1e-3`` is a float, ``block_len=abc`` is
refused), merges the layers and builds the dataclass, whose ``__post_init__`` checks ranges.

What is checked here, before OmegaConf sees the values: the file's size and encoding, YAML anchors and aliases (an
alias bomb expands to gigabytes), interpolations in any value as read (``"\\x24{oc.env:HF_TOKEN}"`` would copy a
secret into the settings), lists too long to be settings, and (by OmegaConf's own YAML loader) a key given twice. Every refusal is one :class:`ValidationError` line naming the file, the override
or the setting, with the nearest known key suggested for an unknown one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from .validation import ValidationError, first_line, shown

MAX_SETTINGS_BYTES = 1 << 20  # a settings file is a page or two of text; anything larger is not one
MAX_ENTRIES = 1000  # a list or section of settings (train_data's sources, training's keys) is far shorter


def unknown_setting(key, known, prefix: str = "") -> ValidationError:
    """The refusal of an unknown key, with the nearest known one suggested, so a typo cannot be ignored silently."""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(map(str, known)))}"
    return ValidationError(f"unknown setting {prefix}{key}: {hint}")


@functools.cache
def _loader():
    """The YAML loader of settings (built on first use: omegaconf is imported only where settings are read)."""
    from omegaconf._yaml import get_yaml_loader  # lazy: omegaconf (~90 modules) loads only where settings are read

    class _Loader(get_yaml_loader(max_yaml_expanded_nodes=None)):
        """OmegaConf's own YAML loader: libyaml's parser (its nesting limit too), YAML 1.2 floats (``1e-3``, ``5E4``;
        YAML 1.1 reads them as strings), no timestamps, a key given twice refused. Kept by hand: aliases refused
        outright (settings never need one); so OmegaConf's expansion bound, which also counts plain nodes and
        refuses a long list in words about aliases, is off."""

        def construct_document(self, node):
            seen, repeated, stack = set(), [], [node]
            while stack:  # an alias is a node met twice in the composed document (a loop: nesting may be deep)
                current = stack.pop()
                if id(current) in seen:
                    repeated.append(current.start_mark.line + 1)
                    continue
                seen.add(id(current))
                if isinstance(current, yaml.SequenceNode):
                    stack.extend(current.value)
                elif isinstance(current, yaml.MappingNode):
                    stack.extend(n for pair in current.value for n in pair)
            if repeated:
                raise ValidationError(f"YAML anchors and aliases (&name, *name) are not read (line {min(repeated)}); "
                                      "write the value out")
            return super().construct_document(node)

    # kept by hand: OmegaConf's float pattern misses a signed float without a leading digit (-.5, +.5e-3)
    _Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"),
                                  list("-+"))
    return _Loader


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and its line (OmegaConf's duplicate key in the package's words)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if not problem or mark is None:
        return first_line(error)
    duplicate = re.fullmatch(r"found duplicate key (.*)", problem)
    if duplicate:
        return f"{shown(duplicate.group(1))} is given twice (line {mark.line + 1}); keep one"
    return f"{problem} (line {mark.line + 1})"


def check_values(layer, where: str) -> None:
    """Refuse ``${`` in any key or string of ``layer`` (OmegaConf would resolve ``${oc.env:HF_TOKEN}`` into the
    settings): on the values as read, so after YAML's own escapes (``"\\x24{...}"``), and never shown. And a list or
    mapping longer than any setting is (OmegaConf takes a minute over 100,000 entries)."""
    stack = [(layer, "")]
    while stack:  # a loop, not recursion: a value nested thousands deep is refused like any other
        value, key = stack.pop()
        if isinstance(value, (Mapping, list, tuple)) and len(value) > MAX_ENTRIES:
            raise ValidationError(f"{where}{': ' + key if key else ''}: {len(value):,} entries; a setting holds at "
                                  f"most {MAX_ENTRIES:,}")
        if isinstance(value, Mapping):
            stack.extend((v, f"{key}.{k}" if key else str(k)) for k, v in value.items())
            found = any("${" in str(k) for k in value)
        elif isinstance(value, (list, tuple)):
            stack.extend((v, key) for v in value)
            found = False
        else:
            found = isinstance(value, str) and "${" in value
        if found:
            raise ValidationError(f"{where}{': ' + key if key else ''}: interpolations (${{...}}) are not read; "
                                  "write the value out")


def _parse(text: str, where: str):
    try:
        loaded = yaml.load(text, Loader=_loader())  # noqa: S506 - OmegaConf's safe loader
    except ValidationError as error:
        raise ValidationError(f"{where}: {error}") from None
    except yaml.YAMLError as error:
        raise ValidationError(f"{where}: {_yaml_problem(error)}") from None
    except RecursionError:
        raise ValidationError(f"{where}: nested deeper than a settings file is; write it flat") from None
    check_values(loaded, where)
    return loaded


def read_yaml_file(path: str | Path, flag: str = "--config") -> dict:
    """The mapping of settings in a YAML file: bounded in size, UTF-8, without anchors, aliases or repeated keys."""
    where = f"{flag} {path}"
    try:
        size = Path(path).stat().st_size
        if size > MAX_SETTINGS_BYTES:
            raise ValidationError(f"{where}: {size:,} bytes is not a settings file (at most {MAX_SETTINGS_BYTES:,})")
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ValidationError(f"{where}: {error.strerror or first_line(error)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValidationError(f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start}); "
                              "save it as UTF-8") from None
    loaded = _parse(text, where)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValidationError(f"{where}: expected a mapping of settings, got a {type(loaded).__name__}")
    return loaded


def read_overrides(overrides: list[str]) -> dict:
    """``a.b=value`` overrides as a nested mapping (values read as YAML); a key given again takes its last value, as
    on any command line (a script's overrides, then the user's)."""
    out: dict = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("-")
        if not sep or not key:
            raise ValidationError(f"override {item!r} is not KEY=VALUE")
        *sections, last = key.split(".")
        section = out
        for part in sections:
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise ValidationError(f"override {item!r}: {part} is not a section")
        if isinstance(section.get(last), dict):
            raise ValidationError(f"override {item!r}: {last} is a section; set its keys ({key}.NAME=VALUE)")
        section[last] = _parse(value, f"override {item!r}") if value else ""
    return out


def _fields(schema, path: list[str]):
    """The field names of the dataclass reached from ``schema`` by ``path`` (None below a plain mapping)."""
    for part in path:
        hints = typing.get_type_hints(schema)
        schema = hints.get(part)
        schema = next((a for a in typing.get_args(schema) if dataclasses.is_dataclass(a)), schema)
        if not dataclasses.is_dataclass(schema):
            return None
    return [f.name for f in dataclasses.fields(schema) if f.init]


def _check_sections(schema, layer: Mapping, prefix: str = "") -> None:
    """A section (a dataclass field) is given as a mapping: OmegaConf's own message for a scalar names no key."""
    hints = typing.get_type_hints(schema)
    for key, value in layer.items():
        hint = next((a for a in (hints.get(key), *typing.get_args(hints.get(key))) if dataclasses.is_dataclass(a)),
                    None)
        if hint is None:
            continue
        if isinstance(value, Mapping):
            _check_sections(hint, value, f"{prefix}{key}.")
        elif value is not None:
            raise ValidationError(f"setting {prefix}{key} must be a section of settings, got {shown(value)}")


def _relabel(error: ValueError, labels: Mapping[str, str]) -> ValidationError:
    """A check's message in the user's words: a setting named by the flag that set it (``labels``)."""
    message = str(error)
    setting = getattr(error, "setting", None)
    if setting in labels:
        label = labels[setting]
        message = label + message[len(setting):] if message.startswith(setting) else f"{label}: {message}"
    return ValidationError(message)


# OmegaConf's words for a value of another type, and the project's
CONVERSION = re.compile(r"Value '.*' of type '\w+' could not be converted to (Integer|Float|Boolean)")
EXPECTED = {"Integer": "an integer (digits, e.g. 64)", "Float": "a number (e.g. 0.5)", "Boolean": "true or false"}


def _type_problem(message: str, value) -> str | None:
    """``VALUE is not an integer (digits, e.g. 64)`` for OmegaConf's ``Value '1000000000.0' of type 'float' could
    not be converted to Integer`` (YAML reads ``1e9`` as a float), naming the value as given; None for others."""
    found = CONVERSION.fullmatch(message)
    return f"{shown(value)} is not {EXPECTED[found.group(1)]}" if found else None


def _given(key: str, layers) -> object:
    """The value the last of ``layers`` that sets the dotted ``key`` gives it (None: none does)."""
    for layer in reversed(layers):
        value = layer
        for part in key.split("."):
            value = value.get(part, _given) if isinstance(value, Mapping) else _given
        if value is not _given:
            return value
    return None


def read_settings(schema: type, *layers: Mapping, labels: Mapping[str, str] | None = None,
                  check: Callable | None = None):
    """A ``schema`` dataclass: its defaults updated by each mapping of ``layers`` in turn (a YAML file's, the
    overrides', the flags'), every key known and every value of its field's type; ``check`` (e.g.
    ``CalibrationConfig.resolved``) runs on the result. ``labels`` names settings by the flag that set them."""
    # lazy: omegaconf (~90 modules) loads only where settings are read, not for `normswap --help` or `inspect`
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    labels = labels or {}
    try:
        config = OmegaConf.structured(schema)
        for layer in layers:
            for key, value in layer.items():
                check_values(value, labels.get(key, f"setting {key}"))  # flags too
            _check_sections(schema, layer)
            config = OmegaConf.merge(config, OmegaConf.create(dict(layer)))
        value = OmegaConf.to_object(config)
        if check is not None:
            check(value)
        return value
    except ConfigKeyError as error:
        path = str(error.full_key or error.key).split(".")
        known = _fields(schema, path[:-1]) or []
        raise unknown_setting(path[-1], known, ".".join(path[:-1]) + "." if len(path) > 1 else "") from None
    except OmegaConfBaseException as error:
        key = str(getattr(error, "full_key", None) or "")
        name = labels.get(key, f"setting {key}" if key else "settings")
        message = first_line(getattr(error, 'msg', None) or error)
        raise ValidationError(f"{name}: {_type_problem(message, _given(key, layers)) or message}") from None
    except ValueError as error:
        raise _relabel(error, labels) from None
