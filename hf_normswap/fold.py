"""Inference folding: move a converted norm's ``weight`` (gamma) and ``bias`` into the linear layers it feeds.

Where every consumer of a norm's output is a linear map ``y = W h + c`` (attention q/k/v, MLP gate/up), then
``W (g * f + b) + c = (W diag g) f + (W b + c)``: scaling the input columns of ``W`` by ``g`` and adding ``W b`` to
``c`` leaves the model's function unchanged (up to fp32 rounding) and the norm computes the bare ``f(x)``.

Consumers are found by behaviour, not by name: one forward pass on a small dummy input with

* forward hooks recording each norm's output tensor and each linear layer's input tensor, and
* a ``TorchFunctionMode`` watching every torch operation that touches a norm output outside a linear layer.

A norm is folded only when its output reaches nothing but ``nn.Linear`` / transformers ``Conv1D`` layers (views
that keep the channel dimension, like ``h[:, -1:, :]``, and shape queries are followed), and every such layer
takes input from that norm alone and owns its weight. Refused, with the reason in the report: a norm whose output
also feeds a residual add or anything else, a linear layer whose weight is tied (the final norm before an
``lm_head`` tied to the input embeddings: folding would change the embeddings), a layer shared between norms or
called on other inputs, and a norm with a non-zero bias feeding a layer without a bias.

After folding the norm keeps its parameters, set to ``weight = 1`` and ``bias = 0``: the state dict has the same
keys and shapes, so a folded model saves and reloads like any converted one (the folded linear weights carry
gamma). The record's ``folded`` part (``ConversionRecord``) lists each folded norm with its consumers. Folding is for inference:
the norm's ``weight`` no longer means the source norm's gamma, so fine-tune before folding, not after.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from . import kernels
from .checkpoint.record import ConversionRecord
from .model_inputs import dummy_inputs
from .modules import ElementwiseNorm

try:
    from transformers.pytorch_utils import Conv1D  # GPT-2 style: y = h @ W + c with W of shape (in, out)
except ImportError:  # pragma: no cover
    Conv1D = None

LINEAR_TYPES = (nn.Linear,) + ((Conv1D,) if Conv1D is not None else ())
METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_meta",
                       "is_sparse", "is_quantized", "is_nested", "names", "grad_fn"}
METADATA_METHODS = {"size", "dim", "numel", "is_floating_point", "is_contiguous", "stride", "get_device",
                    "element_size", "nelement", "is_complex"}
VIEW_METHODS = {"view", "reshape", "contiguous", "__getitem__", "flatten", "unflatten"}


class FoldError(ValueError):
    """The model cannot be probed for folding; the message says why."""


@dataclass
class FoldReport:
    folded: dict[str, list[str]] = field(default_factory=dict)  # norm name -> consumer layer names
    skipped: list[dict] = field(default_factory=list)  # {"name", "reason"}

    def __str__(self) -> str:
        lines = [f"folded {len(self.folded)} of {len(self.folded) + len(self.skipped)} norms into their linear layers"]
        for name, consumers in self.folded.items():
            lines.append(f"  {name:<55} -> {', '.join(c.rsplit('.', 1)[-1] for c in consumers)}")
        for s in self.skipped:
            lines.append(f"  not folded {s['name']}: {s['reason']}")
        return "\n".join(lines)


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a Tensor property: the descriptor names it
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return name


def _keeps_channels(func_name: str, source: torch.Tensor, out, args) -> bool:
    """A view of ``source`` whose last dimension is still the norm's channel dimension, element for element."""
    if func_name not in VIEW_METHODS or not isinstance(out, torch.Tensor) or out.dim() == 0 or source.dim() == 0:
        return False
    if out.shape[-1] != source.shape[-1]:
        return False
    if func_name != "__getitem__":
        return True
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis or i is None for i in index):
        return len(index) > 0 and index[-1] == slice(None)
    return len(index) < source.dim() or index[-1] == slice(None)


class _Probe(TorchFunctionMode):
    """Watches torch operations on norm outputs during one forward pass."""

    def __init__(self, tracked: dict, stack: list, linear_inputs: dict, problems: dict):
        super().__init__()
        self.tracked, self.stack, self.linear_inputs, self.problems = tracked, stack, linear_inputs, problems

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hits = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) in self.tracked]
        if not hits:
            return out
        name = _func_name(func)
        inner_name, inner = self.stack[-1] if self.stack else ("", None)
        for tensor in hits:
            norm, _ = self.tracked[id(tensor)]
            if isinstance(inner, LINEAR_TYPES) and self.linear_inputs.get(inner_name, (None, None))[1] is tensor:
                continue  # inside the consuming linear layer
            if name.lstrip(".") in METADATA_ATTRIBUTES | METADATA_METHODS:
                continue
            if _keeps_channels(name, tensor, out, args):
                self.tracked[id(out)] = (norm, out)
                continue
            where = f" in {inner_name}" if inner_name else ""
            self.problems.setdefault(norm, f"its output feeds {name or func}{where}, not only linear layers")
        return out


