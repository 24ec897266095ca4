"""The figures of the side-by-side evaluation table, one file each.

A metric is one class in a module of this folder, a subclass of one of the kinds of ``base.py`` decorated with
:func:`register`. Every module here is imported with this package, so a new metric is one new file: the table,
``--json``, the model card and the recipe's summary (``perplexity.py``, ``embeddings.py``) take their rows from
:func:`registered`.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    AgreementMetric, EmbeddingMetric, Metric, ModelMetric, Perplexity, ScoredPositions, Similarities, exp_or_inf,
    number, register, registered,
)

__all__ = ["AgreementMetric", "EmbeddingMetric", "Metric", "ModelMetric", "Perplexity", "ScoredPositions",
           "Similarities", "exp_or_inf", "number", "register", "registered"]

# Imported by name found, not listed: the folder is the list, so adding a metric touches no other file.
for _found in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_found.name}")
