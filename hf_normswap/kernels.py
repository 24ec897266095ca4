"""Fast path for the element-wise norms: one fused kernel per forward and per backward, compiled on first use.

Eager PyTorch runs ``weight * f(x) + bias`` as five or six passes over memory, one per operator, and autograd
keeps three or four intermediate tensors for the backward. Here the forward is the module's own formula
(:meth:`ElementwiseNorm.reference_forward`) compiled by ``torch.compile`` into a single loop, and the backward is
a custom :class:`torch.autograd.Function` that saves only the input and recomputes ``f`` in one fused loop.

When is it used? Only where it is safe and worth it; everything else runs the plain formula (the *fallback*):

* CPU and CUDA tensors of dtype fp32 / bf16 / fp16 with at least :data:`MIN_NUMEL` elements (below that the
  compiled call costs more than it saves, and tiny test models never trigger a compile), the module's parameters on
  the input's device. On CUDA, where triton is installed, the hand-written kernels of
  :mod:`hf_normswap.triton_kernels` run instead, at any size (no compile, no guards a call): the eager formula's
  five or six kernel launches and memory passes become one (tests/test_triton_kernels.py checks the values,
  scripts/benchmarks/bench_kernels.py the speed);
* not while scripting, tracing, exporting or compiling (a user's ``torch.compile`` fuses the plain formula into
  its own graph), not for meta / fake / functorch-wrapped tensors;
* once a kernel fails to compile (no C++ compiler, ...) its key is marked broken and the fallback runs silently.

Values: the forward is the same sequence of fp32 operations, so on the CPU ELN is bit-identical to the fallback;
DyT and Derf may differ in the last bit of ``tanh`` / ``erf`` (the compiled kernel uses SLEEF, eager may use MKL),
and on CUDA any may differ in the last bits (Triton's ``tanh`` / ``erf`` / ``rsqrt`` and fused multiply-adds).
Gradients agree to fp32 rounding (different summation order); a method's scalar extras (Derf's shift) are carried
and their gradients reduced like the shape parameter's. The fused backward is not differentiable again: for second-order
gradients use the fallback. ``HF_NORMSWAP_FALLBACK=1`` in the environment, :func:`set_fast_path`
or the :func:`fallback` context manager force the plain formula, e.g. in tests.

The first compile in a process costs ~10-20 s (inductor start-up) and ~1 s per further key (method, C, dtypes,
bias, per-channel); inductor's on-disk cache makes later processes faster. Compiles are lazy: nothing happens
until a large enough input arrives.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import types

import torch
from torch.autograd.function import once_differentiable

from .modules import METHODS, ElementwiseNorm

ENV_FALLBACK = "HF_NORMSWAP_FALLBACK"
MIN_NUMEL = 1 << 16  # below ~64k elements eager is as fast as a compiled call (measured: scripts/benchmarks/bench_norms.py)
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAST_DEVICES = ("cpu", "cuda")  # where torch.compile has a backend: C++ / OpenMP on the CPU, Triton on CUDA

_enabled = os.environ.get(ENV_FALLBACK, "").strip().lower() in ("", "0", "false", "no")
_lock = threading.Lock()
_kernels: dict[tuple, object] = {}


def set_fast_path(enabled: bool) -> None:
    """Turn the fused path on or off for the whole process (the environment variable sets the start value)."""
    global _enabled
    _enabled = bool(enabled)


def fast_path_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def fallback():
    """Run the plain formula inside the block."""
    previous = _enabled
    set_fast_path(False)
    try:
        yield
    finally:
        set_fast_path(previous)


# ---------------------------------------------------------------------------------------------- kernels
def _make_forward(squash):
    def forward(x, shape, weight, bias, *extras):
        """The module's formula (``ElementwiseNorm.reference_forward``) on a 2-D ``(tokens, C)`` view."""
        y = squash(None, x.float(), shape, *(e.float() for e in extras)) * weight.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    return forward


def _make_backward(grads):
    def backward(x, shape, weight, grad_out, has_bias: bool, *extras):
        """(grad x in the input dtype, grad shape, grad weight, grad bias, grads of the scalar extras, in fp32),
        reduced over tokens."""
        xf = x.float()
        g = grad_out.float()
        f, dfdx, dfds, *dfde = grads(xf, shape, *(e.float() for e in extras))
        gw = g * weight.float()
        grad_x = (gw * dfdx).to(x.dtype)
        grad_shape = (gw * dfds).sum(0)
        if shape.numel() == 1:  # one value for every channel: a scalar, or FSDP2's 1-element vector of it
            grad_shape = grad_shape.sum().reshape(shape.shape)
        grad_weight = (g * f).sum(0)
        grad_bias = g.sum(0) if has_bias else None
        grad_extras = tuple((gw * d).sum().reshape(e.shape) for d, e in zip(dfde, extras))
        return grad_x, grad_shape, grad_weight, grad_bias, grad_extras

    return backward


