"""Find every normalization layer in a model and classify it by what it computes, not by its class name.

Candidates are modules that are ``nn.LayerNorm`` / ``nn.RMSNorm`` or whose class name says "Norm" (LayerNorm,
RMSNorm, T5LayerNorm, ...). Each candidate runs on a copy with randomized parameters against off-centre probe
inputs, and the output is matched against LayerNorm and RMSNorm, with the weight applied as ``w`` or as Gemma's
``1 + w``. A candidate that matches nothing is reported as skipped, never converted on a guess.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import offload

NORM_CLASS_NAME = re.compile(r"(layer|rms|ln)_?norm|norm$", re.IGNORECASE)
NOT_A_TOKEN_NORM = re.compile(r"batch|group|instance|weight_?norm|spectral", re.IGNORECASE)
WEIGHT_NAMES = ("weight", "scale", "gamma")
BIAS_NAMES = ("bias", "beta")
EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")
PROBE_TOLERANCE = 1e-3


@dataclass
class NormInfo:
    """One normalization layer: where it is and what it computes."""

    name: str
    class_name: str
    kind: str | None  # "layernorm" | "rmsnorm" | None when the probe matched nothing
    normalized_shape: tuple[int, ...]
    has_weight: bool
    has_bias: bool
    weight_offset: bool  # Gemma-style: scale is (1 + weight)
    eps: float
    role: str = "other"
    problem: str | None = None  # why it cannot be converted, when kind is None

    @property
    def size(self) -> int:
        return self.normalized_shape[-1]

    def to_dict(self) -> dict:
        return dict(asdict(self), size=self.size)


@dataclass
class _Candidate:
    name: str
    module: nn.Module
    weight: str | None = None
    bias: str | None = None
    shape: tuple[int, ...] = field(default_factory=tuple)


def is_norm_candidate(module: nn.Module) -> bool:
    """Whether a module looks like a norm: nn.LayerNorm / nn.RMSNorm, or a class named like one (T5LayerNorm...)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__
    return bool(NORM_CLASS_NAME.search(name)) and not NOT_A_TOKEN_NORM.search(name)


def _own_param(module: nn.Module, names: tuple[str, ...]) -> str | None:
    for n in names:
        if isinstance(getattr(module, n, None), nn.Parameter):
            return n
    return None


def _normalized_shape(module: nn.Module, weight: str | None, fallback: int | None) -> tuple[int, ...]:
    if weight is not None:
        return tuple(getattr(module, weight).shape)
    for attr in ("normalized_shape", "hidden_size", "dim", "normalized_size"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return (value,)
        if isinstance(value, (tuple, list, torch.Size)) and value:
            return tuple(int(v) for v in value)
    return (fallback,) if fallback else ()


def _eps(module: nn.Module) -> float:
    for n in EPS_NAMES:
        value = getattr(module, n, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1e-5


def normalized_reference(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """The source norm's output before its affine map: layer_norm, or x / rms for RMSNorm."""
    if kind == "layernorm":
        return F.layer_norm(x, x.shape[-1:], eps=eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def probe(candidate: _Candidate) -> tuple[str | None, bool, str | None]:
    """Classify by running a float32 copy with random parameters: (kind, weight_offset, problem)."""
    module = offload.cpu_copy(candidate.module)
    generator = torch.Generator().manual_seed(0)
    shape = candidate.shape
    with torch.no_grad():
        weight = bias = None
        if candidate.weight:
            weight = getattr(module, candidate.weight)
            weight.copy_(0.5 + torch.rand(weight.shape, generator=generator))
        if candidate.bias:
            bias = getattr(module, candidate.bias)
            bias.copy_(torch.randn(bias.shape, generator=generator))
        offset = 3.0 * torch.randn((6,) + (1,) * len(shape), generator=generator)
        x = torch.randn((6,) + shape, generator=generator) * 2.0 + offset
        try:
            y = module(x)
        except Exception as error:  # a norm with an unusual signature (gated norms, ...) is skipped, not guessed
            return None, False, f"probe call failed: {type(error).__name__}"
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return None, False, "probe output has an unexpected shape"
        eps = _eps(module)
        for kind in ("layernorm", "rmsnorm"):
            normalized = normalized_reference(x, kind, eps)
            for weight_offset in (False, True) if weight is not None else (False,):
                expected = normalized
                if weight is not None:
                    expected = expected * (weight + 1.0 if weight_offset else weight)
                if bias is not None:
                    expected = expected + bias
                if torch.allclose(y, expected, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
                    return kind, weight_offset, None
    return None, False, "output matches neither LayerNorm nor RMSNorm"


def find_norms(model: nn.Module) -> list[NormInfo]:
    """Every normalization layer in ``model``, classified by a numerical probe, in module order (no roles yet)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    found = []
    for name, module in model.named_modules():
        if not is_norm_candidate(module) or any(is_norm_candidate(child) for child in module.modules() if child is not module):
            continue  # containers of norms (per-head norm lists) are represented by their leaves
        weight = _own_param(module, WEIGHT_NAMES)
        bias = _own_param(module, BIAS_NAMES)
        candidate = _Candidate(name, module, weight, bias, _normalized_shape(module, weight, hidden))
        if not candidate.shape:
            kind, weight_offset, problem = None, False, "normalized size unknown"
        else:
            kind, weight_offset, problem = probe(candidate)
        found.append(
            NormInfo(
                name=name,
                class_name=type(module).__name__,
                kind=kind,
                normalized_shape=candidate.shape,
                has_weight=weight is not None,
                has_bias=bias is not None,
                weight_offset=weight_offset,
                eps=_eps(module),
                problem=problem,
            )
        )
    return found


def norm_parameters(module: nn.Module, info: NormInfo) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The source norm's effective scale (``1 + w`` where offset) and bias, as found by the probe."""
    weight_name = _own_param(module, WEIGHT_NAMES)
    bias_name = _own_param(module, BIAS_NAMES)
    weight = getattr(module, weight_name).detach() if weight_name else None
    if weight is not None and info.weight_offset:
        weight = weight.float() + 1.0
    bias = getattr(module, bias_name).detach() if bias_name else None
    return weight, bias
