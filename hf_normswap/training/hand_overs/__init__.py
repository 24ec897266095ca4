"""The hand-overs from the original's norms to the converted modules during training, one class a file
(:class:`~.base.HandOver`): ``hand_over.kind`` names one (the built-in ones also by their own keys,
``progressive.enabled`` and ``taper.fraction``), and :func:`chosen` is the one rule that a run has at most one. A new
kind is one file in this folder whose class is decorated with :func:`~.base.register`; it is found here."""

from __future__ import annotations

import importlib
import pkgutil

from ...validation import ValidationError
from .base import KINDS, NONE, HandOver, register

BUILT_IN = ("progressive", "taper")

# imported by name, not at the top: the built-in kinds first, then every other file of the folder, so a kind added
# as a file registers itself with nothing else edited
for _name in (*BUILT_IN, *sorted(m.name for m in pkgutil.iter_modules(__path__))):
    if _name != "base":
        importlib.import_module(f"{__name__}.{_name}")


def chosen(kind: str, progressive, taper, options: dict, trainable: str) -> HandOver | None:
    """The run's hand-over: ``kind`` (``hand_over.kind``; ``none``: by the built-in kinds' own keys) or None.
    ValidationError, in one line naming the fix, for two at once, an unknown kind, a kind with LoRA, or settings
    that cannot work."""
    if kind != NONE and kind not in KINDS:
        raise ValidationError(f"hand_over.kind {kind!r} is unknown: choose {', '.join((NONE, *KINDS))}")
    asked = {}
    if kind != NONE:
        asked[kind] = KINDS[kind](progressive, taper, options)
        asked[kind].named = True
    for key, cls in KINDS.items():
        if cls.asked(progressive, taper):
            asked.setdefault(key, cls(progressive, taper, options))
    if len(asked) > 1:
        switches, offs = " and ".join(h.switch for h in asked.values()), " or ".join(h.off for h in asked.values())
        raise ValidationError(f"{switches} both hand the norms over: keep one, set {offs} (taper.schedule="
                              "progressive tapers in progressive.order)")
    if not asked:
        return None
    hand_over = next(iter(asked.values()))
    hand_over.switch_on()
    if trainable == "lora":
        raise ValidationError(f"{hand_over.title or hand_over.key} works with trainable: norms or all, not lora")
    problem = hand_over.check()
    if problem:
        raise ValidationError(problem)
    if hand_over.in_order:
        progressive.check_order()
    return hand_over


__all__ = ["KINDS", "NONE", "HandOver", "register", "chosen"]