class _Kernel:
    """One eager function and its lazily ``torch.compile``'d copy for one key (direction, method, C, dtypes...).

    The copy gets its own code object, so each key has its own dynamo cache (the recompile limit is per code
    object) and one key's recompiles never evict another's. A failed compile marks the key broken for good.
    """

    def __init__(self, key: tuple, fn):
        self.key, self.eager, self.compiled, self.broken = key, fn, None, False

    def __call__(self, x2d: torch.Tensor, *args):
        if not self.broken:
            if self.compiled is None:
                code = self.eager.__code__.replace(co_name=f"normswap_{self.key[0]}_{len(_kernels)}")
                copy = types.FunctionType(code, self.eager.__globals__, code.co_name, None, self.eager.__closure__)
                self.compiled = torch.compile(copy, fullgraph=True, dynamic=None)
            torch._dynamo.maybe_mark_dynamic(x2d, 0)  # one compile serves every number of tokens
            try:
                return self.compiled(x2d, *args)
            except Exception:  # no compiler, unsupported build, ...: the plain formula is always correct
                self.broken = True
        return self.eager(x2d, *args)


def _kernel(key: tuple, make, what) -> _Kernel:
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.setdefault(key, _Kernel(key, make(what)))
    return kernel


class _FusedNorm(torch.autograd.Function):
    """Forward: one fused kernel. Saves only the input and parameters; backward recomputes f in one fused kernel."""

    @staticmethod
    def forward(ctx, forward_kernel, backward_kernel, x2d, shape, weight, bias, *extras):
        y = forward_kernel(x2d, shape, weight, bias, *extras)
        ctx.save_for_backward(x2d, shape, weight, *extras)
        ctx.backward_kernel, ctx.has_bias = backward_kernel, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable  # double backward (gradient penalties): set HF_NORMSWAP_FALLBACK=1
    def backward(ctx, grad_out):
        x2d, shape, weight, *extras = ctx.saved_tensors
        grad_x, grad_shape, grad_weight, grad_bias, grad_extras = ctx.backward_kernel(
            x2d, shape, weight, grad_out.contiguous(), ctx.has_bias, *extras
        )
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        grad_extras = (g.to(e.dtype) for g, e in zip(grad_extras, extras))
        return (None, None, grad_x, grad_shape.to(shape.dtype), grad_weight.to(weight.dtype), grad_bias,
                *grad_extras)


def _on_triton(x: torch.Tensor) -> bool:
    """CUDA tensors run hf_normswap.triton_kernels (no compile, so no size threshold) where triton is installed."""
    return x.device.type == "cuda" and x.numel() > 0 and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _usable(x: torch.Tensor, module: ElementwiseNorm, shape: torch.Tensor) -> bool:
    if not _enabled or (x.numel() < MIN_NUMEL and not _on_triton(x)):
        return False
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:  # fake tensors, subclasses
        return False
    if x.device.type not in FAST_DEVICES or x.dtype not in FAST_DTYPES or shape.dtype != torch.float32:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(x) or torch._C._are_functorch_transforms_active():
        return False
    weight, bias = module.weight, module.bias
    if weight.dtype not in FAST_DTYPES or (bias is not None and bias.dtype not in FAST_DTYPES):
        return False
    if weight.device != x.device or shape.device != x.device or (bias is not None and bias.device != x.device):
        return False
    if weight.shape != x.shape[-1:] or type(module).squash not in _GRADS:
        return False
    return all(e.dtype in FAST_DTYPES and e.device == x.device for e in module.extras())


_GRADS: dict = {}  # squash function -> its derivatives (the class's ``grads``), for the classes registered


def register(cls: type[ElementwiseNorm]) -> None:
    """Let ``cls`` use the fused path; a class without :meth:`ElementwiseNorm.grads` keeps the plain formula."""
    if cls.grads is not ElementwiseNorm.grads:
        _GRADS[cls.squash] = cls.grads


def fused_forward(module: ElementwiseNorm, x: torch.Tensor, shape: torch.Tensor) -> torch.Tensor | None:
    """The module's output through the fused kernels, or None when the fallback must run."""
    if not _usable(x, module, shape):
        return None
    if _on_triton(x):
        from . import triton_kernels  # lazy: it imports triton, optional (CUDA, the test extra)

        y = triton_kernels.module_norm(module, x, shape)
        if y is not None:
            return y
    cls, weight, bias, extras = type(module), module.weight, module.bias, module.extras()
    key = (cls.squash, x.device, x.shape[-1], x.dtype, weight.dtype, None if bias is None else bias.dtype, shape.dim(),
           tuple((e.dtype, e.dim()) for e in extras))
    forward = _kernel(("fwd",) + key, _make_forward, cls.squash)
    x2d = x.reshape(-1, x.shape[-1])
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or shape.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        or any(e.requires_grad for e in extras)
    )
    if needs_grad:
        backward = _kernel(("bwd",) + key, _make_backward, _GRADS[cls.squash])
        y = _FusedNorm.apply(forward, backward, x2d, shape, weight, bias, *extras)
    else:
        y = forward(x2d, shape, weight, bias, *extras)
    return y.view(x.shape)


def install() -> None:
    """Route every element-wise module's forward through :func:`fused_forward`. ``hf_normswap.convert`` and
    ``hf_normswap.load`` call it; importing the package does not. Call it yourself for modules built by hand."""
    for cls in set(METHODS.values()):
        register(cls)
    ElementwiseNorm.fast_forward = fused_forward
