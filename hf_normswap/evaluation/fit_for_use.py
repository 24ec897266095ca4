"""The fit-for-use report: everything a user deciding whether a converted model can replace its original reads,
side by side with the original on the same text and examples: the perplexity table (``perplexity.py``), the tails of
the per-token loss (``tails.py``), the ratio by position up to the window (``positions.py``), the repetition check
(``repetition.py``) and, when asked, downstream tasks (``tasks.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..checkpoint.record import ConversionRecord
from .perplexity import REFERENCE, Evaluation, EvaluationError, _prefix_token
from .positions import Positions, positions
from .repetition import Repetition, repetition
from .tails import Tails, tails
from .tasks import MIN_RECOVERY, TaskComparison, TaskRequest, run_tasks
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

    def parts_table(self) -> str:
        """Everything but the perplexity table: what the recipe adds to its own."""
        parts = [part.table() for part in (self.tails, self.positions) if part is not None]
        parts += [self.repetition.line()] if self.repetition is not None else []
        parts += [self.tasks.table()] if self.tasks is not None else []
        return "\n\n".join(parts)

    def table(self) -> str:
        return "\n\n".join(filter(None, [self.evaluation.table(), self.parts_table()]))

    def parts_dict(self) -> dict:
        return {key: None if getattr(self, key) is None else getattr(self, key).to_dict()
                for key in ("tails", "positions", "repetition", "tasks")}

    def to_dict(self) -> dict:
        return {**self.evaluation.to_dict(), **self.parts_dict()}


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
    return (tails(losses, tokenizer, converted, fitted_length=fitted_length(pair[converted])),
            positions(losses, converted),
            repetition(pair, stream, max_length, converted))


def fitted_length(model: nn.Module) -> int | None:
    """The tokens a sequence held when ``model`` was trained (its record's training), else calibrated; None for a
    model this package did not convert: past them it was never fitted, which the worst windows say."""
    record = ConversionRecord.of(model)
    for part in (record.training, record.calibration) if record is not None else ():
        if part and isinstance(part.get("block_len"), int):
            return part["block_len"]
    return None


@dataclass
class FitSettings:
    """What the report measures beyond the perplexity: ``context`` (the tails, the ratio by position and the
    repetition check, in the evaluation's windows), ``tasks`` (lm-eval, ``limit`` / ``num_fewshot`` as it means
    them)."""

    context: bool = True
    tasks: TaskRequest | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    max_tokens: int | None = None
    batch_size: int = 1
    min_recovery: float = MIN_RECOVERY


def fit_report(evaluation: Evaluation, models: dict[str, nn.Module], tokenizer, texts: list[str],
               settings: FitSettings) -> FitReport:
    """``evaluation`` (the perplexity against the original, on ``texts``) completed as ``settings`` ask."""
    report = FitReport(evaluation)
    if settings.context:
        report.tails, report.positions, report.repetition = context_report(
            models, tokenizer, texts, max_length=evaluation.max_length, max_tokens=settings.max_tokens,
            batch_size=settings.batch_size)
    if settings.tasks is not None:
        report.tasks = run_tasks(models, tokenizer, settings.tasks, limit=settings.limit,
                                 num_fewshot=settings.num_fewshot, batch_size=settings.batch_size,
                                 min_recovery=settings.min_recovery)
    return report
