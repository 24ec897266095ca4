"""A model that cannot be saved where it was asked to go (a full disk, a folder gone) is saved into a temporary
directory instead, which the error names: hours of conversion or training are never lost to a failed write."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..validation import first_line
from .directory import CheckpointError


def keep(save, name: str) -> Path:
    """Save with ``save(directory)`` into a fresh temporary directory (its ``name`` subfolder) and return the path;
    when even that fails, CheckpointError and nothing left behind."""
    folder = Path(tempfile.mkdtemp(prefix="normswap-"))
    try:
        return save(folder / name)
    except (OSError, CheckpointError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(f"cannot save the model, not even to a temporary directory ({first_line(error)}); "
                              "free disk space and run again") from None
