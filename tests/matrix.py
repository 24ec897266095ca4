"""The conversion matrix that tests share: tiny architecture x DyT / ELN x calibration strategy.

Each case is converted once per test session (``converted`` caches it) and handed out as a fresh copy, so the
discovery, checkpoint and calibration tests run over the same matrix without converting the same model twice.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_model

import hf_normswap
from hf_normswap.calibration.calibrate import STRATEGIES, CalibrationConfig
from hf_normswap.discovery.roles import ROLES
from hf_normswap.modules import METHODS as METHOD_CLASSES

METHODS = tuple(METHOD_CLASSES)  # every method the package registers
CALIBRATED_ARCHITECTURES = ("llama", "gpt2", "opt", "bert", "t5")  # RMSNorm / LayerNorm, decoder / encoder, two stacks


@dataclass(frozen=True)
class Case:
    arch: str
    method: str
    strategy: str | None = None  # None: the theory's start at RMS 1, no calibration
    per_channel: bool = False

    def __str__(self) -> str:
        return "-".join([self.arch, self.method, self.strategy or "analytic"] + ["per_channel"] * self.per_channel)


ANALYTIC = [Case(arch, method) for arch in ARCHITECTURES for method in METHODS]
CALIBRATED = [Case(arch, method, strategy) for arch in CALIBRATED_ARCHITECTURES for method in METHODS
              for strategy in STRATEGIES]


def cases(selection: list[Case]):
    """``@cases(ANALYTIC)``: run a test once per case, the case as its ``case`` argument."""
    return pytest.mark.parametrize("case", selection, ids=str)


def calibration_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _converted(case: Case):
    model = tiny_model(case.arch)
    if case.strategy is None:  # the theory's start at inputs of RMS 1, the baseline every strategy must beat
        settings = dict(calibration=None, input_scale=1.0)
    else:
        settings = dict(calibration=CalibrationConfig(data=calibration_ids(), batch_size=4, strategy=case.strategy,
                                                      progress=False))
    report = hf_normswap.convert(model, to=case.method, roles=ROLES, per_channel=case.per_channel, **settings)
    return model, report


def converted(case: Case):
    """(the converted model, its ConversionReport), every norm of every role converted; a copy of the cached one."""
    model, report = _converted(case)
    return copy.deepcopy(model), report
