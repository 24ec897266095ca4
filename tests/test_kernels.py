"""The fused path (hf_normswap.kernels) of every method against the plain formula: same values, same gradients.

The inputs are just above ``kernels.MIN_NUMEL`` so the fused path really runs; each test checks that it did.
"""

import pytest
import torch
from tiny_models import random_elementwise

from hf_normswap import kernels
from hf_normswap.modules import Derf, DyT, ElementwiseNorm, ELN

kernels.install()  # the modules here are built by hand, not by convert / load

C = 256
TOKENS = kernels.MIN_NUMEL // C + 8  # the smallest size that takes the fused path, plus a ragged row count


def _module(cls, per_channel=False, bias=True, dtype=torch.float32):
    return random_elementwise(cls, C, shape=0.3 if cls in (DyT, Derf) else 40.0, amplitude=16.0,
                              per_channel=per_channel, bias=bias, dtype=dtype)


def _input(dtype=torch.float32, shape=(2, TOKENS // 2 + 4, C)):
    torch.manual_seed(1)
    x = 8 * torch.randn(shape)
    x[0, 0] *= 100  # a massive activation, as in real models
    return x.to(dtype)


def _count_fused(monkeypatch):
    """Count fused-kernel calls that ran compiled, to prove the fast path ran (a kernel whose compile failed falls
    back to the eager formula and is not counted)."""
    calls = []
    original = kernels._Kernel.__call__

    def counting(self, *args):
        out = original(self, *args)
        if self.compiled is not None and not self.broken:
            calls.append(self.key[0])
        return out

    monkeypatch.setattr(kernels._Kernel, "__call__", counting)
    return calls


def _run(module, x, grad):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(grad)
    return y.detach(), [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("cls,per_channel,bias", [(ELN, False, True), (DyT, True, False), (Derf, False, True),
                                                   (Derf, True, False)])
def test_fused_matches_fallback_fp32_value_and_gradient(cls, per_channel, bias, monkeypatch):
    module, x = _module(cls, per_channel, bias), _input()
    grad = torch.randn_like(x)
    with kernels.fallback():
        y_ref, g_ref = _run(module, x, grad)
    calls = _count_fused(monkeypatch)
    y, g = _run(module, x, grad)
    assert calls == ["fwd", "bwd"], "the fused path did not run"
    assert y.dtype == x.dtype and y.shape == x.shape
    if cls is ELN:
        assert torch.equal(y, y_ref)  # same fp32 operations in the same order: bit-identical
    else:  # tanh / erf: SLEEF in the kernel, maybe MKL in eager; at most a couple of ulp apart
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6 * y_ref.abs().max().item())
    assert len(g) == len(g_ref)
    for got, want in zip(g, g_ref):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("cls,dtype", [(ELN, torch.bfloat16), (DyT, torch.float16), (Derf, torch.bfloat16)])
def test_fused_matches_fallback_half_precision(cls, dtype, monkeypatch):
    module, x = _module(cls, dtype=dtype), _input(dtype)
    grad = torch.randn(x.shape).to(dtype)
    with kernels.fallback():
        y_ref, g_ref = _run(module, x, grad)
    calls = _count_fused(monkeypatch)
    y, g = _run(module, x, grad)
    assert calls == ["fwd", "bwd"]
    assert y.dtype == dtype and torch.isfinite(y).all()
    if cls is ELN:
        assert torch.equal(y, y_ref)
    else:
        assert (y.float() - y_ref.float()).abs().max() <= 2 ** -7 * y_ref.float().abs().max()  # one half-ulp step
    for got, want in zip(g, g_ref):  # fp32 inside, rounded once to the half type: one ulp of that type apart
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item())


def test_inference_path_saves_nothing_and_matches(monkeypatch):
    module, x = _module(ELN), _input()
    with torch.no_grad(), kernels.fallback():
        want = module(x)
    calls = _count_fused(monkeypatch)
    with torch.inference_mode():
        got = module(x)
    assert calls == ["fwd"]
    assert torch.equal(got, want)


def test_switches_and_guards_select_the_fallback(monkeypatch):
    module = _module(ELN)
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        with kernels.fallback():
            module(_input())
        assert calls == []  # inside fallback(): the plain formula
        module(_input(shape=(4, 8, C)))  # small: eager is faster than a compiled call
        module.double()(_input(torch.float64))  # float64 stays on the exact reference path
        module.float().to("meta")(_input().to("meta"))  # meta tensors: shapes only
    assert calls == []
    assert kernels.fast_path_enabled()


def test_failed_compile_falls_back_silently(monkeypatch):
    module, x = _module(DyT), _input()
    with torch.no_grad(), kernels.fallback():
        want = module(x)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(kernels, "_kernels", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    with torch.no_grad():
        got = module(x)
    assert torch.equal(got, want)  # the eager copy of the kernel is the plain formula
    assert all(k.broken for k in kernels._kernels.values()) and kernels._kernels


def test_user_compile_sees_the_plain_formula():
    """Under a user's torch.compile the module takes the reference path (is_compiling), so graphs stay whole."""
    module, x = _module(ELN), _input()
    with torch.no_grad():
        want = module(x)
        explanation = torch._dynamo.explain(module)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert want.shape == x.shape


def test_derf_with_one_element_vectors_for_its_scalars(monkeypatch):
    """FSDP2 makes 0-d parameters 1-element vectors (training.sharding): alpha and the shift still get their
    gradients, in the vectors' shape."""
    from hf_normswap.training.sharding import vectors_for_scalars

    module, x = _module(Derf), _input()
    vectors_for_scalars(module)
    assert module.shift.shape == (1,) and module.log_alpha.shape == (1,)
    grad = torch.randn_like(x)
    with kernels.fallback():
        y_ref, g_ref = _run(module, x, grad)
    calls = _count_fused(monkeypatch)
    y, g = _run(module, x, grad)
    assert calls == ["fwd", "bwd"]
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6 * y_ref.abs().max().item())
    for got, want in zip(g, g_ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_method_without_derivatives_runs_the_plain_formula():
    class Softsign(ElementwiseNorm):
        shape_name, log_limit, scale_power = "a", 30.0, -1

        def squash(self, x, a):
            return a * x / (1 + (a * x).abs())

    kernels.register(Softsign)
    module, x = Softsign(C, 0.5), _input()
    assert kernels.fused_forward(module, x, module.shape_parameter()) is None
    assert torch.equal(module(x), module.reference_forward(x, module.shape_parameter()))
