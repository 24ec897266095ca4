"""Every calibration strategy on every family of the matrix: a finite model, recorded as asked, closer to the
original than the analytic start, and no gradients left on the tuned weights."""

from __future__ import annotations

import pytest
import torch
from matrix import CALIBRATED, STRATEGIES, Case, calibration_ids, cases, converted
from tiny_models import tiny_model

import hf_normswap
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.model_inputs import first_tensor

pytestmark = pytest.mark.usefixtures("one_thread")


def _relative_error(model, original, ids) -> float:
    inputs = dict(input_ids=ids, **({"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}))
    with torch.no_grad():
        out, reference = first_tensor(model(**inputs)).float(), first_tensor(original(**inputs)).float()
    return float((out - reference).pow(2).mean() / reference.pow(2).mean())


@cases(CALIBRATED)
def test_each_strategy_beats_the_analytic_start(case):
    model, report = converted(case)
    analytic, _ = converted(Case(case.arch, case.method))
    original, ids = tiny_model(case.arch), calibration_ids(seed=1)[:4]  # text the calibration did not see
    assert report.calibration["strategy"] == case.strategy
    assert model.config.normswap["convert"]["method"] == case.method
    error = _relative_error(model, original, ids)
    assert error < 0.6 * _relative_error(analytic, original, ids), error  # measured: at most 0.55x of it


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_calibration_leaves_no_gradients(strategy):
    """Gradients left on tuned weights would hold a second copy of them until the conversion ends (the matrix's
    cached models cannot tell: a deep copy drops gradients)."""
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln", calibration=CalibrationConfig(data=calibration_ids(), batch_size=4,
                                                                      strategy=strategy, progress=False))
    held = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not held, held
