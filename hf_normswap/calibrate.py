"""Calibration: fit each new module's alpha / beta (and optionally gamma and bias) to real activations.

``convert(model, to, calibration=CalibrationConfig(...))`` lands here. The driver

1. turns the calibration data (a text spec for ``data.load_texts``, or token ids) into batches;
2. converts in forward order. Sequentially (the default) it runs the network block by block, GPTQ-style: the
   inputs of the first repeated block are cached once, then for each block each target norm's input is captured
   (``capture.py``: bounded reservoir, padding excluded, first-position tokens kept apart) on the model whose
   earlier norms are already converted, the replacement is fitted (``fitting.py``) against the source norm's
   output on those very inputs and swapped in, and the block is re-run to give the next block its input. Norms
   outside the blocks (embedding LayerNorm before, final norm after) are handled before / after the blocks.
   With ``block_steps`` each block's new modules are then tuned so that the block reproduces the original
   block's output (``_tune_block``), and a final norm fed straight by the last block is tuned the same way
   toward the original final norm's output on the original trajectory. Without ``sequential`` every norm is
   fitted on activations of the original model in one pass;
3. optionally tunes only the new modules' parameters for a few Adam steps to match the original model's output
   distribution (KL of logits, or MSE of the last hidden state for encoders) on a few calibration blocks;
4. returns per-norm report rows and a summary that ``convert`` stores in ``model.config.normswap``.

Strategies are presets over the options; see :data:`STRATEGIES`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .capture import DEFAULT_MAX_FIRST, DEFAULT_MAX_TOKENS, StopForward, capturing, first_call_inputs
from .discovery import NormInfo, normalized_reference
from .fitting import FitStats, analytic_input_scale, fit_module, outlier_mask, saturating_init
from .model_inputs import first_tensor, text_config
from .modules import adam_groups
from .precision import autocast, check_precision, choose_precision, forward_backward
from .roles import block_of

# per-channel alpha / beta and gamma (amplitude) and bias, all tokens at natural frequency
_CHANNEL = dict(fit=("shape", "weight", "bias"), per_channel=True, first_token_share=None)

STRATEGIES: dict[str, dict] = {
    # data-driven analytic initialization only: input scale = median token RMS / std of the captured inputs
    "analytic": dict(fit=(), per_channel=False, first_token_share=0.0),
    # the paper's fit: scalar alpha / beta, only elements whose normalized output is an outlier (|z| > threshold)
    "outliers": dict(fit=("shape",), per_channel=False, outliers_only=True, first_token_share=0.0),
    # scalar alpha / beta by least squares on all sampled tokens, first positions at their natural frequency
    "lsq": dict(fit=("shape",), per_channel=False, first_token_share=None),
    "channel": _CHANNEL,
    # as channel, but the first-position (attention-sink) tokens carry half of the loss
    "sink": dict(_CHANNEL, first_token_share=0.5),
    # as channel, then a few Adam steps on the new modules' parameters against the original model's outputs
    "kl": dict(_CHANNEL, tune_steps=30),
    # as kl, 300 end-to-end steps over 64 calibration sequences: for models whose output is hidden states (a
    # sentence encoder), whose teacher is small to keep; 64 sequences of a language model's logits would take GBs
    "encoder": dict(_CHANNEL, tune_steps=300, tune_blocks=64),
    # per-channel saturating start (fitting.saturating_init), then each block's new modules tuned so the block
    # reproduces the original block's output (sequential only), then the kl strategy's end-to-end steps
    # (the end-to-end steps over 16 sequences: over 4 they overfit them)
    "block": dict(fit=(), per_channel=True, init="saturating", block_steps=40, tune_steps=30, tune_blocks=16),
    # block's saturating start alone, sequential, nothing fitted or tuned: the cheapest start that keeps SmolLM2
    # finite (one-shot costs as much, since its pass also runs the LM head, and is worse; see BENCHMARKS.md)
    "fast": dict(fit=(), per_channel=True, init="saturating"),
    # block where any target norm is an RMSNorm, else encoder for models that output hidden states, else kl:
    # measured best on SmolLM2 (block, perplexity 631 against kl's 1e84) and on MiniLM's LayerNorms (encoder,
    # embedding cosine 0.87 against kl's 0.80 and block's 0.22); see BENCHMARKS.md
    "auto": {},
}
DEFAULT_STRATEGY = "auto"


def auto_strategy(selected: list[NormInfo], outputs_logits: bool = True) -> str:
    if any(info.kind == "rmsnorm" for info in selected):
        return "block"
    return "kl" if outputs_logits else "encoder"


def _outputs_logits(model: nn.Module) -> bool:
    """Whether the model ends in an output head (LM, masked LM, seq2seq), not in hidden states."""
    head = getattr(model, "get_output_embeddings", None)
    return head is None or head() is not None


@dataclass
class CalibrationConfig:
    """How to calibrate. Options left ``None`` take the strategy's value (:data:`STRATEGIES`).

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
    sequential: bool | None = None  # fit each norm on the partly converted model (else one capture pass)
    fit: tuple[str, ...] | None = None  # parameters to fit: "shape", "weight" (gamma incl. amplitude), "bias"
    per_channel: bool | None = None
    outliers_only: bool | None = None
    outlier_threshold: float = 3.0
    first_token_share: float | None | str = "strategy"  # None: natural frequency; 0: excluded; s: share of loss
    init: str | None = None  # "analytic" (the theory's scalar start) or "saturating" (fitting.saturating_init)
    knee: float = 0.7  # saturating init: output ceiling per channel, in units of the channel's typical value
    block_steps: int | None = None  # Adam steps per block on the block-output error (sequential only)
    block_rows: int = 4  # sequences per block-tuning step
    block_lr: float = 1e-2
    tune_steps: int | None = None
    tune_blocks: int | None = None  # sequences the end-to-end steps cycle over
    tune_lr: float = 5e-3
    shape_lr_scale: float = 1.0  # the log shape parameter's rate in block / end-to-end tuning, times block_lr / tune_lr
    max_iter: int = 100
    seed: int = 0
    precision: str = "fp32"  # or "bf16" (autocast), or "auto": bf16 where a timed probe finds it faster (precision.py)
    progress: bool = True
    plots: str | None = None
    tokenizer: Any = field(default=None, repr=False)

    def resolved(self, selected: list[NormInfo] = (), outputs_logits: bool = True) -> "CalibrationConfig":
        """The options with the strategy's presets filled in; ``auto`` becomes a strategy for ``selected`` norms of
        a model that ends in an output head (``outputs_logits``) or in hidden states."""
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown calibration strategy {self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        out = copy.copy(self)
        if out.strategy == "auto":
            out.strategy = auto_strategy(selected, outputs_logits)
        preset = dict(fit=("shape",), per_channel=False, outliers_only=False, first_token_share=None, tune_steps=0,
                      tune_blocks=4, init="analytic", block_steps=0, sequential=True)
        preset.update(STRATEGIES[out.strategy])
        for key, value in preset.items():
            current = getattr(out, key)
            if current is None or (key == "first_token_share" and current == "strategy"):
                setattr(out, key, value)
        out.fit = tuple(out.fit)
        check_precision(out.precision)
        if out.init not in ("analytic", "saturating"):
            raise ValueError(f"unknown calibration init {out.init!r}: choose 'analytic' or 'saturating'")
        return out

    def summary(self) -> dict:
        skip = {"data", "tokenizer", "progress", "plots"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["fit"] = list(out["fit"] or ())
        out["data"] = self.data if isinstance(self.data, str) else f"tensor{tuple(_ids(self.data).shape)}"
        return out


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
        from .data import fingerprint as content_fingerprint
        from .data import load_texts, token_blocks

        if config.tokenizer is None:
            raise ValueError("calibration from text needs a tokenizer: pass CalibrationConfig(tokenizer=...)")
        texts = load_texts(data, "calibration")
        fingerprint = content_fingerprint(texts)
        if _is_decoder(model):
            ids = token_blocks(config.tokenizer, texts, config.num_blocks, config.block_len)
            mask = torch.ones_like(ids)
        else:
            rows = _paragraphs(texts, config.num_blocks)
            enc = config.tokenizer(rows, truncation=True, max_length=config.block_len, padding=True,
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
        from .data import DataError

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


def _forward(model: nn.Module, batch: dict):
    kwargs = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    return model(**batch, **kwargs)


# -------------------------------------------------------------------------------------------------- fitting


class _Fitter:
    """Builds, fits and records the replacement for one norm from captured inputs."""

    def __init__(self, config: CalibrationConfig, build, per_channel: bool):
        self.config, self.build, self.per_channel = config, build, per_channel
        self.fits: dict[str, NormFit] = {}
        self.capture_bytes = 0

    def __call__(self, info: NormInfo, source: nn.Module, sample) -> nn.Module:
        cfg = self.config
        x, is_first = sample.data()
        self.capture_bytes = max(self.capture_bytes, sample.nbytes())
        scale = analytic_input_scale(x, info.kind, is_first) if x.shape[0] else 1.0
        replacement = self.build(source, info, input_scale=scale, per_channel=cfg.per_channel or self.per_channel)
        if cfg.init == "saturating" and x.shape[0]:
            saturating_init(replacement, x, info.kind, scale, is_first, cfg.knee)
        reference = copy.deepcopy(source).to("cpu", torch.float32)
        with torch.no_grad():
            target = torch.cat([reference(chunk) for chunk in x.split(4096)]) if x.shape[0] else x
        weight = self._weights(info, x, is_first, sample)
        stats = fit_module(replacement, x, target, weight=weight, params=cfg.fit, is_first=is_first,
                           max_iter=cfg.max_iter)
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

    def _weights(self, info, x, is_first, sample) -> torch.Tensor | None:
        cfg = self.config
        rows = torch.ones(x.shape[0], 1, dtype=torch.float64)
        n_first, n_plain = int(is_first.sum()), int((~is_first).sum())
        if n_first:
            share = cfg.first_token_share
            if share is None:  # natural frequency of first positions among all tokens seen
                true_ratio = sample.first.seen / max(sample.tokens.seen, 1)
                w_first = true_ratio * n_plain / n_first
            elif share >= 1 or n_plain == 0:
                w_first, rows[~is_first] = 1.0, 0.0
            else:
                w_first = share / (1 - share) * n_plain / n_first
            rows[is_first] = w_first
        weight = rows
        if cfg.outliers_only:
            normalized = normalized_reference(x.double(), info.kind, info.eps)
            weight = rows * outlier_mask(normalized, cfg.outlier_threshold)
            if weight.sum() == 0:  # no outliers at all: fall back to every element
                weight = rows
        return weight


# ---------------------------------------------------------------------------------------------- the driver


def calibrate_and_replace(model: nn.Module, selected: list[NormInfo], method: str, config: CalibrationConfig,
                          build, replace, *, per_channel: bool = False) -> CalibrationResult:
    """Fit and swap in replacements for ``selected`` norms; ``build(source, info, input_scale=, per_channel=)``
    makes a module and ``replace(model, name, module)`` sets it (both from ``convert``)."""
    config = config.resolved(selected, _outputs_logits(model))
    torch.manual_seed(config.seed)
    batches, fingerprint = calibration_batches(model, config)
    device, probe_start = _input_device(model), time.perf_counter()
    probe_params = [p for info in selected for p in model.get_submodule(info.name).parameters() if p.requires_grad]
    row = {k: v[:1] for k, v in batches[0].items()}  # one sequence: a probe, not a pass
    precision = choose_precision(config.precision, lambda: forward_backward(lambda: _forward(model, row),
                                                                            probe_params), device=device,
                                 repetitions=2)
    probe_seconds = time.perf_counter() - probe_start
    with autocast(precision.bf16, device):  # every forward / backward pass of calibration; fits stay fp32
        result = _calibrate(model, selected, config, batches, fingerprint, build, replace, per_channel)
    result.summary.update(precision=vars(precision), precision_probe_seconds=round(probe_seconds, 1))
    return result


def _calibrate(model, selected, config, batches, fingerprint, build, replace, per_channel) -> CalibrationResult:
    start, cpu_start = time.perf_counter(), time.process_time()
    fitter = _Fitter(config, build, per_channel)
    was_training = model.training
    model.eval()
    teacher = _teacher_outputs(model, batches, config) if config.tune_steps else None
    plan = _block_plan(model, selected, batches[0]) if config.sequential else None
    mode = "sequential" if plan is not None else "one-shot"
    block_tuning = []
    with torch.no_grad():
        if plan is None:
            _one_shot(model, selected, batches, fitter, replace, config)
        else:
            block_tuning = _sequential(model, plan, batches, fitter, replace, config)
    tuning = _tune(model, selected, batches, teacher, config) if config.tune_steps else None
    model.train(was_training)
    seconds = time.perf_counter() - start
    summary = dict(config.summary(), mode=mode, seconds=round(seconds, 1),
                   cpu_seconds=round(time.process_time() - cpu_start, 1),
                   tokens=int(sum(int(b["attention_mask"].sum()) for b in batches)),
                   capture_bytes_per_norm=fitter.capture_bytes,
                   peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    if fingerprint is not None:
        summary.update(data=config.data, fingerprint=fingerprint)
    if block_tuning:
        summary["block_tuning"] = block_tuning
    if tuning is not None:
        summary["tuning"] = tuning
    return CalibrationResult(fits=fitter.fits, summary=summary)


def _progress(total: int, desc: str, config: CalibrationConfig):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not config.progress, leave=False)


def _capture_kwargs(config: CalibrationConfig) -> dict:
    return dict(max_tokens=config.max_tokens_per_norm, max_first=config.max_first_per_norm, seed=config.seed)


def _one_shot(model, selected, batches, fitter, replace, config) -> None:
    """All norms fitted on activations of the original model, captured in one pass over the data."""
    modules = {info.name: model.get_submodule(info.name) for info in selected}
    with capturing(modules, **_capture_kwargs(config)) as capture, \
            _progress(len(batches), "calibration: capture", config) as bar:
        for batch in batches:
            capture.mask = batch["attention_mask"]
            _forward(model, batch)
            bar.update()
    for info in _progress_iter(selected, "calibration: fit", config):
        replace(model, info.name, fitter(info, modules[info.name], capture.samples[info.name]))


def _progress_iter(items, desc, config):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not config.progress, leave=False)


@dataclass
class _Plan:
    stack: nn.ModuleList
    pre: list[NormInfo]
    blocks: list[list[NormInfo]]  # per block, in forward order
    post: list[NormInfo]


def _block_plan(model: nn.Module, selected: list[NormInfo], batch: dict) -> _Plan | None:
    """Group norms by repeated block, in forward order, or None when they do not sit in one stack of blocks
    (encoder-decoder models have two stacks: they are calibrated in one shot)."""
    by_stack: dict[str, list[NormInfo]] = {}
    outside = []
    for info in selected:
        block = block_of(info.name)
        if block is None:
            outside.append(info)
        else:
            by_stack.setdefault(block.rpartition(".")[0], []).append(info)
    if len(by_stack) != 1:
        return None
    (stack_name, inside), = by_stack.items()
    stack = model.get_submodule(stack_name)
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        return None
    order: list[str] = []
    handles = []

    def mark(name):
        def hook(*_):
            order.append(name)
        return hook

    for info in selected:
        handles.append(model.get_submodule(info.name).register_forward_pre_hook(mark(info.name)))
    handles.append(stack[0].register_forward_pre_hook(mark("<stack start>")))
    handles.append(stack[-1].register_forward_hook(mark("<stack end>")))
    small = {k: v[:1, :16] if v.dim() == 2 else v for k, v in batch.items()}
    try:
        with torch.no_grad():
            _forward(model, small)
    finally:
        for h in handles:
            h.remove()
    if "<stack start>" not in order or "<stack end>" not in order:
        return None
    first_seen = {}
    for i, name in enumerate(order):
        first_seen.setdefault(name, i)
    begin, end = first_seen["<stack start>"], first_seen["<stack end>"]
    pre = [i for i in outside if first_seen.get(i.name, -1) < begin]
    post = [i for i in outside if first_seen.get(i.name, -1) > end]
    if len(pre) + len(post) != len(outside) or any(i.name not in first_seen for i in selected):
        return None
    index_of = {id(block): k for k, block in enumerate(stack)}
    blocks: list[list[NormInfo]] = [[] for _ in stack]
    for info in sorted(inside, key=lambda i: first_seen[i.name]):
        block = model.get_submodule(block_of(info.name))
        if id(block) not in index_of:
            return None
        blocks[index_of[id(block)]].append(info)
    key = lambda i: first_seen[i.name]  # noqa: E731
    return _Plan(stack=stack, pre=sorted(pre, key=key), blocks=blocks, post=sorted(post, key=key))


def _block_inputs(model, stack, batches) -> list[tuple]:
    """(hidden, other args, kwargs) of the first block for each batch; each forward stops at that block."""
    cached = []
    for batch in batches:
        args, kwargs = first_call_inputs(stack[0], lambda: _forward(model, batch))
        cached.append((args[0], args[1:], kwargs) if args else (kwargs.pop("hidden_states"), (), kwargs))
    return cached


def _call_block(block, hidden, args, kwargs):
    if args or not _takes_hidden_states_keyword(type(block)):
        return first_tensor(block(hidden, *args, **kwargs))
    return first_tensor(block(hidden_states=hidden, **kwargs))


@functools.cache
def _takes_hidden_states_keyword(block_class: type) -> bool:
    """Whether the block's forward names ``hidden_states`` (looked up once per class: block tuning calls blocks
    thousands of times)."""
    return "hidden_states" in inspect.signature(block_class.forward).parameters


def _capture_pass(modules, stop_after, batches, run, config, desc):
    """Capture inputs of ``modules`` while ``run(batch_index)`` executes for every batch; returns the samples."""
    with capturing(modules, stop_after=stop_after, **_capture_kwargs(config)) as capture:
        for k, batch in enumerate(batches):
            capture.mask = batch["attention_mask"]
            try:
                run(k)
            except StopForward:
                pass
        return capture.samples


def _sequential(model, plan: _Plan, batches, fitter, replace, config) -> list[dict]:
    """Convert in forward order; returns the block-tuning record (empty without ``block_steps``)."""
    total = len(plan.pre) + sum(len(b) for b in plan.blocks) + len(plan.post)
    tuning = []
    cached = _block_inputs(model, plan.stack, batches)
    # the original model's trajectory, which block tuning steers each converted block back onto
    reference = [c[0] for c in cached] if config.block_steps else None
    with _progress(total, "calibration: norms", config) as bar:
        for info in plan.pre:  # e.g. BERT's embedding LayerNorm: runs before the first block
            source = model.get_submodule(info.name)
            samples = _capture_pass({info.name: source}, info.name, batches,
                                    lambda k: _forward(model, batches[k]), config, info.name)
            replace(model, info.name, fitter(info, source, samples[info.name]))
            bar.update()
        if plan.pre:  # the blocks' inputs changed with the converted norms before them
            cached = _block_inputs(model, plan.stack, batches)
        hidden = [c[0] for c in cached]
        for index, (block, infos) in enumerate(zip(plan.stack, plan.blocks)):
            if reference is not None:  # the original block, before its norms are replaced
                reference = [_call_block(block, reference[k], cached[k][1], cached[k][2]) for k in range(len(batches))]
            for info in infos:
                source = model.get_submodule(info.name)
                samples = _capture_pass(
                    {info.name: source}, info.name, batches,
                    lambda k: _call_block(block, hidden[k], cached[k][1], cached[k][2]), config, info.name)
                replace(model, info.name, fitter(info, source, samples[info.name]))
                bar.update()
            if reference is not None and infos:
                modules = [model.get_submodule(info.name) for info in infos]
                record, hidden = _tune_block(block, modules, _block_runner(block, cached), hidden, reference,
                                             batches, config)  # the block's outputs come from its last error pass
                tuning.append(dict(block=index, **record))
                bar.set_postfix(block_error=f"{tuning[-1]['error_after']:.3g}")
            else:
                hidden = [_call_block(block, hidden[k], cached[k][1], cached[k][2]) for k in range(len(batches))]
        for info in plan.post:  # final norm: its input is the last block's output when nothing sits in between
            source = model.get_submodule(info.name)
            direct = _post_input_is_stack_output(model, source, batches[0], hidden[0])
            run = (lambda k: source(hidden[k])) if direct else (lambda k: _forward(model, batches[k]))
            samples = _capture_pass({info.name: source}, info.name, batches, run, config, info.name)
            # what the original norm makes of the original trajectory
            target = [source(r) for r in reference] if direct and reference is not None else None
            replace(model, info.name, fitter(info, source, samples[info.name]))
            if target is not None:  # tuned like one more block: it too inherits the error of everything before it
                module = model.get_submodule(info.name)
                record, _ = _tune_block(module, [module], lambda x, k, rows: module(x), hidden, target, batches,
                                        config)
                tuning.append(dict(block=info.name, **record))
            bar.update()
    return tuning


def _rows(value, rows: slice, batch_size: int):
    """``value`` (a tensor, or tuples / dicts of them) cut to ``rows`` along every leading batch dimension."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() and value.shape[0] == batch_size and batch_size > 1 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, rows, batch_size) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, batch_size) for k, v in value.items()}
    return value


def _relative_error(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over tokens of ||out - target||^2 / ||target||^2: every token counts alike, sinks at RMS 1000 too."""
    per_token = (out.float() - target.float()).pow(2).sum(-1) / target.float().pow(2).sum(-1).clamp_min(1e-12)
    if mask is not None and mask.shape == per_token.shape:
        return per_token[mask.bool()].mean()
    return per_token.mean()


@contextmanager
def _training_only(model: nn.Module, params: list[nn.Parameter]):
    """Gradients for ``params`` alone, restoring every parameter's requires_grad afterwards."""
    chosen = {id(p) for p in params}
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    try:
        with torch.enable_grad():
            yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])


