"""Run a conversion job, in the order a conversion happens: every setting checked, then load, convert (within a
quality budget when asked), fold, check, evaluate, and save, push and report. What a step finds for the record
(the budget, the check, the evaluation) is written into the model's record once, as it is saved."""

from __future__ import annotations

import copy
import functools

from ..checkpoint.loading import load_model
from ..checkpoint.model_card import hub_id
from ..checkpoint.publish import keep, publish, save_or_keep, write_whole
from ..checkpoint.record import ConversionRecord
from ..checkpoint.saving import save_pretrained
from ..evaluation.conversion_check import ConversionCheck
from ..evaluation.norm_sensitivity import exact
from ..evaluation.perplexity import EvaluationError
from ..fold import fold
from ..model_inputs import ModelFacts
from ..surgery import ConversionError, ConversionReport, check_not_converted, convert
from ..validation import first_line
from .budget import select_within_budget
from .evaluation import check_context_lengths, evaluate_conversion, warn
from .job import ConversionJob
from .linear import is_converted, linearise_converted, save_stock
from .memory import weights_memory


def run_job(job: ConversionJob) -> ConversionReport | None:
    """Convert ``job.model`` as the job says and save, push and report it, printing what ``normswap convert``
    prints; every setting and destination is checked before any loading or conversion work. Returns the
    conversion's report (None: a converted model linearised)."""
    job.check_settings()
    in_memory = weights_memory(job)
    model, tokenizer = load_model(job.model, **job.placement(), weights_memory=in_memory)
    if job.to == "linear" and is_converted(model):
        linearise_converted(model, tokenizer, job.calibration, job.max_saturation)
        save(job, model, tokenizer, {})
        return None
    check_not_converted(model)
    calibration, evaluation = job.calibration, job.evaluation
    check_context_lengths(job.model, model,
                          {"--calib-len": calibration.block_len if calibration.data else None,
                           "--eval-max-length": evaluation.max_length if evaluation.data else None},
                          {"--calib": calibration.data, "--eval": evaluation.data})
    facts = ModelFacts.read(model)
    original = copy.deepcopy(model) if evaluation.data else None  # the reference for the evaluation
    report, parts = converted(job, model, facts, tokenizer)
    if original is not None:
        parts["evaluation"] = evaluate_or_keep(job, model, original, tokenizer, parts)
    save(job, model, tokenizer, parts)
    if job.output.report:  # after the save: a report that cannot be written must not cost the checkpoint
        try:
            write_whole(job.output.report, report.to_json())
        except OSError as error:
            saved = f" (the checkpoint is saved in {job.output.directory})" if job.output.directory else ""
            raise ConversionError(f"cannot write --report {job.output.report}: {error.strerror}{saved}") from None
    return report


def converted(job: ConversionJob, model, facts: ModelFacts, tokenizer) -> tuple[ConversionReport, dict]:
    """Convert (within the budget), fold and check: the report, and the parts found for the record."""
    parts, budget = {}, None
    if job.budget.limit():
        budget, reasons = select_within_budget(job, model, facts, tokenizer)
    check = ConversionCheck(model, facts, tokenizer) if job.check else None  # the original's scores, before
    selection = job.selection
    report = convert(model, to=job.to, calibration=job.calibration.calibration_for(model, tokenizer),
                     roles=selection.roles, include=exact(budget.converted) if budget else selection.include,
                     exclude=None if budget else selection.exclude, per_channel=job.per_channel,
                     input_scale=job.input_scale)
    if budget:  # the selection's own reasons, not the exact-name pattern the budgeted conversion used
        kept = {k["name"] for k in budget.kept}
        for entry in report.skipped:
            entry["reason"] = "kept by the quality budget" if entry["name"] in kept else reasons[entry["name"]]
        report.budget = parts["budget"] = budget.to_dict()
    print(report)
    if budget:
        print(budget)
    if job.fold:
        print(fold(model))
    if check is not None:
        result = check.after(model)
        print(result.line())
        warn(result.warning(ConversionRecord.of(model)))
        parts["check"] = result.to_dict()
    return report, parts


def evaluate_or_keep(job: ConversionJob, model, original, tokenizer, parts: dict) -> dict:
    """The evaluation's part of the record; whatever stops it, the converted model is saved first, without its
    evaluation, and the error says where."""
    try:
        return evaluate_conversion(job.evaluation, job.model, model, original, tokenizer)
    except Exception as error:  # noqa: BLE001 - any failure: the conversion is kept, the error named in one line
        ConversionRecord.amend(model, **parts)
        save = saver(job, model, tokenizer)
        output = job.output
        if output.directory:
            where = save_or_keep(save, output.directory, overwrite=output.overwrite)
            print(f"saved to {where}")
        else:
            where = keep(save, "checkpoint")
        raise EvaluationError(f"--eval failed ({first_line(error)}); the converted model is saved, without its "
                              f"evaluation, in {where}") from None


def saver(job: ConversionJob, model, tokenizer):
    """``save(directory, **options)`` for the converted model, with its tokenizer and the original's Hub id."""
    return functools.partial(save_pretrained, model, tokenizer=tokenizer, base_model=hub_id(job.model))


def save(job: ConversionJob, model, tokenizer, parts: dict) -> None:
    """The record's new ``parts`` written into the model, then saved, pushed, or saved as the original
    architecture."""
    if parts:
        ConversionRecord.amend(model, **parts)
    output = job.output
    if output.stock:
        save_stock(model, tokenizer, output)
    else:
        publish(saver(job, model, tokenizer), output.directory, output.push_to_hub, overwrite=output.overwrite,
                private=output.private)
