"""The run's hand-over from the original's norms to the converted modules (``hand_overs``: progressive, the taper
...), checked as soon as the norms are known, before calibration: a sensitivity map that does not rank every
converted norm, or a progressive schedule that would end after the run, is one line there instead of a traceback
(or a model saved half handed over) after the slow work."""

from __future__ import annotations

from ..checkpoint.record import ConversionRecord
from ..surgery import ConversionError, plan
from ..validation import first_line
from .hand_overs import HandOver
from .progressive import HandOverError, check_fits, end_step
from .recipe_settings import fail


def converted_roles(model) -> dict[str, str] | None:
    """``{name: role}`` of the norms converted in ``model``, or that converting it will replace (the recipe
    converts every norm ``convert`` selects by default); None where they cannot be known here (a model built on
    the meta device, whose main process checks; a model without norms, which ``convert`` refuses itself)."""
    record = ConversionRecord.of(model)
    if record is not None:
        return {name: entry.role for name, entry in record.converted.items()}
    if any(p.is_meta for p in model.parameters()):
        return None
    try:
        _, selected, _ = plan(model)
    except ConversionError:
        return None
    return {norm.name: norm.role for norm in selected}


def check_hand_over(hand_over: HandOver | None, model, steps: int, sentences: bool) -> None:
    """Refuse, in one line, a run's ``hand_over`` (``hand_overs.chosen``; None: none) whose order does not fit
    ``model``'s norms (the original, or the converted checkpoint), or whose schedule, fixed by its settings, ends
    after the run's ``steps`` (``RecoveryRun.steps``: where known before training, ``training.max_steps`` or
    ``train_tokens`` over a step's tokens; ``sentences``: ``train_tokens`` counts an encoder's sentences, known
    once read; the Trainer's own count is checked again when training starts, :class:`ProgressiveSwapCallback`)."""
    if hand_over is None or not (hand_over.in_order or hand_over.fits_before_training):
        return  # the taper's single stage fits any norms and any run
    roles = converted_roles(model)
    if roles is None:
        return
    try:
        stages = hand_over.stages(roles, steps)
    except ValueError as error:
        fail(f"progressive.order: {first_line(error)}")
    if hand_over.fits_before_training and steps > 0 and not sentences:
        try:
            check_fits(hand_over.key, end_step(stages), steps, hand_over.fix)
        except HandOverError as error:
            fail(str(error))
