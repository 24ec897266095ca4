"""A job's calibration section: the ``CalibrationConfig`` fields a user sets (``--calib``, ``--calib-blocks``, ...),
each left ``None`` for the default. Read into a checked ``CalibrationConfig`` by the settings reader, so the
config's own checks run before any load, named by the flag."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields

from ..calibration.calibrate import DEFAULT_STRATEGY, CalibrationConfig
from ..calibration.defaults import NONE, default_calibration
from ..settings import read_settings
from ..surgery import ConversionError
from ..validation import check_output_folder

BLOCK_ONLY = ("block_weights_lr", "block_rows", "block_steps")  # settings of the block strategy alone
NEEDS_DATA = ("plots", "strategy", "device", "cache_memory_mb", *BLOCK_ONLY)
DEFAULTS = CalibrationConfig()


@dataclass
class CalibrationSettings:
    """``data``: a text spec, or ``none`` for the analytic start; absent: the default's (the original's samples, an
    encoder's builtin text). The rest as :class:`~hf_normswap.CalibrationConfig`'s fields of the same names."""

    data: str | None = None
    num_blocks: int | None = None
    block_len: int | None = None
    strategy: str | None = None
    max_tokens_per_norm: int = DEFAULTS.max_tokens_per_norm
    plots: str | None = None
    precision: str = DEFAULTS.precision
    block_weights_lr: float | None = None
    block_steps: int | None = None
    block_rows: int | None = None
    device: str | None = None
    cache_memory_mb: float | None = None

    # field -> the flag that sets it
    FLAGS = {"data": "--calib", "num_blocks": "--calib-blocks", "block_len": "--calib-len", "strategy": "--strategy",
             "max_tokens_per_norm": "--max-tokens-per-norm", "plots": "--plots", "precision": "--precision",
             "block_weights_lr": "--block-weights-lr", "block_steps": "--block-steps", "block_rows": "--block-rows",
             "device": "--calib-device", "cache_memory_mb": "--calib-cache-mb"}

    def given(self) -> dict:
        """The settings given (``data`` none is the analytic start, no setting of a calibration)."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if given.get("data") == NONE:
            del given["data"]
        return given

    def calibration_config(self, tokenizer=None) -> CalibrationConfig:
        """The settings as a checked ``CalibrationConfig`` (no data given: the default data, for the checks)."""
        config = read_settings(CalibrationConfig, self.given(), labels=self.FLAGS, check=CalibrationConfig.resolved)
        config.tokenizer = tokenizer
        return config

    def check_calibration(self, input_scale: float | None = None) -> None:
        """Mistakes that need no model, so they fail before the (slow) load; numbers are checked even unused."""
        self.calibration_config()
        given = self.given()
        if input_scale is not None and self.data != NONE:
            raise ConversionError("--input-scale sets the analytic start: add --calib none (calibration measures "
                                  "the scales itself)")
        if self.data == NONE:
            for name in NEEDS_DATA:
                if name in given:
                    raise ConversionError(f"{self.FLAGS[name]} needs calibration: drop --calib none")
        for name in BLOCK_ONLY:
            if name in given and self.strategy not in (None, DEFAULT_STRATEGY, "block"):
                raise ConversionError(f"{self.FLAGS[name]} needs the block strategy, not {self.strategy}")
        if self.plots:
            check_output_folder(self.plots, "--plots")

    def calibration_for(self, model, tokenizer) -> CalibrationConfig | None:
        """The calibration asked for: None for data none (the analytic start), the given text, or without data the
        default (``calibration.defaults``), said in one line."""
        if self.data == NONE:
            return None
        if not self.data:
            config, line = default_calibration(model, tokenizer, **self.given())
            print(line or "no tokenizer: the start measured on random token ids, uncalibrated; --calib DATA with a "
                          "tokenizer calibrates", file=sys.stderr)  # stdout is the result's (--json)
            return config
        if tokenizer is None:
            raise ConversionError("--calib needs a model with a tokenizer")
        return self.calibration_config(tokenizer)
