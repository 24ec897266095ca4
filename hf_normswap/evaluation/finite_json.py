"""Results as JSON that every parser reads: a score that is not finite (a diverged model's perplexity, the KL of
outputs that overflowed) is written as ``null``. Python's ``json`` writes it as ``Infinity`` or ``NaN``, which are
not JSON: ``jq``, JavaScript and most other readers refuse the whole file."""

from __future__ import annotations

import json
import math


def finite(value):
    """``value`` with every float that is not finite, at any depth, replaced by None (tuples become lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value, **options) -> str:
    """``json.dumps`` of :func:`finite` ``(value)``; ``allow_nan=False`` proves that nothing else slipped through."""
    return json.dumps(finite(value), allow_nan=False, **options)
