"""Calibration: fit each new module's parameters to real activations. ``convert(model, to, calibration=...)`` lands here.

A strategy is a row of :data:`STRATEGIES`: how each replacement starts (the theory's per-channel value, or
``fitting.saturating_init``), what least squares then fits against the source norm's own output
(``fitting.fit_module``), how many Adam steps per block make each block reproduce the original block's output
(``block_pass.tune_block``), and how many end-to-end steps match the original model's output
(``end_to_end.tune``). The driver, :func:`calibrate_and_replace`,

1. turns the calibration data (a text spec for ``data.load_texts``, or token ids) into batches;
2. converts the norms in forward order, block by block (``block_pass.sequential``; models with two stacks of
   blocks in one pass over the original, ``block_pass.one_shot``), each fitted on activations of the model whose
   earlier norms are already converted;
3. runs the strategy's end-to-end steps;
4. returns per-norm report rows and a summary that ``convert`` stores in ``model.config.normswap``.
"""

from __future__ import annotations

import copy
import logging
import resource
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import placement
from ..discovery.norms import NormInfo
from ..model_inputs import ends_in_hidden_states, forward_without_cache
from ..precision import autocast, check_precision, choose_precision, forward_backward
from ..validation import ValidationError, check_number
from . import block_pass, end_to_end
from .capture import DEFAULT_MAX_FIRST, DEFAULT_MAX_TOKENS
from .fitting import FitStats, analytic_input_scale, fit_module, saturating_init

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


# ----------------------------------------------------------------------------------------------------- data


