"""Stock export: a model whose every norm is ``linear`` saved as its original architecture, without remote code.

A ``linear`` module computes ``w * alpha * x + b`` (``x`` centred for a LayerNorm). The original norm computes
``w' * x / sqrt(mean(x^2) + eps) + b`` (RMSNorm; LayerNorm: of the centred ``x`` over its variance), so with a huge
epsilon ``E`` the per-token statistic drowns in it and the norm is the fixed map ``w' * x * r`` with
``r = 1 / sqrt(E)``: set every norm's epsilon to ``E`` (one config key for all of them) and its weight to
``w * alpha / r`` (minus 1 where the architecture adds 1, Gemma), and the stock class computes what the package's
modules computed. ``E`` is chosen from the activations: ``mean(x^2) / E`` must stay below fp32's resolution (2^-24)
with a wide margin for every token of a probe forward at every norm, so ``sqrt(mean(x^2) + E)`` rounds to
``sqrt(E)`` in fp32; at least 1e12 (the anchors' choice). The result is checked on the probe's logits before
anything is written.

The checkpoint is the original ``model_type`` with plain transformers weights; ``config.json`` keeps the
``normswap`` record with a ``stock`` part (the epsilon and its config keys), which transformers keeps as an unused
attribute and :func:`hf_normswap.load` reads to rebuild the ``linear`` modules. An element-wise method (a tanh or
ISRU is no norm of the original architecture), a partial conversion (the other norms would get the huge epsilon
too) and a first position still scaled apart (``Linear.log_first``) are refused with one line.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from pathlib import Path

import torch
import transformers
from torch import nn

from ..discovery.norms import EPS_NAMES, find_norms
from ..model_inputs import dummy_inputs, first_tensor
from ..modules import Linear, replace_module
from ..validation import ValidationError
from . import model_card
from .directory import CheckpointError, atomic_directory, check_output_dir
from .record import ConversionRecord, OriginalArchitecture

EPS_SUFFIXES = ("_eps", "epsilon")  # rms_norm_eps, layer_norm_eps, layer_norm_epsilon
MIN_EPS = 1e12
MARGIN = 2.0 ** 40  # E / max mean(x^2): 2^24 is fp32's resolution, the rest a margin for other inputs
TOLERANCE = 1e-5  # the probe's logits, relative to their largest magnitude


class StockExportError(CheckpointError):
    """The model cannot be saved as its stock architecture; the message says why."""


def check_exportable(model: nn.Module) -> ConversionRecord:
    """The model's record, or :class:`StockExportError` naming why it cannot be exported (module doc)."""
    try:
        record = ConversionRecord.of(model)
    except ValidationError as error:
        raise StockExportError(str(error)) from None
    if record is None:
        raise StockExportError("the model is not converted: convert it with --to linear first")
    modules = {name: model.get_submodule(name) for name in record.converted}
    other = sorted({type(m).__name__ for m in modules.values() if not isinstance(m, Linear)})
    if other:
        raise StockExportError(f"its norms are {', '.join(other)}, element-wise functions no stock norm computes: "
                               "only a model whose every norm is `linear` exports (normswap convert DIR --to linear)")
    found = find_norms(model)
    if found:
        raise StockExportError(f"a partial conversion: {len(found)} norm(s) kept ({found[0].name}, ...) would get the "
                               "export's huge epsilon too; convert every norm (--roles all) to export")
    scaled = [name for name, m in modules.items() if bool(m.log_first.detach().ne(0).any())]
    if scaled:
        raise StockExportError(f"{scaled[0]} (and {len(scaled) - 1} more) still gives position 0 a scale of its own: "
                               "recover the model (the recipe hands it over) or set log_first to 0 before exporting")
    return record


