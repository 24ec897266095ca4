"""A file that holds its old content or the new, never a part: the one way the package writes a file in place.

A kill or a full disk mid-write leaves the target as it was; the staging file beside it (``.NAME.partial-PID-HEX``)
is removed when the write fails and is never mistaken for the target.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_write(path: str | os.PathLike):
    """Yield a staging path beside ``path`` to write; when the block ends without error it replaces ``path`` in one
    rename, and whatever ends the block otherwise removes it."""
    path = Path(path)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield staging
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