def calibration_batches(model: nn.Module, config: CalibrationConfig) -> tuple[list[dict], str | None]:
    """Model inputs for calibration, as batches on the model's input device, and the text's ``data.fingerprint``
    (None for token ids), which the checkpoint records so evaluation can warn about overlap."""
    data = config.data
    fingerprint = None
    if isinstance(data, (torch.Tensor, dict)):
        ids = _ids(data)
        mask = data.get("attention_mask") if isinstance(data, dict) else None
        mask = torch.ones_like(ids) if mask is None else mask
    else:
        from ..data import fingerprint as content_fingerprint
        from ..data import load_texts, token_blocks

        if config.tokenizer is None:
            raise ValueError("calibration from text needs a tokenizer: pass CalibrationConfig(tokenizer=...)")
        block_len = min(config.block_len, getattr(model.config, "max_position_embeddings", None) or config.block_len)
        texts = load_texts(data, "calibration", model=model, tokenizer=config.tokenizer,
                           max_tokens=config.num_blocks * block_len)
        fingerprint = content_fingerprint(texts)
        if _is_decoder(model):
            ids = token_blocks(config.tokenizer, texts, config.num_blocks, block_len)
            mask = torch.ones_like(ids)
        else:
            rows = _paragraphs(texts, config.num_blocks)
            enc = config.tokenizer(rows, truncation=True, max_length=block_len, padding=True,
                                   return_tensors="pt")
            ids, mask = enc["input_ids"], enc["attention_mask"]
    ids, mask = ids[: config.num_blocks], mask[: config.num_blocks]
    device = _input_device(model)
    batches = []
    for start in range(0, ids.shape[0], config.batch_size):
        batch = {"input_ids": ids[start:start + config.batch_size].to(device),
                 "attention_mask": mask[start:start + config.batch_size].to(device)}
        if getattr(model.config, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = batch["input_ids"]
        batches.append(batch)
    return batches, fingerprint


def _paragraphs(texts: list[str], count: int) -> list[str]:
    rows = []
    for text in texts:
        for line in text.split("\n"):
            line = line.strip()
            if len(line.split()) >= 8 and not line.startswith("="):
                rows.append(line)
                if len(rows) >= count:
                    return rows
    if not rows:
        from ..data import DataError

        raise DataError("the calibration text has no paragraph of 8 words or more")
    return rows


def _is_decoder(model: nn.Module) -> bool:
    name = type(model).__name__
    return "CausalLM" in name or "LMHeadModel" in name


def _input_device(model: nn.Module) -> torch.device:
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(model.parameters()).device


# -------------------------------------------------------------------------------------------------- fitting


class _Fitter:
    """Builds, fits and records the replacement for one norm from captured inputs."""

    def __init__(self, config: CalibrationConfig, build):
        self.config, self.build = config, build
        self.fits: dict[str, NormFit] = {}
        self.capture_bytes = 0

    def __call__(self, info: NormInfo, source: nn.Module, sample) -> nn.Module:
        cfg, preset = self.config, self.config.preset
        x, is_first = sample.data()
        self.capture_bytes = max(self.capture_bytes, sample.nbytes())
        scale = analytic_input_scale(x, info.kind, is_first) if x.shape[0] else 1.0
        replacement = self.build(source, info, input_scale=scale, per_channel=True)
        if preset.init == "saturating" and x.shape[0]:
            saturating_init(replacement, x, info.kind, scale, is_first, cfg.knee)
        reference = copy.deepcopy(source).to("cpu", torch.float32)
        with torch.no_grad():
            target = torch.cat([reference(chunk) for chunk in x.split(4096)]) if x.shape[0] else x
        stats = fit_module(replacement, x, target, weight=_natural_frequency(is_first, sample),
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
    config = config.resolved(selected, not ends_in_hidden_states(model))
    torch.manual_seed(config.seed)
    batches, fingerprint = calibration_batches(model, config)
    device, probe_start = _input_device(model), time.perf_counter()
    probe_params = [p for info in selected for p in model.get_submodule(info.name).parameters() if p.requires_grad]
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


# ------------------------------------------------------------------------------------------------ the report


FIT_TABLE_LEGEND = """\
  param mean/min/max: the shape parameter (ELN beta, DyT alpha) when the norm was fitted, over its channels;
    later block or model tuning moves it (the final value is on the norm's line above)
  gamma: mean of weight / amplitude, the norm's scale as fitted
  resid: the fit's weighted mean squared error, module output against the original norm's, on the sampled tokens
  rel.err: ||output - original|| / ||original|| on ordinary tokens; rel.err@0: the same on first-position tokens
    (the attention sink), '-' without any
  sat.: share of output elements beyond 95% of the amplitude (the flat part of tanh / ISRU)"""


def _calibration_line(summary: dict) -> str:
    """Strategy, time, and the tokens used against those asked for (short texts give fewer)."""
    asked = summary.get("num_blocks"), summary.get("block_len")
    used = f"{summary['tokens']} tokens" + (f" in {summary['sequences']} sequences" if "sequences" in summary else "")
    if all(asked) and not str(summary.get("data")).startswith("tensor"):  # token ids given: nothing was asked
        used += f" (asked: {asked[0]} sequences of up to {asked[1]} tokens)"
    parts = [f"{k}={summary[k]}" for k in ("strategy", "mode") if k in summary]
    if "seconds" in summary:
        parts.append(f"{summary['seconds']} s")
    return "calibration: " + ", ".join(parts + [used])


def fit_table(report) -> str:
    """The per-norm fit statistics of a calibrated conversion report, as a text table with its legend."""
    header = (f"  {'norm':<45} {'param':>6} {'mean':>10} {'min':>10} {'max':>10} {'gamma':>7} {'resid':>9} "
              f"{'rel.err':>8} {'rel.err@0':>9} {'sat.':>6}")
    lines = [_calibration_line(report.calibration), header]
    for c in report.converted:
        if not c.fit:
            continue
        f, st = c.fit, c.fit["stats"]
        first = st["rel_error_first"]
        lines.append(f"  {c.name:<45} {f['shape_name']:>6} {f['shape_mean']:>10.4g} {f['shape_min']:>10.4g} "
                     f"{f['shape_max']:>10.4g} {f['gamma_mean']:>7.3g} {st['loss']:>9.3g} {st['rel_error']:>8.3g} "
                     f"{'-' if first is None else format(first, '.3g'):>9} {st['saturation']:>6.1%}")
    tuning = report.calibration.get("tuning")
    if tuning:
        lines.append(f"  tuning ({tuning['objective']}, {tuning['steps']} steps on {tuning['rows']} rows): "
                     f"{tuning['loss_before']:.4g} -> {tuning['loss_after']:.4g}")
    lines.append(FIT_TABLE_LEGEND)
    return "\n".join(lines)


def plot_fit(directory: Path, name: str, module, reference, x, target, is_first, stats: FitStats,
             max_points: int = 20000) -> Path:
    """The source norm's outputs over its inputs (grey: ordinary tokens, red: first positions) with the fitted
    module's outputs on the same inputs, all divided by the source's per-channel scale (paper's Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    scale = getattr(reference, "weight", None)
    scale = scale.detach().float() if isinstance(scale, torch.Tensor) else torch.ones(x.shape[-1])
    scale = torch.where(scale.abs() < 1e-6, torch.ones_like(scale), scale)
    with torch.no_grad():
        fitted = copy.deepcopy(module).to("cpu", torch.float32)(x.float()).float() if x.shape[0] else x
    generator = torch.Generator().manual_seed(0)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for rows, color, label in ((~is_first, "0.6", "source, tokens"), (is_first, "tab:red", "source, first position")):
        xs, ys, fs = x[rows], (target[rows] - _bias(reference)) / scale, (fitted[rows] - _bias(reference)) / scale
        flat = xs.numel()
        if flat == 0:
            continue
        pick = torch.randperm(flat, generator=generator)[:max_points]
        ax.scatter(xs.flatten()[pick], ys.flatten()[pick], s=2, c=color, alpha=0.4, label=label)
        ax.scatter(xs.flatten()[pick], fs.flatten()[pick], s=1, c="tab:blue", alpha=0.3,
                   label="fitted" if color == "0.6" else None)
    ax.set(title=f"{name}\nrel. error {stats.rel_error:.3g}, saturated {stats.saturation:.1%}",
           xlabel="input x", ylabel="output / source gamma")
    ax.legend(fontsize=7, markerscale=4)
    path = directory / f"{name.replace('.', '_')}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _bias(reference) -> torch.Tensor | float:
    bias = getattr(reference, "bias", None)
    return bias.detach().float() if isinstance(bias, torch.Tensor) else 0.0