def find_consumers(model: nn.Module, norm_names: list[str], inputs: dict | None = None) -> tuple[dict, dict]:
    """({norm: [linear layer names]}, {norm: reason it cannot be folded}) from one probing forward pass."""
    modules = dict(model.named_modules())
    tracked: dict[int, tuple[str, torch.Tensor]] = {}
    stack: list[tuple[str, nn.Module]] = []
    linear_inputs: dict[str, tuple[str | None, torch.Tensor]] = {}  # last call's (norm or None, input)
    consumers: dict[str, set[str]] = defaultdict(set)
    linear_sources: dict[str, set] = defaultdict(set)
    problems: dict[str, str] = {}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            stack.append((name, module))
            if isinstance(module, LINEAR_TYPES):
                x = args[0] if args else next(iter(kwargs.values()), None)
                source = tracked.get(id(x), (None, None))[0] if isinstance(x, torch.Tensor) else None
                linear_inputs[name] = (source, x)
                linear_sources[name].add(source)
                if source is not None:
                    consumers[source].add(name)
        return hook

    def post(name):
        def hook(module, args, output):
            stack.pop()
            if name in norm_names and isinstance(output, torch.Tensor):
                tracked[id(output)] = (name, output)
        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name)))
    try:
        if inputs is None:
            inputs = dummy_inputs(model, batch=1, seq_len=8)
        with torch.no_grad(), kernels.fallback(), _Probe(tracked, stack, linear_inputs, problems):
            output = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    output = output.to_tuple() if hasattr(output, "to_tuple") else output
    for leaf in _pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and id(leaf) in tracked:
            problems.setdefault(tracked[id(leaf)][0], "its output is also an output of the model (a hidden state)")
    return {n: sorted(consumers[n]) for n in norm_names}, _layer_problems(modules, norm_names, consumers, linear_sources,
                                                                        problems)


def _layer_problems(modules, norm_names, consumers, linear_sources, problems) -> dict:
    owners: dict[int, int] = defaultdict(int)
    for module in modules.values():
        for param in module.parameters(recurse=False):
            owners[id(param)] += 1
    for norm in norm_names:
        if norm in problems:
            continue
        if not consumers.get(norm):
            problems[norm] = "its output reaches no linear layer in a forward pass"
            continue
        module = modules[norm]
        for layer_name in sorted(consumers[norm]):
            layer = modules[layer_name]
            if linear_sources[layer_name] != {norm}:
                problems[norm] = f"{layer_name} also takes input from elsewhere"
            elif owners[id(layer.weight)] > 1:
                problems[norm] = f"{layer_name} has a tied weight (e.g. lm_head tied to the embeddings)"
            elif _in_features(layer) != module.weight.numel() or module.weight.dim() != 1:
                problems[norm] = f"{layer_name} input size {_in_features(layer)} differs from the norm's channels"
            elif module.bias is not None and layer.bias is None and bool((module.bias != 0).any()):
                problems[norm] = f"the norm has a bias and {layer_name} has none to take it"
            else:
                continue
            break
    return problems


def _is_conv1d(layer: nn.Module) -> bool:
    return Conv1D is not None and isinstance(layer, Conv1D)


def _in_features(layer: nn.Module) -> int:
    return layer.weight.shape[0] if _is_conv1d(layer) else layer.weight.shape[1]


@torch.no_grad()
def _fold_one(norm: ElementwiseNorm, layers: list[nn.Module]) -> None:
    gamma = norm.weight.double()
    beta = norm.bias.double() if norm.bias is not None else None
    for layer in layers:
        weight = layer.weight.double()
        conv1d = _is_conv1d(layer)  # y = h @ W + c, W is (in, out)
        if beta is not None and layer.bias is not None:
            shift = beta @ weight if conv1d else weight @ beta
            layer.bias.copy_((layer.bias.double() + shift).to(layer.bias.dtype))
        scaled = weight * (gamma[:, None] if conv1d else gamma[None, :])
        layer.weight.copy_(scaled.to(layer.weight.dtype))
    norm.weight.fill_(1.0)
    if norm.bias is not None:
        norm.bias.zero_()


def fold(model: nn.Module, names: list[str] | None = None, inputs: dict | None = None) -> FoldReport:
    """Fold every converted norm (or those in ``names``) whose consumers are all linear layers, in place."""
    norms = {n: m for n, m in model.named_modules() if isinstance(m, ElementwiseNorm)}
    if names is not None:
        missing = sorted(set(names) - set(norms))
        if missing:
            raise FoldError(f"not converted element-wise modules: {', '.join(missing)}")
        norms = {n: norms[n] for n in names}
    if not norms:
        raise FoldError("the model has no element-wise modules: convert it before folding")
    consumers, problems = find_consumers(model, list(norms), inputs)
    report = FoldReport()
    for name, norm in norms.items():
        reason = problems.get(name)  # a layer fed by two norms is among them: its sources are not {norm}
        if reason:
            report.skipped.append({"name": name, "reason": reason})
            continue
        _fold_one(norm, [model.get_submodule(layer) for layer in consumers[name]])
        report.folded[name] = consumers[name]
    ConversionRecord.amend(model, folded=report.folded)
    return report
