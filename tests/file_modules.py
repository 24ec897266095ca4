"""Scripts and recipes are files, not modules of the package: tests import them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_file(relative_path: str):
    """The module defined by ``ROOT / relative_path``, freshly executed, its folder on ``sys.path`` as when Python
    runs it (an analysis imports ``paper_draw`` beside it)."""
    path = ROOT / relative_path
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
