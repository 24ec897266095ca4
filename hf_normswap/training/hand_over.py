"""The run's hand-over from the original's norms to the converted modules (``progressive.enabled``, or the taper),
its stages built from the settings, and checked as soon as the norms are known, before calibration: a sensitivity
map that does not rank every converted norm, or a progressive schedule that would end after the run, is one line
there instead of a traceback (or a model saved half handed over) after the slow work."""

from __future__ import annotations

from ..checkpoint.record import ConversionRecord
from ..surgery import ConversionError, plan
from ..model_inputs import ends_in_hidden_states
from ..validation import first_line
from .progressive import HandOverError, ProgressiveSwapCallback, check_fits, end_step, schedule
from .recipe_settings import fail
from .taper import taper_stages, taper_steps


def hand_over_stages(progressive, taper, roles: dict[str, str], steps: int) -> list:
    """The stages for the norms in ``roles`` (``{name: role}``): the taper's over its ``steps``, else the
    ``progressive`` settings' schedule. ValueError for a sensitivity map that does not rank every norm."""
    if taper.fraction:
        return taper_stages(roles, steps, taper.schedule, order=progressive.order,
                            role_order=progressive.role_order, group=progressive.group)
    return schedule(roles, start=progressive.start, every=progressive.every, ramp=progressive.ramp,
                    order=progressive.order, role_order=progressive.role_order, group=progressive.group)


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


def check_hand_over(progressive, taper, steps: int, train_tokens: int | None, model) -> None:
    """Build the hand-over of the ``progressive`` and ``taper`` settings for ``model``'s norms (the original, or the
    converted checkpoint) and refuse, in one line, an order that does not fit them or a progressive schedule longer
    than the run's ``steps`` (``RecoveryRun.steps``: where known before training, ``training.max_steps`` or
    ``train_tokens`` over a step's tokens; the Trainer's own count is checked again when training starts,
    :class:`ProgressiveSwapCallback`)."""
    if not (progressive.enabled or taper.fraction and taper.schedule == "progressive"):
        return  # the taper's single stage fits any norms and any run
    roles = converted_roles(model)
    if roles is None:
        return
    try:
        stages = hand_over_stages(progressive, taper, roles, taper_steps(taper.fraction, max(steps, 1)))
    except ValueError as error:
        fail(f"progressive.order: {first_line(error)}")
    counted = steps > 0 and not (train_tokens is not None and ends_in_hidden_states(model))
    if progressive.enabled and counted:  # an encoder's train_tokens counts sentences, known once they are read
        try:
            check_fits(ProgressiveSwapCallback.name, end_step(stages), steps, ProgressiveSwapCallback.fix)
        except HandOverError as error:
            fail(str(error))
