"""A conversion's evaluation (``--eval``): the converted model against the original, side by side, printed and
stored for the model card; warned (one line, as every verb warns) when the text overlaps the calibration's; and
the lengths a job gives checked against the model's context before any work."""

from __future__ import annotations

import sys

from ..checkpoint.record import ConversionRecord
from ..data import load_texts, sample_length, same_sample
from ..data.sources import source
from ..evaluation.documents import evaluation_texts
from ..evaluation.perplexity import EvaluationError, PerplexitySettings, evaluate, overlap_warning
from ..model_inputs import check_context
from ..validation import ValidationError


def warn(message: str | None) -> None:
    """A warning, one line on stderr (stdout is the result's)."""
    if message:
        print(f"normswap: warning: {message}", file=sys.stderr)


def calibration_overlap(calib_spec, recorded, data: str, texts) -> str | None:
    """Warning text when the evaluation data overlaps the calibration data (given, or recorded in the model)."""
    recorded_spec = recorded.get("data") if isinstance(recorded, dict) else None
    if any(isinstance(spec, str) and source(spec).samples_original for spec in (calib_spec, recorded_spec)):
        if same_sample(calib_spec, data) or same_sample(recorded_spec, data):
            return (f"the evaluation text {data} is the calibration's own sample (the same settings draw the same "
                    "batches): set another seed, e.g. generated:seed=1")
        return None
    if calib_spec:
        return overlap_warning(calib_spec, load_texts(calib_spec, "calibration"), data, texts)
    if isinstance(recorded, dict):
        spec = recorded.get("data") if isinstance(recorded.get("data"), str) else None
        if spec or recorded.get("fingerprint"):
            return overlap_warning(spec, None, data, texts, calib_fingerprint=recorded.get("fingerprint"))
    return None


def check_context_lengths(name: str, model, lengths: dict, sources: dict) -> None:
    """The lengths given, and the sequence length of each ``generated`` source, within the model's context, before
    any work (``model_inputs.check_context``): calibration cut a longer --calib-len silently, and an evaluation's
    samples failed only after the conversion."""
    sampled = {f"{flag} generated: length": sample_length(spec) for flag, spec in sources.items()}
    try:
        check_context({**lengths, **sampled}, model, name)
    except ValueError as error:
        raise ValidationError(str(error)) from None


def evaluate_conversion(settings, name: str, model, original, tokenizer) -> dict:
    """The converted model against ``original`` with the job's evaluation ``settings``: the table printed, a
    warning when the text overlaps the calibration's; returns the model card's part."""
    texts = evaluation_texts(settings.data, original, tokenizer, settings.max_tokens)
    record = ConversionRecord.of(model)
    warn(calibration_overlap(None, record.calibration if record is not None else None, settings.data, texts))
    if tokenizer is None:
        raise EvaluationError(f"{name} has no tokenizer: perplexity needs one")
    scoring = PerplexitySettings(max_length=settings.max_length, stride=settings.stride,
                                 max_tokens=settings.max_tokens, batch_size=settings.batch_size)
    evaluation = evaluate(model, tokenizer, texts, against=original, data=settings.data, settings=scoring)
    print(f"\nevaluation on {evaluation.describe()}\n{evaluation.table()}")
    return evaluation.card("converted")
