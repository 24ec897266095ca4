"""DyT / ELN / Derf modules: gradients, low-precision safety, weight carry-over, parametrization limits."""

import math

import pytest
import torch
from tiny_models import random_elementwise

from hf_normswap.modules import METHODS as METHODS_BY_KEY
from hf_normswap.modules import Derf, DyISRU, DyT, ElementwiseNorm, ELN, adam_groups

METHODS = [DyT, ELN, Derf]
ALPHA = (DyT, Derf)  # the shape parameter multiplies the input


def _module(cls, per_channel, bias=True, size=6):
    return random_elementwise(cls, size, shape=0.7 if cls in ALPHA else 3.0, amplitude=2.0, per_channel=per_channel,
                              bias=bias)


def test_dyisru_is_eln():
    assert DyISRU is ELN


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_gradcheck_float64(cls, per_channel):
    module = _module(cls, per_channel).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True) * 2
    params = [p for p in module.parameters()]

    def fn(x, *ps):
        return torch.func.functional_call(module, {n: p for (n, _), p in zip(module.named_parameters(), ps)}, (x,))

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_up_to_1e4_are_finite_and_match_fp32(cls, dtype):
    module = _module(cls, per_channel=False, size=64)
    with torch.no_grad():
        module.set_shape_parameter(0.01 if cls in ALPHA else 1000.0)
    x = torch.cat([torch.randn(4, 64) * 10, torch.linspace(-1e4, 1e4, 64).unsqueeze(0)])
    reference = module(x)
    low = module.to(dtype)(x.to(dtype))
    assert low.dtype == dtype
    assert torch.isfinite(low).all()
    torch.testing.assert_close(low.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("cls", METHODS)
def test_built_from_norm_reproduces_affine_part_in_linear_regime(cls, kind):
    size, sigma = 16, 3.0
    weight, bias = torch.randn(size), torch.randn(size)
    module = cls.from_norm(weight, bias, kind=kind, normalized_shape=(size,), input_scale=sigma)
    amplitude = {"layernorm": math.sqrt(15), "rmsnorm": 4.0}[kind]  # sqrt(C-1), sqrt(C) for C = 16
    assert module.amplitude == pytest.approx(amplitude)
    torch.testing.assert_close(module.weight, weight * amplitude)
    torch.testing.assert_close(module.bias, bias)
    # Near zero the module is the norm's affine map applied to the norm's linearization x * slope.
    slope = amplitude**2 / (size * sigma)
    x = torch.randn(5, size) * 1e-4
    torch.testing.assert_close(module(x), weight * (x * slope) + bias, rtol=1e-5, atol=1e-6)


def test_analytic_init_matches_paper_simulation_scale():
    """C=100, sigma=2: the paper's fitted DyT alpha is 0.049; the analytic slope match gives sqrt(99)/200."""
    alpha = DyT.analytic_shape_value("layernorm", 100, 2.0)
    assert alpha == pytest.approx(math.sqrt(99) / 200)
    assert alpha == pytest.approx(0.049, abs=0.001)
    # ELN: amplitude / sqrt(beta) equals the same slope.
    beta = ELN.analytic_shape_value("layernorm", 100, 2.0)
    assert math.sqrt(99) / math.sqrt(beta) == pytest.approx(99 / 200)


@pytest.mark.parametrize("cls", METHODS)
def test_norm_without_affine_gets_amplitude_scale_and_no_bias(cls):
    module = cls.from_norm(None, None, kind="rmsnorm", normalized_shape=(9,))
    assert module.bias is None
    torch.testing.assert_close(module.weight, torch.full((9,), 3.0))


@pytest.mark.parametrize("cls", METHODS)
def test_shape_parameter_stays_positive_and_finite_under_any_step(cls):
    module = _module(cls, per_channel=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e6)
    for direction in (1.0, -1.0):
        optimizer.zero_grad()
        (direction * module(torch.randn(4, 6) * 50).sum()).backward()
        module._log_param().grad = torch.full_like(module._log_param(), direction * 1e6)
        optimizer.step()
        value = module.shape_parameter()
        # the step of 1e12 in log space lands on the clamp: the smallest value going down, the largest going up
        limit = math.exp(-cls.log_limit if direction > 0 else cls.log_limit)
        torch.testing.assert_close(value, torch.full_like(value, limit), rtol=1e-5, atol=0)
        assert torch.isfinite(module(torch.randn(4, 6) * 1e3)).all()


@pytest.mark.parametrize("cls", METHODS)
def test_per_channel_option_and_extra_repr(cls):
    scalar, channel = _module(cls, False), _module(cls, True)
    assert not scalar.per_channel and channel.per_channel
    assert channel.shape_parameter().shape == (6,)
    text = repr(scalar)
    assert cls.shape_name + "=" in text and "amplitude=2" in text and "bias=True" in text


def test_eln_saturates_at_amplitude_and_dyt_matches_tanh():
    eln = ELN(4, 1.0, bias=False, amplitude=5.0)
    assert eln(torch.full((1, 4), 1e6)).allclose(torch.full((1, 4), 5.0))
    dyt = DyT(4, 0.5, bias=False, amplitude=1.0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(dyt(x), torch.tanh(0.5 * x))


def test_adam_groups_move_dyt_and_eln_input_scale_equally_fast():
    """One Adam step moves a log parameter by lr: with adam_groups, the input scale each curve follows (1 / alpha,
    sqrt(beta)) moves by the same factor for DyT and ELN; gamma and bias keep the plain lr."""
    changes = {}
    for cls in (DyT, ELN, Derf):
        module = cls(8, 0.5 if cls in ALPHA else 4.0)
        scale = (lambda: 1 / module.alpha) if cls in ALPHA else (lambda: module.beta.sqrt())
        before, weight = scale().item(), module.weight.detach().clone()
        optimizer = torch.optim.Adam(adam_groups([module], lr=0.1))
        (scale() + module.weight.sum() + module.bias.sum()).backward()
        optimizer.step()
        changes[cls] = math.log(scale().item() / before)
        assert torch.allclose(weight - module.weight.detach(), torch.full((8,), 0.1), atol=1e-5)
    for cls in (DyT, ELN, Derf):
        assert changes[cls] == pytest.approx(-0.1, abs=1e-4)


class _Softsign(ElementwiseNorm):
    """A method the package does not ship, ``y = weight * a x / (1 + |a x|) + bias``: declared as a class alone."""

    key = "softsign"
    title = "Softsign (a test method)"
    formula = "y = weight * a * x / (1 + |a * x|) + bias"
    shape_note = "`a` is one learnable scalar per module"
    citation = "@misc{softsign, title = {A test method}}"
    builds_on = ("dyt",)
    shape_name = "a"
    log_limit = 30.0
    scale_power = -1

    def squash(self, x, a):
        return a * x / (1 + (a * x).abs())

    @staticmethod
    def grads(x, a):
        d = 1 / (1 + (a * x).abs()) ** 2
        return a * x / (1 + (a * x).abs()), a * d, x * d

    @staticmethod
    def analytic_shape_value(kind, size, input_scale):
        return DyT.analytic_shape_value(kind, size, input_scale)


def test_a_method_is_its_class(monkeypatch):
    """A class in METHODS is all a method needs: convert, the fused path's derivatives, the saturating start, the
    model card and convert's error text read it from there."""
    from tiny_models import tiny_model

    import hf_normswap
    from hf_normswap import kernels
    from hf_normswap.checkpoint import model_card
    from hf_normswap.surgery import ConversionError, ConvertConfig

    monkeypatch.setitem(METHODS_BY_KEY, _Softsign.key, _Softsign)
    model = tiny_model("llama")
    hf_normswap.convert(model, to="softsign")
    assert isinstance(model.model.norm, _Softsign) and model.config.normswap["method"] == "softsign"
    assert kernels._GRADS[_Softsign.squash] is _Softsign.grads
    x = torch.linspace(-3, 3, 7, dtype=torch.float64)
    a = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    xr = x.clone().requires_grad_(True)
    f, dfdx, dfda = _Softsign.grads(x, a.detach())
    y = _Softsign.squash(None, xr, a)
    grad_x, grad_a = torch.autograd.grad(y.sum(), (xr, a))
    assert torch.allclose(f, y.detach()) and torch.allclose(dfdx, grad_x) and torch.allclose(dfda.sum(), grad_a)
    assert torch.allclose(_Softsign.knee_shape(torch.tensor([2.0, 4.0])), torch.tensor([0.5, 0.25]))
    config = {"model_type": "normswap_llama", "normswap": {
        "method": "softsign", "converted": {},
        "base": {"architecture": "LlamaForCausalLM", "config_class": "LlamaConfig", "model_type": "llama"}}}
    card = model_card.render(config)
    assert _Softsign.title in card and _Softsign.formula in card and _Softsign.shape_note in card
    assert card.index(DyT.citation) < card.index(_Softsign.citation)
    with pytest.raises(ConversionError, match="--to softsign"):
        ConvertConfig(method="none")


def test_derf_is_erf_with_a_shift_and_starts_with_dyts_slope():
    derf = Derf(4, 0.5, bias=False, amplitude=1.0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(derf(x), torch.erf(0.5 * x))  # the shift starts at 0
    with torch.no_grad():
        derf.shift.fill_(0.25)
    torch.testing.assert_close(derf(x), torch.erf(0.5 * x + 0.25))
    # slope-matched to DyT: alpha_derf = alpha_dyt * sqrt(pi) / 2, so both have the same slope at zero
    for kind in ("layernorm", "rmsnorm"):
        dyt_alpha = DyT.analytic_shape_value(kind, 64, 2.5)
        assert Derf.analytic_shape_value(kind, 64, 2.5) == pytest.approx(dyt_alpha * math.sqrt(math.pi) / 2)
    weight, bias = torch.randn(64), torch.randn(64)
    dyt, derf = (cls.from_norm(weight, bias, kind="rmsnorm", normalized_shape=(64,), input_scale=2.5)
                 for cls in (DyT, Derf))
    tiny = torch.randn(5, 64) * 1e-4
    torch.testing.assert_close(derf(tiny), dyt(tiny), rtol=1e-5, atol=1e-7)
    for cls in (DyT, Derf, ELN):  # the saturating start's shape parameter gives slope 1 / scale at zero
        module = cls(1, 1.0, bias=False, amplitude=1.0)
        module.set_shape_parameter(module.knee_shape(torch.tensor(4.0)))
        slope = module(torch.tensor([[1e-4]])).item() / 1e-4
        assert slope == pytest.approx(0.25, rel=1e-4)


def test_derf_shift_is_a_scalar_even_per_channel_and_trains_at_the_plain_rate():
    module = Derf(8, 0.5, per_channel=True)
    assert module.shift.shape == () and module.log_alpha.shape == (8,)
    assert module.lr_factor("shift") == 1 and module.lr_factor("log_alpha") == 1


def test_derf_grads_are_its_derivatives_shift_included():
    """The fused path's derivatives (``Derf.grads``) against autograd on the formula, at a non-zero shift."""
    x = torch.linspace(-3, 3, 13, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    shift = torch.tensor(-0.3, dtype=torch.float64, requires_grad=True)
    y = Derf.squash(None, x, alpha, shift)
    grad_x, grad_alpha, grad_shift = torch.autograd.grad(y.sum(), (x, alpha, shift))
    f, dfdx, dfdalpha, dfdshift = Derf.grads(x.detach(), alpha.detach(), shift.detach())
    assert torch.allclose(f, y.detach()) and torch.allclose(dfdx, grad_x)
    assert torch.allclose(dfdalpha.sum(), grad_alpha) and torch.allclose(dfdshift.sum(), grad_shift)
