"""A conversion as one job: :class:`ConversionJob` says what to convert and how (selection, calibration, budget,
fold, check, evaluation, output), read from a YAML file, the command line or built in Python; :func:`run_job`
runs it, as ``normswap convert`` does."""

from .calibration_settings import CalibrationSettings
from .job import Budget, ConversionJob, Evaluation, Output, Selection, read_job
from .run import run_job

__all__ = ["ConversionJob", "Selection", "CalibrationSettings", "Budget", "Evaluation", "Output", "read_job",
           "run_job"]