def _block_runner(block, cached):
    """``run(x, k, rows)``: the block on hidden states ``x`` of those rows of batch ``k``, its other inputs cut to
    the same rows."""
    def run(x, k, rows):
        size = cached[k][0].shape[0]
        return _call_block(block, x, _rows(cached[k][1], rows, size), _rows(cached[k][2], rows, size))

    return run


def _tune_block(block, modules, run, hidden, reference, batches, config) -> tuple[dict, list[torch.Tensor]]:
    """Adam on one block's new modules: fed the converted model's hidden states, the block (``run``, see
    :func:`_block_runner`) should reproduce the original block's output on the original's hidden states. Fitting
    each norm's own output leaves the error a block inherits to grow over 30 blocks; matching the block output
    makes each block compensate for it. Returns the error record and the block's outputs with the parameters it
    keeps (the next block's inputs), taken from the error pass over all rows, which computes them anyway."""
    params = [p for m in modules for p in m.parameters(recurse=False)]
    chunks = [(k, slice(s, s + config.block_rows)) for k, h in enumerate(hidden)
              for s in range(0, h.shape[0], config.block_rows)]

    def error(k, rows):
        out = run(hidden[k][rows], k, rows)
        return _relative_error(out, reference[k][rows], batches[k]["attention_mask"][rows]), out

    def error_and_outputs():
        errors, outputs = [], [[] for _ in hidden]
        with torch.no_grad():
            for k, rows in chunks:
                value, out = error(k, rows)
                errors.append(float(value))
                outputs[k].append(out)
        return sum(errors) / len(errors), [torch.cat(parts) for parts in outputs]

    before, start_outputs = error_and_outputs()
    start = [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(adam_groups(modules, config.block_lr, config.shape_lr_scale))
    with _training_only(block, params):
        for step in range(config.block_steps):
            optimizer.zero_grad()
            loss, _ = error(*chunks[step % len(chunks)])
            if not torch.isfinite(loss):
                break
            loss.backward()
            optimizer.step()
    after, outputs = error_and_outputs()
    if not math.isfinite(after) or after > before:  # never leave the block worse than its start
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        after, outputs = before, start_outputs
    return {"error_before": round(before, 6), "error_after": round(after, 6)}, outputs


def _post_input_is_stack_output(model, source, batch, hidden) -> bool:
    call = first_call_inputs(source, lambda: _forward(model, batch))
    seen = call[0][0] if call and call[0] else None
    return isinstance(seen, torch.Tensor) and seen.shape == hidden.shape and \
        torch.allclose(seen.float(), hidden.float(), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------- tuning


def _teacher_outputs(model, batches, config) -> list[torch.Tensor]:
    """Original model outputs on the tuning blocks (one row each), computed before any norm is replaced."""
    rows = _tune_rows(batches, config)
    with torch.no_grad():
        return [first_tensor(_forward(model, row)).detach().float() for row in rows]


def _tune_rows(batches, config) -> list[dict]:
    rows = []
    for batch in batches:
        for r in range(batch["input_ids"].shape[0]):
            rows.append({k: v[r:r + 1] for k, v in batch.items()})
            if len(rows) >= config.tune_blocks:
                return rows
    return rows


def _tune(model, selected, batches, teacher, config) -> dict:
    """Adam on the new modules' parameters only: KL(original || converted) of next-token distributions for
    language models, MSE of the output (scaled by the original's mean square) otherwise."""
    rows = _tune_rows(batches, config)
    modules = [model.get_submodule(info.name) for info in selected]
    params = [p for m in modules for p in m.parameters(recurse=False)]
    best = [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(adam_groups(modules, config.tune_lr, config.shape_lr_scale))
    is_lm = teacher[0].shape[-1] == getattr(text_config(model), "vocab_size", -1)

    def loss_on(k):
        mask = rows[k]["attention_mask"].bool()
        out = first_tensor(_forward(model, rows[k])).float()
        if is_lm:
            t = torch.log_softmax(teacher[k][mask], -1)
            s = torch.log_softmax(out[mask], -1)
            return torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")
        t = teacher[k][mask]
        return (out[mask] - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)

    history = []
    with _training_only(model, params):
        with torch.no_grad():
            start_loss = sum(float(loss_on(k)) for k in range(len(rows))) / len(rows)
        best_loss = start_loss
        with _progress(config.tune_steps, "calibration: tune", config) as bar:
            for step in range(config.tune_steps):
                k = step % len(rows)
                optimizer.zero_grad()
                loss = loss_on(k)
                if not torch.isfinite(loss):
                    break
                loss.backward()
                optimizer.step()
                history.append(float(loss.detach()))
                bar.update()
                bar.set_postfix(loss=f"{history[-1]:.4g}")
                if len(rows) == 1 or (step + 1) % len(rows) == 0:  # a full pass over the tuning rows
                    epoch = sum(history[-len(rows):]) / len(rows)
                    if epoch < best_loss:
                        best_loss, best = epoch, [p.detach().clone() for p in params]
        with torch.no_grad():
            final = sum(float(loss_on(k)) for k in range(len(rows))) / len(rows)
            if not math.isfinite(final) or final > best_loss:
                for p, b in zip(params, best):
                    p.copy_(b)
                final = sum(float(loss_on(k)) for k in range(len(rows))) / len(rows)
    return {"objective": "kl" if is_lm else "relative_mse", "rows": len(rows), "steps": len(history),
            "loss_before": round(start_loss, 6), "loss_after": round(final, 6)}


# ---------------------------------------------------------------------------------------------------- plots


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


# ------------------------------------------------------------------------------------------ convert() entry


def calibrate_selected(model: nn.Module, selected: list[NormInfo], method: str, calibration, *,
                       per_channel: bool = False) -> CalibrationResult:
    """``convert``'s hook: ``calibration`` is a :class:`CalibrationConfig`, token ids, or a dict of inputs."""
    from .convert import ConversionError, build_replacement, replace_module

    if isinstance(calibration, (torch.Tensor, dict)):
        calibration = CalibrationConfig(data=calibration)
    if not isinstance(calibration, CalibrationConfig):
        raise ConversionError("calibration must be a CalibrationConfig, a token id tensor or a dict of model inputs")
    try:
        calibration.resolved()
    except ValueError as error:
        raise ConversionError(str(error)) from None

    def build(source, info, *, input_scale, per_channel):
        return build_replacement(source, info, method, input_scale=input_scale, per_channel=per_channel)

    return calibrate_and_replace(model, selected, method, calibration, build, replace_module, per_channel=per_channel)


def fit_table(report) -> str:
    """The per-norm fit statistics of a calibrated conversion report, as a text table."""
    header = (f"  {'norm':<45} {'param':>6} {'mean':>10} {'min':>10} {'max':>10} {'gamma':>7} {'resid':>9} "
              f"{'rel.err':>8} {'rel.err@0':>9} {'sat.':>6}")
    lines = ["calibration: " + ", ".join(f"{k}={report.calibration[k]}" for k in
                                         ("strategy", "mode", "tokens", "seconds") if k in report.calibration),
             header]
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
    return "\n".join(lines)