def choose_eps(model: nn.Module, inputs: dict) -> float:
    """The epsilon for the probe's activations: ``MARGIN`` times the largest ``mean(x^2)`` at any linear module's
    input, as a power of ten, at least :data:`MIN_EPS`."""
    largest = [0.0]

    def hook(module, args):
        x = args[0].detach().double()
        x = x - x.mean(-1, keepdim=True) if module.centred else x
        largest[0] = max(largest[0], float(x.pow(2).mean(-1).max()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Linear)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return max(MIN_EPS, 10.0 ** math.ceil(math.log10(max(largest[0], 1e-30) * MARGIN)))


def _eps_keys(config) -> list[str]:
    keys = [k for k, v in config.to_dict().items() if k.endswith(EPS_SUFFIXES) and isinstance(v, float)]
    if not keys:
        raise StockExportError(f"{type(config).__name__} has no epsilon setting (*_eps, *epsilon) for its norms")
    return keys


def stock_model(model: nn.Module, record: ConversionRecord, eps: float) -> nn.Module:
    """The original architecture with every norm at epsilon ``eps`` and the weights that make it the linear model."""
    architecture = record.base.architecture if record.base else type(model).__name__
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise StockExportError(f"transformers has no class {architecture} to export to")
    config = copy.deepcopy(model.config)
    config.architectures = [architecture]
    if hasattr(config, "auto_map"):
        del config.auto_map
    keys = _eps_keys(config)
    for key in keys:
        setattr(config, key, eps)
    dtype = next(model.parameters()).dtype
    stock = cls(config).to(dtype).eval()
    state = {k: v for k, v in model.state_dict().items()
             if not any(k.startswith(f"{name}.log_") for name in record.converted)}
    for name in record.converted:
        norm, module = stock.get_submodule(name), model.get_submodule(name)
        if not math.isclose(_eps_of(norm) or 0.0, eps, rel_tol=1e-6):
            raise StockExportError(f"{architecture}'s norm {name} does not read its epsilon from {', '.join(keys)}: "
                                   "it cannot be made linear through the config")
        factor, offset = gain(norm, module.normalized_shape)
        weight = module.weight.detach().double() * module.alpha.detach().double() / factor
        state[f"{name}.weight"] = (weight - 1 if offset else weight).to(module.weight.dtype)
    stock.load_state_dict(state, strict=True)
    base = record.base or OriginalArchitecture(architecture, type(config).__name__, config.model_type)
    dataclasses.replace(record, base=base, stock={"eps": eps, "eps_keys": keys}).attach(stock)
    return stock


def _response(norm: nn.Module, shape: tuple[int, ...], weight: float) -> float:
    """A stock norm's output over its input for a centred input (LayerNorm and RMSNorm see the same), its weight
    filled with ``weight`` and its bias with 0."""
    probe = copy.deepcopy(norm).float()
    with torch.no_grad():
        for name, param in probe.named_parameters():
            param.fill_(0.0 if name == "bias" else weight)
        x = torch.zeros(shape)
        x[0], x[-1] = 1.0, -1.0
        return float(probe(x)[0].double() / x[0])


def gain(norm: nn.Module, shape: tuple[int, ...]) -> tuple[float, bool]:
    """(``r``, whether the norm scales by ``1 + weight``): the export's epsilon makes the statistic vanish, so the
    probe is this, not ``discovery.norms``' (which tells LayerNorm from RMSNorm by the statistic)."""
    offset = _response(norm, shape, 0.0) != 0
    return _response(norm, shape, 0.0 if offset else 1.0), offset


def _eps_of(norm: nn.Module) -> float | None:
    return next((getattr(norm, n) for n in EPS_NAMES if isinstance(getattr(norm, n, None), float)), None)


def check_logits(model: nn.Module, stock: nn.Module, inputs: dict) -> float:
    """Largest logit difference of ``stock`` against ``model`` on ``inputs``, relative to the largest logit;
    :class:`StockExportError` above :data:`TOLERANCE`."""
    with torch.no_grad():
        ours, theirs = first_tensor(model(**inputs)).double(), first_tensor(stock(**inputs)).double()
    difference = float((ours - theirs).abs().max() / ours.abs().max().clamp_min(1e-30))
    if not difference <= TOLERANCE:
        raise StockExportError(f"the stock model's logits differ by {difference:.3g} of their size from the linear "
                               "model's (tolerance 1e-5): not exported")
    return difference


def export_stock(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None, overwrite: bool = False,
                 inputs: dict | None = None) -> tuple[Path, float, float]:
    """Save a ``linear`` model as its original architecture in ``directory``; returns (directory, epsilon, the
    probe's relative logit difference). Checked before anything is written."""
    record = check_exportable(model)
    check_output_dir(directory, overwrite)
    inputs = inputs if inputs is not None else dummy_inputs(model, batch=2, seq_len=32)
    eps = choose_eps(model, inputs)
    stock = stock_model(model, record, eps)
    difference = check_logits(model, stock, inputs)
    with atomic_directory(directory, overwrite) as staging:
        transformers.PreTrainedModel.save_pretrained(stock, staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config = json.loads((staging / "config.json").read_text())
        (staging / "README.md").write_text(model_card.render_stock(config))
    return Path(directory), eps, difference


def load_stock(path: str | os.PathLike, record: ConversionRecord, **kwargs) -> nn.Module:
    """A stock export loaded by transformers' own class, its norms turned back into the ``linear`` modules they
    compute (``alpha = r``, the norm's weight as ``weight``), the record's ``stock`` part dropped: the model is a
    converted one again, and saves as one."""
    model = getattr(transformers, record.base.architecture).from_pretrained(path, **kwargs)
    for name, entry in record.converted.items():
        norm = model.get_submodule(name)
        shape = tuple(norm.weight.shape)
        factor, offset = gain(norm, shape)
        weight = norm.weight.detach() + 1 if offset else norm.weight.detach()
        bias = getattr(norm, "bias", None)
        module = Linear(shape, factor, bias=bias is not None, kind=entry.kind)
        with torch.no_grad():
            module.weight.copy_(weight.float())
            if bias is not None:
                module.bias.copy_(bias.detach().float())
        module.to(device=weight.device)
        for param in (module.weight, module.bias):
            if param is not None:
                param.data = param.data.to(weight.dtype)
        replace_module(model, name, module)
    dataclasses.replace(record, stock=None).attach(model)
    return model
