"""Calibration: fit each new module's parameters to real activations. ``convert(model, to, calibration=...)`` lands here.

A strategy is a row of :data:`STRATEGIES`: how each replacement starts (the theory's per-channel value, or
``fitting.saturating_init``), what least squares then fits against the source norm's own output
(``fitting.fit_module``), how many Adam steps per block make each block reproduce the original block's output
(``block_pass.tune_block``), and how many end-to-end steps match the original model's output
(``end_to_end.tune``). The driver, :func:`calibrate_and_replace`,

1. gets its batches from the calibration data (a text spec or token ids) in one call, ``data.model_batches``;
2. converts the norms in forward order, block by block (``block_pass.sequential``; models with two stacks of
   blocks in one pass over the original, ``block_pass.one_shot``), each fitted on activations of the model whose
   earlier norms are already converted;
3. runs the strategy's end-to-end steps;
4. returns per-norm report rows and a summary that ``convert`` stores in ``model.config.normswap``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import resource
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import offload, placement
from ..data import model_batches
from ..discovery.norms import NormInfo
from ..model_inputs import ModelFacts, forward_without_cache
from ..precision import autocast, check_precision, choose_precision, forward_backward
from ..validation import ValidationError, check_number
from . import block_pass, end_to_end
from .capture import DEFAULT_MAX_FIRST, DEFAULT_MAX_TOKENS
from .fitting import FitStats, analytic_input_scale, fit_module, saturating_init
from .report import plot_fit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Strategy:
    """One calibration strategy: what it does, when ``auto`` takes it, and the settings that make it. What each
    measured is in BENCHMARKS.md, "Calibration" and "Speed"."""

    name: str
    fits: str  # what it fits
    auto: str  # when ``auto`` takes it
    init: str  # "analytic": the theory's value for the measured input scale; "saturating": fitting.saturating_init
    fit: tuple[str, ...] = ()  # parameters least squares fits against the source norm's output
    block_steps: int = 0  # Adam steps per block on the block-output error
    block_rows: int = 4  # sequences per block-tuning step
    block_weights_lr: float = 0.0  # > 0: block tuning also fits the block's own weights (block-wise reconstruction)
    tune_steps: int = 0  # end-to-end Adam steps
    tune_blocks: int = 4  # sequences the end-to-end steps cycle over

    def help_line(self) -> str:
        return f"{self.name:<8} {self.fits}; auto: {self.auto}"


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("block", fits="saturating start, 60 steps a block fitting its norms and weights to the original block's "
                           "output, 30 KL steps", auto="RMSNorm models",
             init="saturating", block_steps=60, block_rows=1, block_weights_lr=1e-4, tune_steps=30, tune_blocks=16),
    Strategy("encoder", fits="least squares, then 300 hidden-state steps over 64 sequences",
             auto="LayerNorm models ending in hidden states", init="analytic", fit=("shape", "weight", "bias"),
             tune_steps=300, tune_blocks=64),
    Strategy("kl", fits="least squares, then 30 KL steps over 4 sequences", auto="LayerNorm models with a head",
             init="analytic", fit=("shape", "weight", "bias"), tune_steps=30),
    Strategy("fast", fits="block's saturating start alone", auto="never (a cheap start)", init="saturating"),
)}
DEFAULT_STRATEGY = "auto"  # block, encoder or kl, by each row's ``auto``


def auto_strategy(selected: list[NormInfo], outputs_logits: bool = True) -> str:
    if any(info.kind == "rmsnorm" for info in selected):
        return "block"
    return "kl" if outputs_logits else "encoder"


def strategy_help() -> str:
    """One line per strategy, for ``normswap convert --help``."""
    return "\n".join(["calibration strategies (--strategy; default auto, measured in BENCHMARKS.md):"] +
                     [f"  {s.help_line()}" for s in STRATEGIES.values()])


RUN_TIME = {"run_time": True}  # field metadata: a run-time setting (CalibrationConfig.run_time)


@dataclass
class CalibrationConfig:
    """How to calibrate. Settings left ``None`` take the strategy's value (:data:`STRATEGIES`).

    ``data``: a text spec (``builtin``, files, ``hub_name[:config][:split]``), a LongTensor ``(N, L)`` of token ids,
    or a dict with ``input_ids`` and ``attention_mask``. Text is cut into ``num_blocks`` blocks of ``block_len``
    tokens for decoders (packed, no padding), or ``num_blocks`` padded paragraphs of at most ``block_len`` tokens
    for encoders. Capture keeps at most ``max_tokens_per_norm`` ordinary and ``max_first_per_norm`` first-position
    token vectors per norm (fp32), so memory is bounded by ``(max_tokens + max_first) * C * 4`` bytes per norm.
    """

    data: Any = "builtin"
    num_blocks: int = 64
    block_len: int = 512
    batch_size: int = 8
    max_tokens_per_norm: int = DEFAULT_MAX_TOKENS
    max_first_per_norm: int = DEFAULT_MAX_FIRST
    strategy: str = DEFAULT_STRATEGY
    knee: float = 0.7  # saturating start: output ceiling per channel, in units of the channel's typical value
    block_steps: int | None = None  # Adam steps per block on the block-output error
    block_rows: int | None = None  # sequences per block-tuning step
    block_lr: float = 1e-2
    block_weights_lr: float | None = None  # > 0: block tuning also fits the block's own weights (reconstruct.py)
    tune_steps: int | None = None
    tune_blocks: int | None = None  # sequences the end-to-end steps cycle over
    tune_lr: float = 5e-3
    max_iter: int = 100  # L-BFGS iterations of each least-squares fit
    first_scale: bool = True  # a linear module's first position gets a scale of its own (modules.Linear.log_first)
    seed: int = 0
    precision: str = "fp32"  # or "bf16" (autocast), or "auto": bf16 where a timed probe finds it faster (precision.py)
    # the block pass (block_pass.sequential): where each block is computed, one at a time (None: where the model is;
    # "cuda" with the model in CPU memory holds one block on the GPU), and how much CPU memory the hidden states
    # cached between blocks may take before the rest goes to files in TMPDIR (None: no limit)
    device: str | None = field(default=None, metadata=RUN_TIME)
    cache_memory_mb: float | None = field(default=None, metadata=RUN_TIME)
    progress: bool = field(default=True, metadata=RUN_TIME)
    plots: str | None = field(default=None, metadata=RUN_TIME)
    tokenizer: Any = field(default=None, repr=False, metadata=RUN_TIME)

    @classmethod
    def run_time(cls) -> tuple[str, ...]:
        """The settings of how a calibration runs (where, with what memory, what it shows), not of what it makes:
        a checkpoint does not record them, and two runs that differ only in them make the same weights."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("run_time"))

    def resolved(self, selected: list[NormInfo] = (), outputs_logits: bool = True) -> "CalibrationConfig":
        """The options with the strategy's step counts filled in; ``auto`` becomes a strategy for ``selected``
        norms of a model that ends in an output head (``outputs_logits``) or in hidden states."""
        if self.strategy != DEFAULT_STRATEGY and self.strategy not in STRATEGIES:
            raise ValueError(f"unknown calibration strategy {self.strategy!r}: choose from "
                             f"{', '.join([DEFAULT_STRATEGY, *STRATEGIES])}")
        out = copy.copy(self)
        if out.strategy == DEFAULT_STRATEGY:
            out.strategy = auto_strategy(selected, outputs_logits)
        preset = STRATEGIES[out.strategy]
        for key in ("block_steps", "block_rows", "block_weights_lr", "tune_steps", "tune_blocks"):
            if getattr(out, key) is None:
                setattr(out, key, getattr(preset, key))
        for name in ("num_blocks", "block_len", "batch_size", "max_tokens_per_norm", "block_rows", "tune_blocks"):
            value = getattr(out, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError(f"{name} must be a whole number of at least 1, got {value!r}", name)
        for name in ("block_steps", "tune_steps", "block_weights_lr", "cache_memory_mb"):  # 0: none, all on disk
            if getattr(out, name) is not None:
                check_number(getattr(out, name), name, minimum=0)
        check_precision(out.precision)
        try:
            check_device(out.device)
        except ValueError as error:
            raise ValidationError(str(error), "device") from None
        return out

    @property
    def preset(self) -> Strategy:
        return STRATEGIES[self.strategy]

    @classmethod
    def from_summary(cls, summary: dict) -> "CalibrationConfig":
        """The settings that a :meth:`summary` (``normswap.calibration`` in config.json) records, without what it
        adds about the run (mode, time, tokens, memory)."""
        names = {f.name for f in fields(cls)} - set(cls.run_time())  # earlier checkpoints recorded the device
        settings = {key: value for key, value in summary.items() if key in names}
        if isinstance(settings.get("precision"), dict):  # recorded with its probe's timings
            settings["precision"] = settings["precision"].get("requested")
        return cls(**settings)

    def summary(self) -> dict:
        skip = {"data", *self.run_time()}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        if self.strategy in STRATEGIES:
            out.update(init=self.preset.init, fit=list(self.preset.fit))
        out["data"] = self.data if isinstance(self.data, str) else f"tensor{tuple(_ids(self.data).shape)}"
        return out


def check_device(device: str | None) -> None:
    """A device the block pass can compute on, or ``ValueError`` naming the fix."""
    if device is not None:
        placement.check_device(device, "calibration device", "leave the device unset to calibrate where the model is")


def _ids(data) -> torch.Tensor:
    return data["input_ids"] if isinstance(data, dict) else data


@dataclass
class NormFit:
    """One row of the calibration report."""

    name: str
    kind: str
    role: str
    shape_name: str
    shape_mean: float
    shape_min: float
    shape_max: float
    gamma_mean: float  # mean of weight / amplitude: the source norm's scale as fitted
    input_scale: float
    tokens_seen: int
    tokens_kept: int
    first_kept: int
    stats: FitStats

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stats"] = self.stats.to_dict()
        return out


@dataclass
class CalibrationResult:
    fits: dict[str, NormFit]
    summary: dict


# -------------------------------------------------------------------------------------------------- fitting


class _Fitter:
    """Builds, fits and records the replacement for one norm from captured inputs."""

    def __init__(self, config: CalibrationConfig, build):
        self.config, self.build = config, build
        self.fits: dict[str, NormFit] = {}
        self.capture_bytes = 0

    def __call__(self, info: NormInfo, source: nn.Module, sample) -> nn.Module:
        cfg, preset = self.config, self.config.preset
        offload.materialize(source)  # a norm outside an onloaded block may still have its weights on disk
        x, is_first = sample.data()
        self.capture_bytes = max(self.capture_bytes, sample.nbytes())
        scale = analytic_input_scale(x, info.kind, is_first) if x.shape[0] else 1.0
        replacement = self.build(source, info, input_scale=scale, per_channel=True)
        if preset.init == "saturating" and x.shape[0]:
            saturating_init(replacement, x, info.kind, scale, is_first, cfg.knee)
        if cfg.first_scale and is_first.any() and (~is_first).any():
            replacement.set_first_scale(analytic_input_scale(x[is_first], info.kind), scale)
        reference = copy.deepcopy(source).to("cpu", torch.float32)
        with torch.no_grad():
            target = torch.cat([reference(chunk) for chunk in x.split(4096)]) if x.shape[0] else x
        stats = fit_module(replacement, replacement.common_rows(x, is_first), target,
                           weight=_natural_frequency(is_first, sample),
                           params=preset.fit, is_first=is_first, max_iter=cfg.max_iter)
        shape = replacement.shape_parameter().detach().float()
        self.fits[info.name] = NormFit(
            name=info.name, kind=info.kind, role=info.role, shape_name=replacement.shape_name,
            shape_mean=float(shape.mean()), shape_min=float(shape.min()), shape_max=float(shape.max()),
            gamma_mean=float(replacement.weight.detach().float().mean() / replacement.amplitude),
            input_scale=scale, tokens_seen=sample.count, tokens_kept=sample.tokens.buffer.shape[0],
            first_kept=sample.first.buffer.shape[0], stats=stats,
        )
        if cfg.plots:
            plot_fit(Path(cfg.plots), info.name, replacement, reference, x, target, is_first, stats)
        return replacement


def _natural_frequency(is_first: torch.Tensor, sample) -> torch.Tensor:
    """Row weights that give the first-position tokens, kept in a reservoir of their own, the share of the loss
    they have among all tokens seen."""
    rows = torch.ones(is_first.shape[0], 1, dtype=torch.float64)
    n_first, n_plain = int(is_first.sum()), int((~is_first).sum())
    if n_first and n_plain:
        rows[is_first] = sample.first.seen / max(sample.tokens.seen, 1) * n_plain / n_first
    return rows


# ---------------------------------------------------------------------------------------------- the driver


def calibrate_and_replace(model: nn.Module, selected: list[NormInfo], config: CalibrationConfig, build,
                          replace) -> CalibrationResult:
    """Fit and swap in per-channel replacements for ``selected`` norms, in forward order.
    ``build(source, info, input_scale=, per_channel=)`` makes a module and ``replace(model, name, module)`` sets
    it: ``convert`` passes both, so that stages go one way (convert plans and replaces, calibration fits)."""
    facts = ModelFacts.read(model)
    config = config.resolved(selected, not facts.hidden_states)
    if facts.on_disk and config.tune_steps:  # a backward through every block would hold all their weights at once
        logger.warning("weights on disk: calibrating block by block, without the end-to-end steps")
        config = dataclasses.replace(config, tune_steps=0)
    torch.manual_seed(config.seed)
    # a block-tuning step reads its block_rows sequences from one batch
    batch_size = max(config.batch_size, config.block_rows if config.block_steps else 1)
    batches, fingerprint = model_batches(model, config.data, config.tokenizer, num_blocks=config.num_blocks,
                                         block_len=config.block_len, batch_size=batch_size)
    device, probe_start = facts.device, time.perf_counter()
    probe_params = [] if facts.on_disk else [p for info in selected for p in model.get_submodule(info.name).parameters()
                                       if p.requires_grad]  # on disk: a forward probe, in one layer's memory
    row = {k: v[:1] for k, v in batches[0].items()}  # one sequence: a probe, not a pass
    precision = choose_precision(config.precision, lambda: forward_backward(lambda: forward_without_cache(model, row),
                                                                            probe_params), device=device,
                                 repetitions=2)
    probe_seconds = time.perf_counter() - probe_start
    # every forward / backward pass of calibration, on the model's device and on the block pass's; fits stay fp32
    with autocast(precision.bf16, device), autocast(precision.bf16, config.device or device):
        result = _calibrate(model, selected, config, batches, fingerprint, build, replace)
    result.summary.update(precision=vars(precision), precision_probe_seconds=round(probe_seconds, 1))
    return result


def _calibrate(model, selected, config, batches, fingerprint, build, replace) -> CalibrationResult:
    start, cpu_start = time.perf_counter(), time.process_time()
    fitter = _Fitter(config, build)
    was_training = model.training
    model.eval()
    rows = end_to_end.tuning_rows(batches, config.tune_blocks) if config.tune_steps else []
    teacher = end_to_end.teacher_outputs(model, rows) if rows else None
    plan = block_pass.block_plan(model, selected, batches[0])
    if plan is None and config.device:
        logger.warning(f"calibration device {config.device} unused: this model's norms do not sit in one stack of "
                       f"blocks, so they are fitted in one pass where the model is (move the model there instead)")
    block_tuning, cache = [], None
    with torch.no_grad():
        if plan is None:
            block_pass.one_shot(model, selected, batches, fitter, replace, config)
        else:
            block_tuning, cache = block_pass.sequential(model, plan, batches, fitter, replace, config)
    tuning = None
    if teacher is not None:
        modules = [model.get_submodule(info.name) for info in selected]
        tuning = end_to_end.tune(model, modules, rows, teacher, config)
    model.train(was_training)
    summary = dict(config.summary(), mode="one-shot" if plan is None else "sequential",
                   seconds=round(time.perf_counter() - start, 1),
                   cpu_seconds=round(time.process_time() - cpu_start, 1),
                   tokens=int(sum(int(b["attention_mask"].sum()) for b in batches)),
                   sequences=sum(int(b["input_ids"].shape[0]) for b in batches),
                   capture_bytes_per_norm=fitter.capture_bytes,
                   peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    if fingerprint is not None:
        summary.update(data=config.data, fingerprint=fingerprint)
    if cache is not None:
        summary["activation_cache"] = cache
    if block_tuning:
        summary["block_tuning"] = block_tuning
    if tuning is not None:
        summary["tuning"] = tuning
    return CalibrationResult(fits=fitter.fits, summary=summary)


def as_config(calibration) -> CalibrationConfig:
    """``calibration`` as a :class:`CalibrationConfig` (token ids or a dict of inputs are shorthand for one with
    default options); raises ``ValueError`` for anything else or an unknown strategy."""
    if isinstance(calibration, (torch.Tensor, dict)):
        calibration = CalibrationConfig(data=calibration)
    if not isinstance(calibration, CalibrationConfig):
        raise ValueError("calibration must be a CalibrationConfig, a token id tensor or a dict of model inputs")
    calibration.resolved()
    return calibration
