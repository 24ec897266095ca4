"""The fit-for-use report: everything a user deciding whether a converted model can replace its original reads,
side by side with the original on the same text and examples: the perplexity table (``perplexity.py``), the tails of
the per-token loss (``tails.py``), the ratio by position up to the window (``positions.py``), the repetition check
(``repetition.py``) and, when asked, downstream tasks (``tasks.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .perplexity import REFERENCE, Evaluation, EvaluationError, _prefix_token
from .positions import Positions, positions
from .repetition import Repetition, repetition
from .tails import Tails, tails
from .tasks import TaskComparison
from .token_losses import token_losses, token_stream


@dataclass
class FitReport:
    """The parts of the report that were measured (None: not asked for, or not applicable)."""

    evaluation: Evaluation
    tails: Tails | None = None
    positions: Positions | None = None
    repetition: Repetition | None = None
    tasks: TaskComparison | None = None

    def describe(self) -> str:
        return self.evaluation.describe()

    def table(self) -> str:
        parts = [self.evaluation.table()]
        if self.tails is not None:
            parts.append(self.tails.table())
        if self.positions is not None:
            parts.append(self.positions.table())
        if self.repetition is not None:
            parts.append(self.repetition.line())
        if self.tasks is not None:
            parts.append(self.tasks.table())
        return "\n\n".join(parts)

    def to_dict(self) -> dict:
        found = self.evaluation.to_dict()
        for key in ("tails", "positions", "repetition", "tasks"):
            part = getattr(self, key)
            found[key] = None if part is None else part.to_dict()
        return found


def context_report(models: dict[str, nn.Module], tokenizer, texts: list[str], *, max_length: int,
                   max_tokens: int | None = None, batch_size: int = 1,
                   converted: str = "converted") -> tuple[Tails, Positions, Repetition | None]:
    """The tails, the ratio by position and the repetition check of ``converted`` against the reference, on the
    texts read as one stream in windows of ``max_length``."""
    pair = {REFERENCE: models[REFERENCE], converted: models[converted]}
    stream = token_stream(tokenizer, texts, _prefix_token(pair[REFERENCE], tokenizer), max_tokens)
    if len(stream) < 2:
        raise EvaluationError("the evaluation text gives no tokens to score")
    losses = token_losses(pair, stream, max_length, batch_size)
    return (tails(losses, tokenizer, converted), positions(losses, converted),
            repetition(pair, stream, max_length, converted))
