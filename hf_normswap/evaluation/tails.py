"""The tails of the per-token loss: where a mean hides catastrophes.

A converted model can keep a good mean while a few inputs blow up (a LayerNorm-free GPT-2 XL has been reported at a
mean loss of 130 nats with a median of 1.09). So, for both models on the same tokens (``token_losses.py``): the
median, 90th, 99th and 99.9th percentiles and the maximum of the per-token loss, the same of the per-token
difference (converted - original), and the spans of text where the converted model is worst against the original,
with a snippet of each and what sets it apart: positions past the length the model was fitted on, or text that
repeats what came before in its window (which the original predicts by copying).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .metrics import number
from .perplexity import REFERENCE
from .token_losses import TokenLosses

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9))
SPAN = 128  # tokens a worst window averages over
WORST = 5  # windows listed
MARGIN = 2.0  # nats/token: a window worse than the original's by more is named
SNIPPET = 80  # characters of a window's text shown
REPEATED = 0.25  # share of a window's tokens that end a run of NGRAM tokens seen earlier in it: repeated text
NGRAM = 4  # 2 would flag ordinary text (", the", "of the" recur a few hundred tokens in); 4 recurs in repeats


def distribution(values: np.ndarray) -> dict:
    """Mean, the percentiles of ``PERCENTILES`` (numpy's linear interpolation) and the maximum."""
    found = {"mean": float(values.mean())}
    found.update({key: float(np.percentile(values, q)) for key, q in PERCENTILES})
    found["max"] = float(values.max())
    return found


@dataclass
class WorstWindow:
    """A span of ``tokens`` tokens starting at token ``start`` of the stream: each model's mean loss there."""

    start: int
    tokens: int
    original: float
    converted: float
    difference: float
    text: str
    reason: str  # what sets it apart (:func:`window_reason`)


@dataclass
class Tails:
    """Loss distributions of both models and of their difference; the worst windows."""

    original: dict
    converted: dict
    difference: dict
    worst: list[WorstWindow]
    span: int
    over_margin: int  # windows worse than the original's by more than MARGIN nats/token

    def table(self) -> str:
        keys = ["mean", *(key for key, _ in PERCENTILES), "max"]
        lines = ["| per-token loss, nats | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        for label, values in ((REFERENCE, self.original), ("converted", self.converted),
                              ("converted - original", self.difference)):
            lines.append(f"| {label} | " + " | ".join(number(values[key]) for key in keys) + " |")
        lines += ["", f"worst {self.span}-token windows (mean nats/token; {self.over_margin} worse than the "
                      f"original's by more than {MARGIN:g}):",
                  "| token | original | converted | difference | text | why |", "|---|---|---|---|---|---|"]
        for w in self.worst:
            flag = " **over**" if w.difference > MARGIN else ""
            lines.append(f"| {w.start} | {number(w.original)} | {number(w.converted)} | {number(w.difference)}{flag} | "
                         f"{w.text} | {w.reason} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"original": self.original, "converted": self.converted, "difference": self.difference,
                "window": self.span, "margin": MARGIN, "windows_over_margin": self.over_margin,
                "worst_windows": [asdict(w) for w in self.worst]}


def _snippet(tokenizer, ids) -> str:
    text = " ".join(tokenizer.decode(ids).split())
    text = text[:SNIPPET] + ("..." if len(text) > SNIPPET else "")
    return text.replace("|", "\\|")  # a Markdown table cell


def repeated_share(losses: TokenLosses, start: int, end: int, ngram: int = NGRAM) -> float:
    """The share of the predictions ``start:end`` of the stream whose target ends a run of ``ngram`` predicted
    tokens already seen earlier in the same window: repeated text, which a model with working copying heads
    predicts."""
    first = start - int(losses.positions[start])  # the window's first prediction: runs from there on count as seen
    positions, targets = losses.positions[first:end].tolist(), losses.targets[first:end].tolist()
    seen, window, repeated = set(), 0, 0
    for i, position in enumerate(positions):
        if position == 0:
            seen, window = set(), i
        if i - window < ngram - 1:
            continue
        run = tuple(targets[i - ngram + 1:i + 1])
        if i >= start - first and run in seen:
            repeated += 1
        seen.add(run)
    return repeated / max(1, end - start)


def window_reason(losses: TokenLosses, start: int, end: int, fitted_length: int | None) -> str:
    """What sets the predictions ``start:end`` apart: positions past ``fitted_length`` (the tokens a sequence held
    when the model was trained or calibrated; None: not known), and repeated text (:func:`repeated_share`)."""
    where = losses.positions[start:end]
    first, last = int(where.min()), int(where.max())
    reasons = []
    if fitted_length is not None and first >= fitted_length:
        reasons.append(f"positions {first}-{last}, past the {fitted_length} tokens it was fitted on")
    share = repeated_share(losses, start, end)
    if share >= REPEATED:
        reasons.append(f"repeated text ({share:.0%} of its tokens end a run of {NGRAM} seen earlier in the window)")
    if reasons:
        return "; ".join(reasons)
    within = f", within the {fitted_length} tokens it was fitted on" if fitted_length is not None else ""
    return f"positions {first}-{last}{within}; {share:.0%} repeated"


def tails(losses: TokenLosses, tokenizer, converted: str = "converted", span: int = SPAN,
          worst: int = WORST, fitted_length: int | None = None) -> Tails:
    """The tails of ``converted`` against the reference (``REFERENCE``) on the same tokens; ``fitted_length``: the
    tokens a sequence held when ``converted`` was trained or calibrated (None: not known), for the worst windows'
    reasons."""
    original = losses.losses[REFERENCE].numpy()
    model = losses.losses[converted].numpy()
    difference = model - original
    starts = range(0, len(original), span)
    means = [(s, original[s:s + span].mean(), model[s:s + span].mean()) for s in starts]
    means.sort(key=lambda m: m[1] - m[2])  # largest difference first
    windows = [WorstWindow(int(s), min(span, len(original) - s), float(o), float(c), float(c - o),
                           _snippet(tokenizer, losses.targets[s:s + span].tolist()),
                           window_reason(losses, s, min(s + span, len(original)), fitted_length))
               for s, o, c in means[:worst]]
    over = sum(1 for _, o, c in means if c - o > MARGIN)
    return Tails(distribution(original), distribution(model), distribution(difference), windows, span, over)
