"""The progressive hand-over (``progressive.enabled``, or ``hand_over.kind: progressive``): the norms converted a
few at a time, a stage every ``progressive.every`` steps. Removing all norms at once moves every layer's input at the
same time; removing them one group at a time lets the rest of the network adapt to each change (the schedule of the
LayerNorm-removal work on GPT-2, Heimersheim 2024). Each stage ramps its norms' mix over ``progressive.ramp`` steps
(the blend: :mod:`.blend`)."""

from __future__ import annotations

from ...discovery.roles import layer_of
from ...evaluation.norm_sensitivity import load_order
from .base import HandOver, register
from .blend import ProgressiveSwapCallback, Stage, end_step

ORDERS = ("depth", "role", "reverse_depth")


def _depth(name: str) -> int:
    layer = layer_of(name)
    return 10 ** 6 if layer is None else layer  # outside the blocks (final norm): last


def schedule(roles: dict[str, str], *, start: int = 0, every: int = 10, ramp: int | None = None,
             order: str = "depth", role_order: list[str] | None = None, group: int = 1) -> list[Stage]:
    """Stages for the norms in ``roles`` (``{name: role}``, e.g. from ``model.config.normswap["converted"]``).

    ``order="depth"``: block by block from the input (``group`` blocks per stage; norms outside the blocks last);
    ``"reverse_depth"``: from the output; ``"role"``: one stage per role in ``role_order`` (default: the roles
    as they first appear), each all depths at once; a path to a ``.json`` sensitivity map (``normswap
    sensitivity --json``): least damage first, ``group`` norms per stage. A new stage starts every ``every`` steps from ``start``;
    each stage's mix ramps over ``ramp`` steps (default ``every``).
    """
    if order not in ORDERS and not str(order).endswith(".json"):
        raise ValueError(f"progressive order must be one of {ORDERS} or a sensitivity map .json file, got {order!r}")
    ramp = every if ramp is None else ramp
    names = list(roles)
    if str(order).endswith(".json"):
        buckets = _sensitivity_buckets(order, names, max(1, group))
    elif order == "role":
        ordering = role_order or list(dict.fromkeys(roles.values()))
        unknown = set(roles.values()) - set(ordering)
        ordering = list(ordering) + sorted(unknown)
        buckets = [[n for n in names if roles[n] == role] for role in ordering]
    else:
        depths = sorted({_depth(n) for n in names}, reverse=order == "reverse_depth")
        chunks = [depths[i:i + max(1, group)] for i in range(0, len(depths), max(1, group))]
        buckets = [[n for n in names if _depth(n) in chunk] for chunk in chunks]
    buckets = [b for b in buckets if b]
    return [Stage(start + i * every, ramp, b) for i, b in enumerate(buckets)]


def _sensitivity_buckets(path: str, names: list[str], group: int) -> list[list[str]]:
    """``names`` in the order of a sensitivity map (least damage first), ``group`` a stage; the map may list norms
    that were not converted (a budgeted conversion keeps some), but must rank every converted one."""
    converted = set(names)
    ranked = [n for n in load_order(path) if n in converted]
    missing = sorted(set(names) - set(ranked))
    if missing:
        raise ValueError(f"{path} does not rank {len(missing)} converted norm(s), e.g. {missing[0]}: measure the map "
                         "on the same model and norm selection")
    return [ranked[i:i + group] for i in range(0, len(ranked), group)]


@register
class Progressive(HandOver):
    key = "progressive"
    title = "progressive conversion"
    in_order = fits_before_training = True
    own_switch = "progressive.enabled"
    own_off = "progressive.enabled=false"
    fix = ProgressiveSwapCallback.fix

    @classmethod
    def asked(cls, progressive, taper) -> bool:
        return bool(progressive.enabled)

    def switch_on(self) -> None:
        self.progressive.enabled = True

    def check(self) -> str | None:
        return super().check()  # its settings are the progressive section's (its order: progressive.check_order)

    def stages(self, roles: dict[str, str], steps: int) -> list:
        p = self.progressive
        return schedule(roles, start=p.start, every=p.every, ramp=p.ramp, order=p.order, role_order=p.role_order,
                        group=p.group)

    def callback(self, swap, roles: dict[str, str], log) -> ProgressiveSwapCallback:
        return ProgressiveSwapCallback(swap, self.describe)

    def started(self, stages: list) -> str:
        p = self.progressive
        return (f"progressive: {len(stages)} stages by {p.order}, every {p.every} steps, all converted from step "
                f"{end_step(stages)}")

    def describe(self, callback) -> str:
        return ("The norms were handed over from the original to the converted modules progressively "
                f"({self.progressive.order} order).")
