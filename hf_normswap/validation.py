"""Checks on values that come from outside the package (the command line, the API, settings files), and the
one-line form every refusal takes: a :class:`ValidationError` that names the key or option and the fix.

A checkpoint's ``config.json`` is checked in ``checkpoint/config_checks.py``.
"""

from __future__ import annotations

import math
import os
from numbers import Real
from pathlib import Path



class ValidationError(ValueError):
    """A value from a file, the command line or the API is not allowed; the message names the key and the fix.
    ``setting``: the field the message starts with, so a reader can name it as the user gave it (a flag)."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


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
        raise ValidationError(f"{name} must be a finite number, got {shown(value)}", name)
    if minimum is not None and value < minimum:
        raise ValidationError(f"{name} must be at least {minimum:g}, got {value:g}", name)
    if maximum is not None and value > maximum:
        raise ValidationError(f"{name} must be at most {maximum:g}, got {value:g}", name)
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


def check_path_length(path, what: str) -> None:
    """A path with a name longer than the file system takes (NAME_MAX, 255 bytes on Linux) or longer as a whole than
    PATH_MAX fails with ENAMETOOLONG wherever it is first touched, a traceback; refused here, naming ``what``."""
    text = os.fspath(Path(path).expanduser())
    try:
        name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows): its own limits
        name_max, path_max = 255, 4096
    longest = max(Path(text).parts or [""], key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        raise ValidationError(f"{what} {shown(text)}: a name in it is {len(os.fsencode(longest))} bytes long, the "
                              f"file system takes at most {name_max}")
    if len(os.fsencode(text)) >= path_max:
        raise ValidationError(f"{what} {shown(text)} is {len(os.fsencode(text))} bytes long, the file system takes "
                              f"paths below {path_max}")


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
