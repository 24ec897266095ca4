"""The Triton kernels (hf_normswap/triton_kernels.py) against the modules' plain formula: the output and every
gradient (input, weight, bias, the stored log shape parameter, Derf's shift), per tensor and per channel, fp32 /
bf16 / fp16.

On the CPU Triton's interpreter runs them (``TRITON_INTERPRET=1``, a copy of the module decorated under it, so a
process that also runs them on a GPU keeps its compiled ones); the ``cuda`` tests run the same checks compiled, on
a GPU, through the path converted models take (``hf_normswap.kernels``). Skipped without triton.

Tolerances, relative to the norm of the reference: fp32 sums in another order; a half-precision output or gradient
is one rounding of the same fp32 value, so it may differ in its last bit (bf16 2^-8, fp16 2^-11)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import hf_normswap  # noqa: E402
from hf_normswap import kernels  # noqa: E402
from hf_normswap.modules import ERF_SLOPE_RATIO, Derf, DyT, ELN  # noqa: E402
from tiny_models import random_elementwise  # noqa: E402

# class, shape value near the analytic one for C = 96
METHODS = {"eln": (ELN, 96.0), "dyt": (DyT, 96 ** -0.5), "derf": (Derf, ERF_SLOPE_RATIO * 96 ** -0.5)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RTOL = {"fp32": 1e-5, "bf16": 2 ** -7, "fp16": 2 ** -10}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def interpreted():
    """hf_normswap/triton_kernels.py loaded afresh under TRITON_INTERPRET=1: its kernels run on CPU tensors."""
    path = Path(hf_normswap.__file__).parent / "triton_kernels.py"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # the variable is read when a kernel is decorated: the copy's kernels are interpreted, others compiled
        spec = importlib.util.spec_from_file_location("hf_normswap._triton_kernels_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _module(method: str, dtype: torch.dtype, per_channel: bool, size: int = 96, bias: bool = True):
    """As ``convert`` builds it: the affine parameters in the model's dtype, the shape parameter in fp32."""
    cls, shape = METHODS[method]
    module = random_elementwise(cls, size, shape=shape, amplitude=size ** 0.5, per_channel=per_channel, bias=bias)
    module.weight.data = module.weight.data.to(dtype)
    if bias:
        module.bias.data = module.bias.data.to(dtype)
    return module


def _activations(rows: int, size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    torch.manual_seed(1)
    x = 4 * torch.randn(2, rows, size)
    x[0, 0] *= 100  # a massive activation, as real models have
    x[1, 0] = 0.0  # and exact zeros, where DyT's tanh takes its series
    return x.to(device, dtype)


def _forward_backward(module, x, grad, run):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = run(module, x)
    y.backward(grad)
    return y.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


def _check(run, method: str, dtype: str, per_channel: bool, device: str, rows: int = 13, size: int = 96,
           bias: bool = True):
    module = _module(method, DTYPES[dtype], per_channel, size, bias).to(device)
    x = _activations(rows, size, DTYPES[dtype], device)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device, x.dtype)
    with kernels.fallback():
        reference = _forward_backward(module, x, grad, lambda m, v: m(v))
    got = _forward_backward(module, x, grad, run)
    tolerance = RTOL[dtype]
    assert got[0].dtype == reference[0].dtype and _relative(got[0], reference[0]) < tolerance, "output"
    assert got[1].dtype == reference[1].dtype and _relative(got[1], reference[1]) < tolerance, "grad x"
    expected = {"weight", f"log_{module.shape_name}", *module.squash_extras} | ({"bias"} if bias else set())
    assert set(got[2]) == set(reference[2]) == expected
    for name, value in reference[2].items():
        assert got[2][name].dtype == value.dtype and got[2][name].shape == value.shape, name
        assert _relative(got[2][name], value) < tolerance, name
    with torch.no_grad():  # inference: the forward kernel alone, no autograd
        assert _relative(run(module, x), reference[0]) < tolerance


def _through(kernels_module, method: str):
    return lambda module, x: kernels_module.norm(method, x, module.shape_parameter(), module.weight, module.bias,
                                                 *module.extras())


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_kernels_match_the_formula_under_the_interpreter(interpreted, method, dtype, per_channel):
    _check(_through(interpreted, method), method, dtype, per_channel, "cpu")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_without_bias_and_wider_than_one_block(interpreted, method):
    """No bias (its gradient absent), and rows wider than one program's block, split over two column blocks."""
    size = interpreted.MAX_BLOCK + 40
    _check(_through(interpreted, method), method, "fp32", True, "cpu", rows=2, size=size, bias=False)


