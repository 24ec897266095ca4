"""Where a model lives and in which precision: the ``--device`` / ``--dtype`` names, checked before any model
loads."""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    """``cuda`` where this machine has one, else ``cpu``: where ``normswap`` puts a model unless told."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, what: str = "device", fix: str = "pass --device cpu") -> torch.device:
    """``device`` as a ``torch.device`` this machine has, or ``ValueError`` naming ``what`` and the fix: an
    unknown name, a kind of device the machine lacks, an index past its last device."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {device!r} is not a torch device: name one such as cpu, cuda or cuda:1") from None
    kind = resolved.type
    if kind == "cpu" and resolved.index not in (None, 0):  # torch takes any index and runs on the one CPU device
        raise ValueError(f"{what} {device!r}: the CPU is one device, cpu (or cpu:0)")
    backend = getattr(torch, kind, None)
    if kind != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise ValueError(f"{what} {device!r}: this machine has no {kind} device; {fix}")
    count = backend.device_count() if kind != "cpu" and hasattr(backend, "device_count") else None
    if count is not None and resolved.index is not None and resolved.index >= count:
        raise ValueError(f"{what} {device!r}: this machine has {count} {kind} device(s), "
                         f"{kind}:0 to {kind}:{count - 1}")
    return resolved

