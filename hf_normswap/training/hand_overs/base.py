"""What every hand-over is: :class:`HandOver`, a way of moving the norms from the original's to the converted
modules during training, and the registry (:data:`KINDS`, :func:`register`) that ``hand_over.kind`` names."""

from __future__ import annotations

from collections.abc import Callable

from .blend import ProgressiveSwap, ProgressiveSwapCallback

KINDS: dict[str, type["HandOver"]] = {}  # by ``hand_over.kind``
NONE = "none"  # hand_over.kind: the converted modules from step 0


def register(kind: type["HandOver"]) -> type["HandOver"]:
    """Add a kind of hand-over (a class decorator)."""
    if kind.key in KINDS or kind.key == NONE:
        raise ValueError(f"a hand-over named {kind.key!r} is there already")
    KINDS[kind.key] = kind
    return kind


class HandOver:
    """A schedule of stages (objects with ``names``, ``mix(step)`` from 0 to 1 and ``done_at``) along which
    :class:`~.blend.ProgressiveSwap` blends each converted module with its original norm.
    A kind sets :attr:`key` and overrides :meth:`stages` and :meth:`describe`; its own settings are
    ``hand_over.options`` (the built-in kinds read the ``progressive`` and ``taper`` sections)."""

    key = ""  # hand_over.kind
    title = ""  # how messages name it ("the taper")
    in_order = False  # its stages follow progressive.order (a sensitivity map is read and checked before any load)
    fits_before_training = False  # its end is fixed by its settings: checked against the run before calibration
    fix = "set training.max_steps (or train_tokens) to at least that, or hand_over.options that end it sooner"

    def __init__(self, progressive, taper, options: dict | None = None):
        self.progressive, self.taper, self.options = progressive, taper, dict(options or {})

    own_switch = own_off = ""  # the built-in kinds' own keys that turn them on and off (progressive.enabled ...)
    named = False  # hand_over.kind names it (else its own key turned it on)

    @property
    def switch(self) -> str:
        """The setting that turned it on, for messages."""
        return self.own_switch if self.own_switch and not self.named else f"hand_over.kind={self.key}"

    @property
    def off(self) -> str:
        """The setting that turns it off, for messages."""
        return self.own_off if self.own_off and not self.named else f"hand_over.kind={NONE}"

    @classmethod
    def asked(cls, progressive, taper) -> bool:
        """Whether a key of the ``progressive`` or ``taper`` section turns it on (the built-in kinds' own keys)."""
        return False

    def switch_on(self) -> None:
        """Set its own key where ``hand_over.kind`` named it, so every reader of the section sees it on."""

    def check(self) -> str | None:
        """Why its settings cannot work, in one line naming the fix (None: they can); read before any load."""
        return f"hand_over.options: {self.key} takes none, got {', '.join(self.options)}" if self.options else None

    def stages(self, roles: dict[str, str], steps: int) -> list:
        """The stages for the norms in ``roles`` (``{name: role}``) over a run of ``steps`` steps (where known:
        an epoch-based run's count is the Trainer's, when training starts). ValueError: an order that does not fit
        them."""
        raise NotImplementedError

    def callback(self, swap: ProgressiveSwap, roles: dict[str, str], log: Callable) -> ProgressiveSwapCallback:
        """The Trainer callback that moves ``swap`` along the stages and tells whether the run reached their end."""
        callback = ProgressiveSwapCallback(swap, self.describe)
        callback.name, callback.fix = self.key, self.fix  # in its messages and in a checkpoint's record
        return callback

    def started(self, stages: list) -> str | None:
        """The line logged when the swap is built (None: its callback logs its own when training starts)."""
        return None

    def describe(self, callback: ProgressiveSwapCallback) -> str:
        """The hand-over in a sentence, for the model card, after training (``callback``: its own)."""
        raise NotImplementedError
