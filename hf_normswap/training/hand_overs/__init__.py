"""The hand-overs from the original's norms to the converted modules during training, one class a file
(:class:`~.base.HandOver`): ``hand_over.kind`` names one (the built-in ones also by their own keys,
``progressive.enabled`` and ``taper.fraction``), and :func:`chosen` is the one rule that a run has at most one. A new
kind is one file in this folder whose class is decorated with :func:`~.base.register`; it is found here.
:func:`check_hand_over` checks the run's against the norms and the run as soon as they are known, before
calibration: a sensitivity map that does not rank every converted norm, or a schedule that would end after the run,
is one line there instead of a traceback (or a model saved half handed over) after the slow work."""

from __future__ import annotations

import importlib
import pkgutil

from ...checkpoint.record import ConversionRecord
from ...surgery import DEFAULT_ROLES, ConversionError, plan
from ...validation import ValidationError, first_line
from .blend import HandOverError, check_fits, end_step
from .base import KINDS, NONE, HandOver, register

BUILT_IN = ("progressive", "taper")

# imported by name, not at the top: the built-in kinds first, then every other file of the folder, so a kind added
# as a file registers itself with nothing else edited
for _name in (*BUILT_IN, *sorted(m.name for m in pkgutil.iter_modules(__path__))):
    if _name not in ("base", "blend"):
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


def converted_roles(model, roles=DEFAULT_ROLES) -> dict[str, str] | None:
    """``{name: role}`` of the norms converted in ``model``, or that converting it will replace (the recipe
    converts the norms of ``roles`` that ``convert`` selects); None where they cannot be known here (a model built on
    the meta device, whose main process checks; a model without norms, which ``convert`` refuses itself)."""
    record = ConversionRecord.of(model)
    if record is not None:
        return {name: entry.role for name, entry in record.converted.items()}
    if any(p.is_meta for p in model.parameters()):
        return None
    try:
        _, selected, _ = plan(model, roles)
    except ConversionError:
        return None
    return {norm.name: norm.role for norm in selected}


def check_hand_over(hand_over: HandOver | None, model, steps: int, sentences: bool, roles=DEFAULT_ROLES) -> None:
    """Refuse, with a :class:`HandOverError` of one line, a run's ``hand_over`` (:func:`chosen`; None: none) whose
    order does not fit ``model``'s norms (the original, or the converted checkpoint), or whose schedule, fixed by its
    settings, ends after the run's ``steps`` (``RecoveryRun.steps``: where known before training,
    ``training.max_steps`` or ``train_tokens`` over a step's tokens; ``sentences``: ``train_tokens`` counts an
    encoder's sentences, known once read; the Trainer's own count is checked again when training starts,
    :class:`ProgressiveSwapCallback`; ``roles``: those the recipe converts)."""
    if hand_over is None or not (hand_over.in_order or hand_over.fits_before_training):
        return  # the taper's single stage fits any norms and any run
    roles = converted_roles(model, roles)
    if roles is None:
        return
    try:
        stages = hand_over.stages(roles, steps)
    except ValueError as error:
        raise HandOverError(f"progressive.order: {first_line(error)}") from None
    if hand_over.fits_before_training and steps > 0 and not sentences:
        check_fits(hand_over.key, end_step(stages), steps, hand_over.fix)


__all__ = ["KINDS", "NONE", "HandOver", "register", "chosen", "converted_roles", "check_hand_over"]
