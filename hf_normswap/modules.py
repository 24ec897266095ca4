"""Replacements for LayerNorm / RMSNorm without a per-token statistic: Dynamic Tanh (DyT), Elementwise LayerNorm
(ELN), Dynamic erf (Derf), and a fixed linear scale (``linear``, the FakeLN of the LayerNorm-removal papers).

Each computes ``y = weight * f(x) + bias``; for the element-wise ones ``|f| < 1``, so ``weight`` carries the source norm's learned
scale times the *amplitude* of the theory (``sqrt(C-1)`` for LayerNorm, ``sqrt(C)`` for RMSNorm; Stollenwerk 2025,
referenced in README.md). The shape parameter (``alpha`` for DyT and Derf, ``beta`` for ELN) is stored as a clamped
log so that any optimizer step leaves ``alpha`` finite and ``beta`` positive and finite. Arithmetic runs in fp32 and the
result is cast back to the input dtype: real models carry activations near 1000, and ``x*x`` overflows fp16 above 256.

A method is one class here and nothing elsewhere: its name, formula and citation (for the model card), the
derivatives of its ``f`` (for the fused backward, ``kernels.py``), its start for the saturating calibration and the
learning-rate factor of its shape parameter, and any scalar parameter its ``f`` takes besides the shape parameter
(:attr:`ElementwiseNorm.squash_extras`, Derf's shift). :data:`METHODS` lists the classes; the rest of the package
reads them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

LOG_ALPHA_LIMIT = 30.0  # alpha in [1e-13, 1e13]
LOG_BETA_LIMIT = 80.0  # beta in [1e-35, 5e34]; beta + x*x stays finite in fp32 for |x| < 1e17
ERF_SLOPE_RATIO = math.sqrt(math.pi) / 2  # tanh'(0) / erf'(0): Derf's alpha for the slope of a DyT with alpha 1


def amplitude_for(kind: str, size: int) -> float:
    """Largest output of the source norm per channel: sqrt(C-1) for LayerNorm, sqrt(C) for RMSNorm."""
    if kind == "layernorm":
        return math.sqrt(size - 1)
    if kind == "rmsnorm":
        return math.sqrt(size)
    raise ValueError(f"unknown norm kind {kind!r}: expected 'layernorm' or 'rmsnorm'")


def slope_at_zero(kind: str, size: int, input_scale: float) -> float:
    """dy/dx at x=0 of the source norm for inputs of standard deviation (LayerNorm) or RMS (RMSNorm) ``input_scale``.

    From the norm's differential equation dy_i/dx_i = (A^2 - y_i^2) / (C sigma) with A the amplitude.
    """
    return amplitude_for(kind, size) ** 2 / (size * input_scale)


class ElementwiseNorm(nn.Module):
    """Shared plumbing: affine parameters, shape parameter storage, dtype handling, construction from a norm."""

    key: str = ""  # the method's name: ``convert(model, key)``, ``--to key``, ``normswap.method`` in config.json
    title: str = ""  # the method's name in words, for the model card
    formula: str = ""  # the forward pass as the model card shows it
    shape_note: str = ""  # what the shape parameter is, for the model card
    citation: str = ""  # BibTeX of the method's paper
    builds_on: tuple[str, ...] = ()  # keys of the methods whose papers a card cites before this one's
    shape_name: str = ""  # "alpha" or "beta"
    log_limit: float = 0.0
    # the shape parameter goes as (input scale) ** scale_power when the curve follows the input's scale
    scale_power: int = 0
    # scalar parameters ``squash`` takes after the shape parameter, stored as they are and starting at 0: fitted with
    # the shape parameter, carried and reduced by the fused kernels, trained in the gamma / bias group
    squash_extras: tuple[str, ...] = ()
    saturates: bool = True  # f has a flat part (calibration's saturating start and the saturation log apply)

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        shape_value: float | torch.Tensor,
        *,
        per_channel: bool = False,
        bias: bool = True,
        amplitude: float = 1.0,
        kind: str = "rmsnorm",
    ):
        super().__init__()
        self.kind = kind  # the source norm's kind: the element-wise methods ignore it, ``Linear`` centres a LayerNorm
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.amplitude = float(amplitude)
        self.weight = nn.Parameter(torch.full(self.normalized_shape, self.amplitude))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape)) if bias else None
        log_shape = self.normalized_shape if per_channel else ()
        value = torch.as_tensor(shape_value, dtype=torch.float32)
        self.register_parameter(f"log_{self.shape_name}", nn.Parameter(torch.log(value).expand(log_shape).clone()))
        for name in self.squash_extras:
            self.register_parameter(name, nn.Parameter(torch.zeros(())))

    @property
    def per_channel(self) -> bool:
        return self._log_param().dim() > 0

    def _log_param(self) -> torch.Tensor:
        return getattr(self, f"log_{self.shape_name}")

    def lr_factor(self, param_name: str) -> float:
        """Learning-rate multiplier of a parameter: ``|scale_power|`` for the log shape parameter, else 1. Adam moves
        a log parameter by about the learning rate a step, so with one rate ELN's curve (log beta = 2 log scale)
        would follow a change of input scale half as fast as DyT's (log alpha = -log scale)."""
        return abs(self.scale_power) if param_name == f"log_{self.shape_name}" else 1

    def shape_parameter(self) -> torch.Tensor:
        """alpha (DyT, Derf) or beta (ELN) as used in the forward pass, in at least fp32."""
        log = self._log_param()
        return log.to(torch.promote_types(log.dtype, torch.float32)).clamp(-self.log_limit, self.log_limit).exp()

    def set_shape_parameter(self, value: float | torch.Tensor) -> None:
        with torch.no_grad():
            log = torch.log(torch.as_tensor(value, dtype=torch.float32)).clamp(-self.log_limit, self.log_limit)
            self._log_param().copy_(log.expand_as(self._log_param()))

    def extras(self) -> tuple[torch.Tensor, ...]:
        """The :attr:`squash_extras` parameters, in the order ``squash`` takes them."""
        return tuple(getattr(self, name) for name in self.squash_extras)

    def squash(self, x: torch.Tensor, shape: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        """The function f on fp32 input: element-wise with |f| < 1, or ``Linear``'s fixed scale."""
        raise NotImplementedError

    @staticmethod
    def grads(x: torch.Tensor, shape: torch.Tensor, *extras: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(f, df/dx, df/dshape, df/d each extra...)`` on fp32 input: the fused backward (``kernels.py``)
        recomputes them in one loop. A method without it runs the plain formula, with autograd's backward."""
        raise NotImplementedError

    @classmethod
    def knee_shape(cls, knee_input: torch.Tensor) -> torch.Tensor:
        """The shape parameter whose curve has slope ``1 / knee_input`` at zero (``f'(0) * knee_input = 1``): the
        saturating calibration start (``calibration.fitting.saturating_init``)."""
        return knee_input.pow(cls.scale_power)

    # Fused implementation installed by hf_normswap.kernels: (module, x, shape parameter) -> output, or None where it
    # does not apply. None here (and in checkpoints' remote code): the formula below, the reference, runs.
    fast_forward = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.shape_parameter()
        if self.fast_forward is not None:
            y = self.fast_forward(x, shape)
            if y is not None:
                return y
        return self.reference_forward(x, shape)

    def reference_forward(self, x: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        """``weight * f(x) + bias`` computed op by op; the fused path computes the same sequence in one loop."""
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32 for half types, float64 stays float64
        extras = (p.to(compute) for p in self.extras())
        y = self.squash(x.to(compute), shape.to(compute), *extras) * self.weight.to(compute)
        if self.bias is not None:
            y = y + self.bias.to(compute)
        return y.to(x.dtype)

    @classmethod
    def from_norm(
        cls,
        effective_weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        *,
        kind: str,
        normalized_shape: tuple[int, ...],
        input_scale: float = 1.0,
        per_channel: bool = False,
    ) -> "ElementwiseNorm":
        """Build from a source norm's effective scale (``w``, or ``1 + w`` for Gemma) and bias.

        ``weight = amplitude * effective_weight`` so that in the linear regime the module reproduces the norm's
        affine map; the shape parameter comes from the theory for inputs of scale ``input_scale``.
        """
        size = normalized_shape[-1]
        amplitude = cls.amplitude_of(kind, size)
        module = cls(
            normalized_shape,
            cls.analytic_shape_value(kind, size, input_scale),
            per_channel=per_channel,
            bias=bias is not None,
            amplitude=amplitude,
            kind=kind,
        )
        with torch.no_grad():
            if effective_weight is not None:
                module.weight.copy_(effective_weight.detach().float() * amplitude)
            if bias is not None:
                module.bias.copy_(bias.detach().float())
        param = next((p for p in (effective_weight, bias) if p is not None), None)
        if param is not None:
            module.to(device=param.device)
        return module

    def set_first_scale(self, first_scale: float, input_scale: float) -> None:
        """A scale of its own for the first position (``Linear``); an element-wise method bounds the sink already."""

    def common_rows(self, x: torch.Tensor, is_first: torch.Tensor) -> torch.Tensor:
        """Token rows ``(N, C)`` as :meth:`squash` without a sequence axis should see them to give what the module
        gives each in place (``is_first``: rows at position 0); the rows themselves for an element-wise method."""
        return x

    @staticmethod
    def amplitude_of(kind: str, size: int) -> float:
        """The largest output per channel that ``weight`` carries beside gamma (:func:`amplitude_for`)."""
        return amplitude_for(kind, size)

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        raise NotImplementedError

    def extra_repr(self) -> str:
        value = self.shape_parameter().detach()
        shown = f"{value.item():.4g}" if value.dim() == 0 else f"per-channel mean {value.mean().item():.4g}"
        return (
            f"{self.normalized_shape}, {self.shape_name}={shown}, amplitude={self.amplitude:.4g}, "
            f"bias={self.bias is not None}"
        )


class DyT(ElementwiseNorm):
    """Dynamic Tanh (Zhu et al. 2025): ``y = weight * tanh(alpha * x) + bias``."""

    key = "dyt"
    title = "DyT (Dynamic Tanh)"
    formula = "y = weight * tanh(alpha * x) + bias"
    shape_note = "`alpha` is one learnable scalar per module (or per channel)"
    citation = """@inproceedings{zhu2025dyt,
  title     = {Transformers without Normalization},
  author    = {Zhu, Jiachen and Chen, Xinlei and He, Kaiming and LeCun, Yann and Liu, Zhuang},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2025},
  note      = {arXiv:2503.10622}
}"""
    shape_name = "alpha"
    log_limit = LOG_ALPHA_LIMIT
    scale_power = -1  # tanh(alpha x): alpha ~ 1 / scale

    @property
    def alpha(self) -> torch.Tensor:
        return self.shape_parameter()

    def squash(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return torch.tanh(alpha * x)

    @staticmethod
    def grads(x: torch.Tensor, alpha: torch.Tensor):
        t = torch.tanh(alpha * x)
        d = 1.0 - t * t
        return t, alpha * d, x * d  # f, df/dx, df/dalpha

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        """Match the norm's slope at zero: amplitude * alpha = slope."""
        return slope_at_zero(kind, size, input_scale) / amplitude_for(kind, size)


class ELN(ElementwiseNorm):
    """Elementwise Layer Normalization / DyISRU (Stollenwerk 2025): ``y = weight * x / sqrt(beta + x^2) + bias``."""

    key = "eln"
    title = "ELN (Elementwise Layer Normalization, also published as DyISRU)"
    formula = "y = weight * x / sqrt(beta + x^2) + bias"
    shape_note = "`beta` is one learnable positive scalar per module (or per channel)"
    citation = """@article{stollenwerk2025eln,
  title   = {The Mathematical Relationship Between Layer Normalization and Dynamic Activation Functions},
  author  = {Stollenwerk, Felix},
  journal = {arXiv preprint arXiv:2503.21708},
  year    = {2025}
}"""
    builds_on = ("dyt",)  # derived from DyT: the card cites both
    shape_name = "beta"
    log_limit = LOG_BETA_LIMIT
    scale_power = 2  # x / sqrt(beta + x^2): sqrt(beta) ~ scale

    @property
    def beta(self) -> torch.Tensor:
        return self.shape_parameter()

    def squash(self, x: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(beta + x * x)

    @staticmethod
    def grads(x: torch.Tensor, beta: torch.Tensor):
        s = torch.rsqrt(beta + x * x)
        s3 = s * s * s
        return x * s, beta * s3, -0.5 * x * s3  # f, df/dx, df/dbeta

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        """Match the norm's slope at zero: amplitude / sqrt(beta) = slope."""
        return (amplitude_for(kind, size) / slope_at_zero(kind, size, input_scale)) ** 2


class Derf(ElementwiseNorm):
    """Dynamic erf (Chen et al. 2025): ``y = weight * erf(alpha * x + shift) + bias``, ``shift`` one scalar per
    module even with ``per_channel``. The shift starts at 0 (a norm's curve is odd) and alpha at DyT's times
    ``sqrt(pi) / 2``, the slope at zero of the source norm. The paper, training from scratch, starts every alpha at
    one constant and gamma at 1; a conversion starts from the norm it replaces, so that the model begins near the
    original."""

    key = "derf"
    title = "Derf (Dynamic erf)"
    formula = "y = weight * erf(alpha * x + shift) + bias"
    shape_note = ("`alpha` is one learnable scalar per module (or per channel) and `shift` one learnable scalar per "
                  "module")
    citation = """@article{chen2025derf,
  title   = {Stronger Normalization-Free Transformers},
  author  = {Chen, Mingzhi and Lu, Taiming and Zhu, Jiachen and Sun, Mingjie and Liu, Zhuang},
  journal = {arXiv preprint arXiv:2512.10938},
  year    = {2025}
}"""
    builds_on = ("dyt",)  # DyT with erf in place of tanh and a shift: the card cites both
    shape_name = "alpha"
    log_limit = LOG_ALPHA_LIMIT
    scale_power = -1  # erf(alpha x): alpha ~ 1 / scale
    squash_extras = ("shift",)

    @property
    def alpha(self) -> torch.Tensor:
        return self.shape_parameter()

    def squash(self, x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return torch.erf(alpha * x + shift)

    @staticmethod
    def grads(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor):
        u = alpha * x + shift
        d = (2.0 / math.sqrt(math.pi)) * torch.exp(-u * u)
        return torch.erf(u), alpha * d, x * d, d  # f, df/dx, df/dalpha, df/dshift

    @classmethod
    def knee_shape(cls, knee_input: torch.Tensor) -> torch.Tensor:
        return ERF_SLOPE_RATIO / knee_input  # erf'(0) = 2 / sqrt(pi)

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        """Match the norm's slope at zero: amplitude * alpha * 2 / sqrt(pi) = slope (DyT's alpha * sqrt(pi) / 2)."""
        return ERF_SLOPE_RATIO * slope_at_zero(kind, size, input_scale) / amplitude_for(kind, size)


class Linear(ElementwiseNorm):
    """A fixed linear scale (FakeLN; Heimersheim 2024, Baroni et al. 2025): ``y = weight * alpha * x + bias``, with
    ``x`` centred first (``x - mean(x)`` over the channels, still a linear map) where the source is a LayerNorm.

    ``alpha = 1 / s`` is one scalar per module, the norm's typical input scale (calibration's measured median of
    the per-token RMS / std over ordinary tokens); it stays fixed (a learning-rate factor of 0) while ``weight``
    carries the source's gamma over and is what calibration and recovery fit, so a per-channel ``alpha`` would
    only repeat ``weight`` (``per_channel`` is ignored). Nothing saturates and the amplitude is 1.

    The first position (the attention sink, 10-180x the RMS of other tokens in SmolLM2) may have a scale of its
    own while a model recovers, as the anchors kept it: ``log_first`` is ``log(alpha_0 / alpha)`` for row 0 of an
    input with a sequence axis longer than one (packed or right-padded rows; a decoding step of one token is never
    position 0), 0 for one scale. Calibration measures it (``calibration.first_scale``), the recipe hands it over
    to 0 by the end of the run (``first_scale_handover``, ``training.first_scale``); nothing trains it. A model
    whose every norm is one of these with ``log_first`` 0 is linear between its blocks' residual adds and exports
    as its original architecture (``hf_normswap.checkpoint.stock_export``).
    """

    key = "linear"
    title = "Linear (a fixed scale per module, FakeLN)"
    formula = "y = weight * alpha * x + bias   (x - mean(x) in place of x where the source is a LayerNorm)"
    shape_note = ("`alpha = 1 / s` is one fixed scalar per module, the source norm's typical input scale measured "
                  "at calibration (position 0 times `exp(log_first)`, 0 once a recovery has handed it over)")
    citation = """@article{heimersheim2024removing,
  title   = {You can remove GPT2's LayerNorm by fine-tuning},
  author  = {Heimersheim, Stefan},
  journal = {arXiv preprint arXiv:2409.13710},
  year    = {2024}
}
@article{baroni2025layernorm,
  title   = {Transformers Don't Need LayerNorm at Inference Time: Scaling LayerNorm Removal to GPT-2 XL and the
             Implications for Mechanistic Interpretability},
  author  = {Baroni, Luca and Khara, Galvin and Schaeffer, Joachim and Subkhankulov, Marat and Heimersheim, Stefan},
  journal = {arXiv preprint arXiv:2507.02559},
  year    = {2025}
}"""
    shape_name = "alpha"
    log_limit = LOG_ALPHA_LIMIT
    scale_power = -1  # alpha = 1 / scale
    squash_extras = ("log_first",)
    saturates = False

    def __init__(self, normalized_shape, shape_value, *, per_channel: bool = False, bias: bool = True,
                 amplitude: float = 1.0, kind: str = "rmsnorm"):
        super().__init__(normalized_shape, shape_value, per_channel=False, bias=bias, amplitude=amplitude, kind=kind)

    @property
    def alpha(self) -> torch.Tensor:
        return self.shape_parameter()

    @property
    def centred(self) -> bool:
        return self.kind == "layernorm"

    def lr_factor(self, param_name: str) -> float:
        """0 for ``log_alpha`` and ``log_first``: the scales stay where calibration put them (the recipe's hand-over
        moves ``log_first``); ``weight`` moves instead."""
        return 0 if param_name.startswith("log_") else 1

    def squash(self, x: torch.Tensor, alpha: torch.Tensor, log_first: torch.Tensor) -> torch.Tensor:
        y = (x - x.mean(-1, keepdim=True) if self.centred else x) * alpha
        if x.dim() < 3 or x.shape[-2] < 2:  # no sequence axis, or one decoding step
            return y
        first = log_first.clamp(-self.log_limit, self.log_limit).exp().reshape(1, 1)
        return y * torch.cat([first, torch.ones_like(first).expand(x.shape[-2] - 1, 1)])

    def set_first_scale(self, first_scale: float, input_scale: float) -> None:
        """Row 0 divided by ``first_scale`` where the other rows are divided by ``input_scale``."""
        with torch.no_grad():
            self.log_first.fill_(math.log(input_scale / first_scale))

    def common_rows(self, x: torch.Tensor, is_first: torch.Tensor) -> torch.Tensor:
        """First-position rows times ``alpha_0 / alpha``: the module is linear, so this is its first-row output."""
        factor = self.log_first.detach().to(x).exp()
        return torch.where(is_first.reshape(-1, 1).to(x.device), x * factor, x)

    @staticmethod
    def amplitude_of(kind: str, size: int) -> float:
        return 1.0

    @staticmethod
    def analytic_shape_value(kind: str, size: int, input_scale: float) -> float:
        """The source norm's slope for a token of the typical scale: ``norm(x) = gamma * x / s``."""
        return 1.0 / input_scale


DyISRU = ELN


def adam_groups(modules: list[ElementwiseNorm], lr: float) -> list[dict]:
    """Optimizer groups for the modules' parameters, each at ``lr`` times its :meth:`ElementwiseNorm.lr_factor`."""
    groups: dict[float, list[nn.Parameter]] = {}
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            groups.setdefault(lr * module.lr_factor(name), []).append(param)
    return [{"params": params, "lr": group_lr} for group_lr, params in groups.items()]


METHODS: dict[str, type[ElementwiseNorm]] = {cls.key: cls for cls in (ELN, DyT, Derf, Linear)}
DEFAULT_METHOD = next(iter(METHODS))  # what convert and the recipe take when no method is named


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Set ``new`` at dotted path ``name`` and return the module it replaced (instances only, no class patching).
    Here, with the modules, so that the remote code, which carries this file, swaps them as the package does."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old
