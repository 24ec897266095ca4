"""The ratio by position: whether a converted model holds beyond the length it was trained on.

Without a norm nothing bounds the residual stream's growth with position, and a recovery trains on short blocks
while the model's context is far longer. The per-token losses of ``token_losses.py`` are grouped by position in
their window (0-64, 64-128, 128-256, ... doubling up to the window), and each range gets both models' perplexity,
their ratio, and that ratio over the ratio inside the first ``REFERENCE_LENGTH`` positions (``relative``: a model
that holds stays near 1; above ``MAX_RELATIVE`` the range is marked). A range where the original's own perplexity
rises past ``MAX_RELATIVE`` times its first positions' is marked as the original failing there (a context beyond
what it was trained on), not blamed on the conversion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .metrics import exp_or_inf, number
from .perplexity import REFERENCE
from .token_losses import TokenLosses

FIRST_EDGE = 64  # ranges double from here: 0-64, 64-128, 128-256, ...
REFERENCE_LENGTH = 512  # positions the later ranges are compared with (the recipe's training length)
MAX_RELATIVE = 1.2


def range_edges(max_length: int) -> list[int]:
    """0, 64, 128, 256, ... below ``max_length``, then ``max_length``."""
    edges, edge = [0], FIRST_EDGE
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    return edges + [max_length]


@dataclass
class PositionRange:
    """Both models' perplexity on the tokens predicted at positions ``start`` to ``end`` of their window."""

    start: int
    end: int
    tokens: int
    original: float
    converted: float
    ratio: float
    relative: float  # ratio / the ratio inside the first REFERENCE_LENGTH positions
    original_fails: bool  # the original's own perplexity here is above MAX_RELATIVE x its first positions'

    @property
    def marked(self) -> bool:
        return self.relative > MAX_RELATIVE and not self.original_fails


@dataclass
class Positions:
    """The ratio by position range over windows of ``max_length``; ``first`` is the range compared with."""

    ranges: list[PositionRange]
    max_length: int
    first: dict  # perplexities and ratio inside the first REFERENCE_LENGTH positions

    def table(self) -> str:
        lines = [f"| positions (window {self.max_length}) | tokens | {REFERENCE} | converted | ratio | "
                 f"ratio / first {self.first['end']} |", "|---|---|---|---|---|---|"]
        for r in self.ranges:
            note = (" (the original fails here too)" if r.original_fails
                    else f" **over {MAX_RELATIVE:g}**" if r.marked else "")
            lines.append(f"| {r.start}-{r.end} | {r.tokens} | {number(r.original)} | {number(r.converted)} | "
                         f"{number(r.ratio)} | {number(r.relative)}{note} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"max_length": self.max_length, "first": self.first, "max_relative": MAX_RELATIVE,
                "ranges": [dict(asdict(r), marked=r.marked) for r in self.ranges]}


def _perplexities(losses: TokenLosses, converted: str, where: torch.Tensor) -> tuple[float, float, int]:
    tokens = int(where.sum())
    original = exp_or_inf(float(losses.losses[REFERENCE][where].mean()))
    model = exp_or_inf(float(losses.losses[converted][where].mean()))
    return original, model, tokens


def positions(losses: TokenLosses, converted: str = "converted") -> Positions:
    """Both models' perplexity and their ratio on each position range of the windows."""
    first_end = min(REFERENCE_LENGTH, losses.max_length)
    base_original, base_model, base_tokens = _perplexities(losses, converted, losses.positions < first_end)
    base_ratio = base_model / base_original
    edges = range_edges(losses.max_length)
    ranges = []
    for start, end in zip(edges, edges[1:]):
        where = (losses.positions >= start) & (losses.positions < end)
        if not where.any():
            continue  # the text ends before this position
        original, model, tokens = _perplexities(losses, converted, where)
        ratio = model / original
        ranges.append(PositionRange(start, end, tokens, original, model, ratio, ratio / base_ratio,
                                    start >= first_end and original > MAX_RELATIVE * base_original))
    first = {"end": first_end, "tokens": base_tokens, "original": base_original, "converted": base_model,
             "ratio": base_ratio}
    return Positions(ranges, losses.max_length, first)
