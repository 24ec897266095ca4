"""Triton kernels for the element-wise norms on CUDA: one pass over memory forward, one backward, no host-side compile.

On a GPU an element-wise norm is bound by memory: it reads and writes each value once, so a call should cost about
a device memory copy. ``torch.compile``'s kernels reach that on the device, but every call also pays the compiled
function's guards on the host, which at a few tens of microseconds a call is most of its time. These kernels are
compiled by Triton once per signature and launched directly.

The structure follows Liger-Kernel's Triton DyT (``src/liger_kernel/ops/dyt.py``): the forward is one program per
row (and column block) computing in fp32; the backward runs a fixed number of programs per column block, each
walking rows with a stride, writing ``dx`` and accumulating the parameter gradients in fp32 registers; the
per-program partial sums are then added across programs in fp32 by torch. Where it differs, and why:

* **one kernel for every method**: the element function ``f`` and its two derivatives are a ``@triton.jit``
  function chosen by a ``tl.constexpr`` method id (:func:`_element`), so a method adds its id and branch and nothing
  else. Device code cannot live in the torch-only ``modules.py`` (checkpoints copy it), so this is the one place
  outside it that a method with a Triton kernel touches; a method without one runs the compiled CPU-style path. The
  kernels carry an optional per-tensor *shift* (Derf's ``erf(alpha * x + shift)``: a module's one scalar extra,
  ``modules.ElementwiseNorm.squash_extras``), loaded, differentiated and reduced like the shape parameter;
* **the shape parameter per tensor or per channel**: a constexpr picks a scalar or a column load; its gradient is
  accumulated per column either way and summed over columns by torch when it is one value (Liger: per tensor only);
* **the shape parameter arrives as its value** (``alpha`` or ``beta``, fp32), not as the clamped log the module
  stores (``modules.ElementwiseNorm.shape_parameter``): autograd carries its gradient through the clamp and ``exp``,
  a scalar-sized op, so the kernels know nothing of the storage;
* **ELN's** ``x * rsqrt(beta + x^2)`` and its derivatives ``beta * r^3`` and ``-x * r^3 / 2``; **DyT's** ``tanh``
  from ``exp`` (:func:`_tanh`) rather than libdevice's, because Triton's CPU interpreter, which tests these kernels
  in CI, has no libdevice;
* **rows on the first grid axis** (CUDA allows 2^31 - 1 blocks there, 65,535 on the second: Liger's rows-second
  grid fails above 65,535 tokens); 64-bit offsets;
* **no autotuning**: the block and warp counts follow the width (:func:`_launch`); tuning at first call would cost
  seconds per signature (method, dtypes, bias, per-channel) in every process;
* **weight and bias in their own dtypes** (fp32 or the model's), their gradients returned in them; ``dx`` in the
  input's dtype.

The remote code of saved checkpoints keeps the plain formula: a checkpoint never needs Triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .modules import METHODS

ELN: tl.constexpr = tl.constexpr(0)
DYT: tl.constexpr = tl.constexpr(1)
DERF: tl.constexpr = tl.constexpr(2)
# hf_normswap.modules.METHODS names -> the ids _element branches on
METHOD_IDS = {"eln": ELN.value, "dyt": DYT.value, "derf": DERF.value}

MAX_BLOCK = 4096  # columns a program handles; wider rows are split over programs on the second grid axis
BACKWARD_PROGRAMS_PER_SM = 2  # row-walking backward programs per column block, per multiprocessor
CPU_BACKWARD_PROGRAMS = 3  # the interpreter on CPU tensors: few, but more than one, so the partial sums are tested


@triton.jit
def _tanh(z):
    """tanh in fp32 from exp: (1 - e) / (1 + e) with e = exp(-2|z|); below |z| = 0.3, where the quotient loses digits
    to cancellation, its odd Taylor series to z^13 (the first omitted term is below 1e-10 relative there)."""
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = -1382.0 / 155925.0 + a2 * (21844.0 / 6081075.0)
    series = 62.0 / 2835.0 + a2 * series
    series = -17.0 / 315.0 + a2 * series
    series = 2.0 / 15.0 + a2 * series
    series = -1.0 / 3.0 + a2 * series
    small = a + a * a2 * series
    t = tl.where(a < 0.3, small, big)
    return tl.where(z < 0, -t, t)


@triton.jit
def _element(x, s, shift, METHOD: tl.constexpr):
    """``(f, df/dx, df/ds, df/dshift)`` of the method's element function at fp32 ``x``, shape parameter ``s`` and
    shift (0 for methods without one)."""
    if METHOD == ELN:  # x / sqrt(beta + x^2)
        r = tl.math.rsqrt(s + x * x)
        r3 = r * r * r
        return x * r, s * r3, -0.5 * x * r3, 0.0 * x
    elif METHOD == DYT:  # tanh(alpha * x)
        t = _tanh(s * x)
        d = 1.0 - t * t
        return t, s * d, x * d, 0.0 * x
    else:  # DERF: erf(alpha * x + shift)
        u = s * x + shift
        d = 1.1283791670955126 * tl.exp(-u * u)  # 2 / sqrt(pi)
        return tl.math.erf(u), s * d, x * d, d


@triton.jit
def _forward_kernel(X, Y, S, SHIFT, W, B, N, METHOD: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    HAS_SHIFT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    x = tl.load(X + row * N + col, mask=mask, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        s = tl.load(S + col, mask=mask, other=1.0).to(tl.float32)
    else:
        s = tl.load(S).to(tl.float32)
    shift = 0.0
    if HAS_SHIFT:
        shift = tl.load(SHIFT).to(tl.float32)
    f, _, _, _ = _element(x, s, shift, METHOD)
    y = f * tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + col, y, mask=mask)


@triton.jit
def _backward_kernel(X, DY, DX, S, SHIFT, W, DS, DSHIFT, DW, DB, M, N, METHOD: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Program (p, c) walks rows p, p + P, ... of column block c; its partial sums go to row p of DS / DW / DB
    (``(P, N)`` fp32) and DSHIFT (``(P, N)``: per column, summed by the caller)."""
    first = tl.program_id(0)
    programs = tl.num_programs(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    if PER_CHANNEL:
        s = tl.load(S + col, mask=mask, other=1.0).to(tl.float32)
    else:
        s = tl.load(S).to(tl.float32)
    shift = 0.0
    if HAS_SHIFT:
        shift = tl.load(SHIFT).to(tl.float32)
    w = tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    ds = tl.full((BLOCK,), 0.0, tl.float32)
    dshift = tl.full((BLOCK,), 0.0, tl.float32)
    dw = tl.full((BLOCK,), 0.0, tl.float32)
    db = tl.full((BLOCK,), 0.0, tl.float32)
    for row in range(first, M, programs):
        offset = tl.cast(row, tl.int64) * N
        x = tl.load(X + offset + col, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + col, mask=mask, other=0.0).to(tl.float32)
        f, dfdx, dfds, dfdshift = _element(x, s, shift, METHOD)
        g = dy * w
        tl.store(DX + offset + col, g * dfdx, mask=mask)
        ds += g * dfds
        dw += dy * f
        if HAS_SHIFT:
            dshift += g * dfdshift
        if HAS_BIAS:
            db += dy
    partial = tl.cast(first, tl.int64) * N + col
    tl.store(DS + partial, ds, mask=mask)
    tl.store(DW + partial, dw, mask=mask)
    if HAS_SHIFT:
        tl.store(DSHIFT + partial, dshift, mask=mask)
    if HAS_BIAS:
        tl.store(DB + partial, db, mask=mask)


@functools.lru_cache(maxsize=None)
def _launch(width: int) -> tuple[int, int, int]:
    """(columns a program handles, warps, column blocks): one block a row up to :data:`MAX_BLOCK`, about 16 columns
    a thread. Cached: a call's host time is what a small input costs."""
    block = min(1 << (width - 1).bit_length(), MAX_BLOCK)
    return block, max(1, min(16, block // 512)), -(-width // block)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(x: torch.Tensor) -> int:
    if x.device.type == "cuda":
        return min(x.shape[0], BACKWARD_PROGRAMS_PER_SM * _multiprocessors(x.device))
    return min(x.shape[0], CPU_BACKWARD_PROGRAMS)


def forward(method: str, x: torch.Tensor, shape: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            shift: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * f(x) + bias`` of a contiguous 2-D ``(tokens, C)`` ``x``, in its dtype; no autograd."""
    rows, width = x.shape
    y = torch.empty_like(x)
    block, warps, blocks = _launch(width)
    _forward_kernel[(rows, blocks)](
        x, y, shape, shift, weight, bias, width, METHOD=METHOD_IDS[method], PER_CHANNEL=shape.numel() > 1,
        HAS_SHIFT=shift is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
    return y


def backward(method: str, x: torch.Tensor, grad_out: torch.Tensor, shape: torch.Tensor, weight: torch.Tensor,
             has_bias: bool, shift: torch.Tensor | None = None):
    """``(grad x, grad shape, grad weight, grad bias, grad shift)``: grad x in x's dtype, the rest fp32 sums over
    rows (None where the parameter is absent), grad shape and grad shift shaped as their parameters."""
    rows, width = x.shape
    grad_x = torch.empty_like(x)
    programs = _backward_programs(x)
    block, warps, blocks = _launch(width)
    partials = torch.empty((2 + has_bias + (shift is not None), programs, width), dtype=torch.float32,
                           device=x.device)
    ds, dw = partials[0], partials[1]
    db = partials[2] if has_bias else None
    dshift = partials[-1] if shift is not None else None
    _backward_kernel[(programs, blocks)](
        x, grad_out, grad_x, shape, shift, weight, ds, dshift, dw, db, rows, width, METHOD=METHOD_IDS[method],
        PER_CHANNEL=shape.numel() > 1, HAS_SHIFT=shift is not None, HAS_BIAS=has_bias, BLOCK=block,
        num_warps=warps)
    sums = partials.sum(1)  # across programs, fp32
    grad_shape = sums[0] if shape.numel() > 1 else sums[0].sum()
    grad_shift = sums[-1].sum().reshape(shift.shape) if shift is not None else None
    return (grad_x, grad_shape.reshape(shape.shape), sums[1], sums[2] if has_bias else None, grad_shift)


class TritonNorm(torch.autograd.Function):
    """Forward: one kernel; saves only the input and the parameters. Backward: one kernel and a sum over programs.
    Not differentiable twice (for second-order gradients set ``HF_NORMSWAP_FALLBACK=1``)."""

    @staticmethod
    def forward(ctx, method, x2d, shape, weight, bias, shift):
        ctx.method, ctx.has_bias = method, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2d, shape, weight, shift)
        return forward(method, x2d, shape, weight, bias, shift)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x2d, shape, weight, shift = ctx.saved_tensors
        grad_x, grad_shape, grad_weight, grad_bias, grad_shift = backward(ctx.method, x2d, grad_out.contiguous(),
                                                                          shape, weight, ctx.has_bias, shift)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        if grad_shift is not None:
            grad_shift = grad_shift.to(shift.dtype)
        return None, grad_x, grad_shape.to(shape.dtype), grad_weight.to(weight.dtype), grad_bias, grad_shift


def norm(method: str, x: torch.Tensor, shape: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """The module's output for ``x`` of any shape ``(..., C)``: through :class:`TritonNorm` when a gradient is
    needed, the forward kernel alone otherwise (inference pays no autograd bookkeeping)."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    shape = shape.contiguous()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, shape, weight, bias, shift))
    if needs_grad:
        y = TritonNorm.apply(method, x2d, shape, weight, bias, shift)
    else:
        y = forward(method, x2d, shape, weight, bias, shift)
    return y.view(x.shape)


@functools.lru_cache(maxsize=None)
def _method_of(squash) -> str | None:
    return next((name for name in METHOD_IDS if METHODS[name].squash is squash), None)


def module_norm(module, x: torch.Tensor, shape: torch.Tensor) -> torch.Tensor | None:
    """:func:`norm` for an element-wise module (``hf_normswap.kernels`` calls it for CUDA tensors), or None for a
    module whose element function has no kernel here (or more scalar extras than the one shift slot)."""
    method = _method_of(type(module).squash)
    extras = module.extras()
    if method is None or len(extras) > 1:
        return None
    return norm(method, x, shape, module.weight, module.bias, extras[0] if extras else None)
