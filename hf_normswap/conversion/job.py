"""A conversion as one job (``normswap convert``, ``convert --config job.yaml`` or Python): what to convert and
how, in sections that each say one part of it. The settings reader (``hf_normswap.settings``) builds a job from a
YAML file and the command line's flags alike; :meth:`ConversionJob.check_settings` refuses, in one line each,
whatever can be refused before the model loads. :func:`hf_normswap.conversion.run_job` runs it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..calibration.defaults import NONE
from ..checkpoint.directory import check_output_dir
from ..checkpoint.hub import PushError, preflight
from ..data import check_spec
from ..evaluation.perplexity import EvaluationError
from ..modules import METHODS
from ..placement import DTYPES, check_device, default_device
from ..settings import read_settings, read_yaml_file
from ..surgery import DEFAULT_ROLES, ConversionError, check_selection, split_roles
from ..validation import ValidationError, check_data_files, check_input_scale, check_number, check_output_file
from .calibration_settings import CalibrationSettings

@dataclass
class Selection:
    """Which norms convert: those of ``roles`` whose names match ``include`` and not ``exclude``."""

    roles: list[str] = field(default_factory=lambda: list(DEFAULT_ROLES))
    include: str | None = None
    exclude: str | None = None


@dataclass
class Budget:
    """The quality budget: convert the largest greedy subset within one limit, measured on ``data``."""

    kl: float | None = None
    ppl_ratio: float | None = None
    cosine: float | None = None
    data: str = "builtin"

    def limit(self) -> tuple[str, float] | None:
        """(metric, limit) of the one limit given, checked; None without a budget."""
        given = [(metric, getattr(self, metric)) for metric in ("kl", "ppl_ratio", "cosine")
                 if getattr(self, metric) is not None]
        if len(given) > 1:
            raise ConversionError(f"{' and '.join(_budget_flag(m) for m, _ in given)} are one budget: give one")
        if not given:
            return None
        metric, limit = given[0]
        if not (0 < limit < math.inf) or (metric == "ppl_ratio" and limit < 1) or (metric == "cosine" and limit > 1):
            raise ConversionError(f"{_budget_flag(metric)} {limit} is out of range: give a KL > 0, "
                                  "a perplexity ratio >= 1 or a cosine in (0, 1]")
        return metric, limit


def _budget_flag(metric: str) -> str:
    return f"--budget-{metric.replace('_', '-')}"


@dataclass
class Evaluation:
    """After converting, the converted model against the original on ``data`` (same forms as ``eval --data``)."""

    data: str | None = None
    max_length: int | None = None
    stride: int | None = None
    max_tokens: int | None = None
    batch_size: int = 1

    def check_evaluation(self) -> None:
        flag = lambda name: "--eval-" + name.replace("_", "-")  # noqa: E731
        for name in ("max_length", "stride", "max_tokens", "batch_size"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), flag(name), minimum=1)
        if self.stride and self.max_length and self.stride > self.max_length:
            raise EvaluationError(f"{flag('stride')} {self.stride} is longer than {flag('max_length')} "
                                  f"{self.max_length}")


@dataclass
class Output:
    """Where the converted model goes: a directory (written atomically), the Hub, a JSON report."""

    directory: str | None = None
    overwrite: bool = False
    push_to_hub: str | None = None
    private: bool = False
    report: str | None = None
    stock: bool = False  # save as the original architecture (a linear model, after recovery)

    def check_destinations(self) -> None:
        if self.directory:
            check_output_dir(self.directory, self.overwrite)
        if self.report:
            check_output_file(self.report, "--report")

    def check_push(self) -> None:
        if self.push_to_hub:
            preflight(self.push_to_hub)
        elif self.private:
            raise PushError("--private needs --push-to-hub REPO")


@dataclass
class ConversionJob:
    """One conversion: ``model`` (a Hub id, a directory, a .gguf file, ``offline:...``) converted ``to`` a method
    of ``hf_normswap.METHODS``, with each section's settings; ``check``: score original and converted on a small
    slice and warn when the conversion is far off; ``fold``: fold each norm's weight into the linears it feeds."""

    model: str = ""
    to: str = ""
    per_channel: bool = False
    input_scale: float | None = None  # with calibration data none: the analytic start's input RMS
    fold: bool = False
    check: bool = True
    max_host_memory: str | None = None  # e.g. 16GB: weights beyond it stay on disk (default: the memory free)
    device: str | None = None  # default: cuda where there is one, else cpu
    dtype: str = "float32"
    max_saturation: float = 0.01  # linearising a converted model: the share of saturated inputs allowed
    selection: Selection = field(default_factory=Selection)
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    budget: Budget = field(default_factory=Budget)
    evaluation: Evaluation = field(default_factory=Evaluation)
    output: Output = field(default_factory=Output)

    def placement(self) -> dict:
        """``load_model``'s ``device`` and ``dtype``; a device this machine lacks fails before the load."""
        device = self.device or default_device()
        try:
            check_device(device, "--device")
        except ValueError as error:
            raise ValidationError(str(error)) from None
        if self.dtype not in DTYPES:
            raise ValidationError(f"--dtype {self.dtype}: choose from {', '.join(sorted(DTYPES))}")
        return {"device": device, "dtype": DTYPES[self.dtype]}

    def check_settings(self) -> None:
        """Every setting and destination checked, in one line each, before any load or conversion work."""
        if self.to not in METHODS:
            raise ConversionError(f"--to {self.to}: choose from {', '.join(sorted(METHODS))}" if self.to else
                                  f"a conversion needs --to METHOD, one of {', '.join(sorted(METHODS))}")
        if not self.model:
            raise ConversionError("a conversion needs a model: a Hub id, a directory, a .gguf file or offline:NAME")
        self.placement()
        if self.input_scale is not None:
            check_input_scale(self.input_scale, "--input-scale")
        self.calibration.check_calibration(self.input_scale)
        self._check_linear()
        check_selection(self.selection.roles, self.selection.include, self.selection.exclude)
        self.output.check_destinations()
        for flag, spec in (("--calib", self.calibration.data), ("--eval", self.evaluation.data)):
            if spec and spec != NONE:  # a mistyped data path, an empty file
                check_data_files(check_spec(spec), flag)
        self.evaluation.check_evaluation()
        self.output.check_push()
        if self.budget.limit() and self.budget.data:
            check_spec(self.budget.data)

    def _check_linear(self) -> None:
        if not 0 <= self.max_saturation <= 1:
            raise ConversionError(f"--max-saturation must be between 0 and 1, got {self.max_saturation}")
        out = self.output
        if out.stock and (self.to != "linear" or not out.directory or out.push_to_hub or self.fold):
            raise ConversionError("--stock saves a linear model to --output: use it with --to linear and --output, "
                                  "without --push-to-hub or --fold")


def read_job(*layers, config_file: str | None = None) -> ConversionJob:
    """A job from a YAML file's settings (``config_file``) under the given ``layers`` (mappings of settings, the
    command line's last: they win), every key known and every value of its type. The checks' messages name each
    setting by its ``normswap convert`` flag."""
    if not config_file:
        return read_settings(ConversionJob, *layers)
    file_layer = read_yaml_file(config_file)
    selection = file_layer.get("selection")
    if isinstance(selection, dict) and isinstance(selection.get("roles"), str):  # as --roles: a,b
        selection["roles"] = list(split_roles(selection["roles"]))
    try:
        return read_settings(ConversionJob, file_layer, *layers)
    except ValidationError as error:  # a key or value of the file (the flags' are typed as they are parsed)
        raise ValidationError(f"--config {config_file}: {error}") from None
