"""The terms of the recovery's loss, one class a file (:class:`~.base.LossTerm`): what each needs from the
forwards, its value, its words on the model card and its line on the plot, and what it costs the memory plan.
A new term is one file in this folder whose class is decorated with :func:`~.base.register`; it is found here,
and its setting is ``distill.terms.KEY``."""

from __future__ import annotations

import importlib
import pkgutil

from .base import TERMS, LossTerm, Step, register

BUILT_IN = ("logits", "hidden_states", "embedding", "scale")  # in the order the loss has always summed them

# imported by name, not at the top: the built-in terms first in that order, then every other file of the folder,
# so a term added as a file registers itself with nothing else edited
for _name in (*BUILT_IN, *sorted(m.name for m in pkgutil.iter_modules(__path__))):
    if _name != "base":
        importlib.import_module(f"{__name__}.{_name}")


def plot_labels() -> dict[str, str]:
    """``{logged key: label}`` of every term, for the training curve."""
    return {key: label for term in TERMS.values() for key, label in term.logged.items()}


__all__ = ["TERMS", "LossTerm", "Step", "register", "plot_labels"]