def test_one_row_and_the_backward_partials(interpreted):
    """One token (fewer rows than backward programs) and the partial sums of several programs."""
    assert interpreted.CPU_BACKWARD_PROGRAMS > 1
    _check(_through(interpreted, "eln"), "eln", "fp32", False, "cpu", rows=1)
    _check(_through(interpreted, "dyt"), "dyt", "fp32", False, "cpu", rows=interpreted.CPU_BACKWARD_PROGRAMS * 4 + 1)
    _check(_through(interpreted, "derf"), "derf", "fp32", True, "cpu", rows=interpreted.CPU_BACKWARD_PROGRAMS * 4 + 1)


def test_derf_shift_gradient_is_the_sum_over_every_element(interpreted):
    """Derf's shift is one scalar for the whole tensor, even per channel: its gradient is
    sum(grad_out * weight * erf'(alpha * x + shift)), summed over rows, columns and the backward programs."""
    module = _module("derf", torch.float32, per_channel=True)
    with torch.no_grad():
        module.shift.fill_(0.4)
    x = _activations(interpreted.CPU_BACKWARD_PROGRAMS * 3 + 2, 96, torch.float32, "cpu")[0]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    alpha = module.shape_parameter().detach()
    *_, grad_shift = interpreted.backward("derf", x, grad, alpha, module.weight.detach(), True,
                                          module.shift.detach())
    u = alpha.double() * x.double() + 0.4
    want = (grad.double() * module.weight.detach().double() * 2 / torch.pi ** 0.5 * torch.exp(-u * u)).sum()
    assert grad_shift.shape == () and float(grad_shift) == pytest.approx(float(want), rel=1e-5)


def test_tanh_from_exp_is_accurate_in_fp32(interpreted):
    """DyT's tanh is built from exp (the interpreter has no libdevice): DyT's forward at alpha 1, weight 1 and no bias
    is tanh itself, within 2 ulp of float64's over the range, the series branch near zero included."""
    z = torch.cat([torch.linspace(-12, 12, 4001), torch.logspace(-8, 0, 2000), -torch.logspace(-8, 0, 2000)])
    y = interpreted.forward("dyt", z[None], torch.tensor(1.0), torch.ones_like(z), None)[0]
    expected = torch.tanh(z.double())
    ulp = torch.finfo(torch.float32).eps * expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert float(((y.double() - expected).abs() / ulp).max()) <= 2


@pytest.mark.parametrize("method", sorted(METHODS))
def test_kernels_compile_for_hopper_without_a_gpu(method):
    """Triton's compiler (its own ptxas, no GPU needed) builds both kernels for sm_90 (H100 / H200) in bf16 with a
    per-channel shape parameter and a bias: what the interpreter cannot check (types, constexpr branches)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_normswap import triton_kernels

    has_shift = bool(METHODS[method][0].squash_extras)  # Derf's shift: a pointer, else an absent constexpr
    shift = "*fp32" if has_shift else "constexpr"
    flags = {"METHOD": triton_kernels.METHOD_IDS[method], "PER_CHANNEL": True, "HAS_SHIFT": has_shift,
             "HAS_BIAS": True, "BLOCK": triton_kernels.MAX_BLOCK, **({} if has_shift else {"SHIFT": None})}
    forward = {"X": "*bf16", "Y": "*bf16", "S": "*fp32", "SHIFT": shift, "W": "*bf16", "B": "*bf16", "N": "i32"}
    backward = {"X": "*bf16", "DY": "*bf16", "DX": "*bf16", "S": "*fp32", "SHIFT": shift, "W": "*bf16",
                "DS": "*fp32", "DSHIFT": shift, "DW": "*fp32", "DB": "*fp32", "M": "i32", "N": "i32"}
    for kernel, signature, constants in ((triton_kernels._forward_kernel, forward, flags),
                                         (triton_kernels._backward_kernel, backward,
                                          flags if has_shift else dict(flags, DSHIFT=None))):
        signature = dict(signature, **{name: "constexpr" for name in constants})
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], kernel


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_kernels_match_the_formula_on_cuda(method, dtype, per_channel, monkeypatch):
    """Compiled on the GPU, reached as converted models reach it: a module's forward through hf_normswap.kernels,
    at a small size (no compile threshold on CUDA) and one wider than a block."""
    from hf_normswap import triton_kernels

    kernels.install()
    calls = []
    norm = triton_kernels.norm
    monkeypatch.setattr(triton_kernels, "norm", lambda *args: calls.append(args[0]) or norm(*args))
    _check(lambda module, x: module(x), method, dtype, per_channel, "cuda")
    _check(lambda module, x: module(x), method, dtype, per_channel, "cuda", rows=257,
           size=triton_kernels.MAX_BLOCK + 40)
    assert calls and set(calls) == {method}, "the Triton kernels did not run"
