"""The quality budget of a conversion: the largest greedy subset of the selected norms whose damage stays within
one limit, searched on a copy by ``evaluation.norm_sensitivity`` (the map on its slice, then a bisection of the
greedy curve)."""

from __future__ import annotations

from dataclasses import replace

from ..evaluation.documents import evaluation_texts
from ..evaluation.norm_sensitivity import (
    CALIB_BLOCKS, CALIB_LEN, EVAL_LEN, EVAL_WINDOWS, Measurer, Reference, measure_map,
)
from ..evaluation.norm_sensitivity import select_within_budget as bisect
from ..model_inputs import ModelFacts
from ..surgery import ConversionError, plan


def measurer(job, model, facts: ModelFacts, tokenizer, texts, calibration, **slice_options) -> Measurer:
    """The damage of norms converted to ``job.to`` (its selection's roles, per channel or not), measured on
    ``texts`` against the model as it is (``facts``: the model's, read once)."""
    if tokenizer is None:
        raise ConversionError(f"{job.model} has no tokenizer: the sensitivity map needs one to score text")
    reference = Reference(model, facts, tokenizer, texts, **slice_options)
    return Measurer(model, reference, job.to, calibration, roles=job.selection.roles, per_channel=job.per_channel)


def measured_weights_lr(block_weights_lr: float | None) -> float:
    """Block-wise reconstruction in a sensitivity measurement only when asked: the map is the damage of norms
    converted with their blocks' weights as they are, and a few hundred tokens would overfit the weights."""
    return 0.0 if block_weights_lr is None else block_weights_lr


def select_within_budget(job, model, facts: ModelFacts, tokenizer):
    """(the selection within ``job.budget``, each norm left out by the selection with its reason), searched with
    the job's calibration made cheap (the final conversion runs it in full)."""
    metric, limit = job.budget.limit()
    encoder = facts.hidden_states
    if (metric == "cosine") != encoder:
        raise ConversionError(f"--budget-{metric.replace('_', '-')} does not apply to {job.model}: use "
                              + ("--budget-cosine for an encoder" if encoder else
                                 "--budget-kl or --budget-ppl-ratio for a model with an output head"))
    calibration = job.calibration.calibration_for(model, tokenizer)
    if calibration is not None:
        calibration = replace(calibration, num_blocks=CALIB_BLOCKS, block_len=CALIB_LEN, tune_steps=0, plots=None,
                              block_weights_lr=measured_weights_lr(job.calibration.block_weights_lr),
                              progress=False)
    texts = evaluation_texts(job.budget.data, model, tokenizer, EVAL_WINDOWS * EVAL_LEN)
    measure = measurer(job, model, facts, tokenizer, texts, calibration)
    selection = job.selection
    _, selected, skipped = plan(model, selection.roles, selection.include, selection.exclude)
    found = bisect(measure_map(measure, selected), measure, metric, limit)
    if not found.converted:
        raise ConversionError(f"no norm converts within the budget: {found.kept[0]['reason']}")
    return found, {s["name"]: s["reason"] for s in skipped}
