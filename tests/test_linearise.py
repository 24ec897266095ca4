"""Linearising a converted model (hf_normswap.linearise and ``normswap convert CONVERTED --to linear``): each
element-wise module that rarely saturates becomes its least-squares line, the rest stay, and the result saves, reloads and
(when every norm is linear) exports as the stock architecture."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runs import run_cli
from tiny_models import random_elementwise, tiny_model, tiny_tokenizer

import hf_normswap
from hf_normswap.linearise import LineariseError, LineStatistics, fitted_line, linearise
from hf_normswap.modules import DyT, ELN, Derf, Linear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("cls, shape", [(DyT, 0.3), (ELN, 9.0), (Derf, 0.3)])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_the_line_is_each_channel_s_least_squares_fit_without_position_0(cls, shape, kind):
    module = random_elementwise(cls, 8, shape=shape, amplitude=2.0, per_channel=True, dtype=torch.float64)
    x = 3 * torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:, 0] *= 100  # position 0, far out: left out of the fit
    stats = LineStatistics()
    with torch.no_grad():
        stats.add(module, kind, x, module(x))
    line = fitted_line(module, kind, stats)
    ordinary = x[:, 1:].reshape(-1, 8)
    inputs = ordinary - ordinary.mean(-1, keepdim=True) if kind == "layernorm" else ordinary
    with torch.no_grad():
        target = module(ordinary)
        for channel in range(8):  # by hand: [x 1] @ [slope, intercept] = y, least squares
            design = torch.stack([inputs[:, channel], torch.ones_like(inputs[:, channel])], 1)
            slope, intercept = torch.linalg.lstsq(design, target[:, channel:channel + 1]).solution.flatten()
            fitted = line(ordinary)[:, channel]
            torch.testing.assert_close(fitted, slope * inputs[:, channel] + intercept, rtol=1e-5, atol=1e-6)
        assert line.bias is not None  # the module has a bias: the line has an intercept
        value, tangent_slope, *_ = type(module).grads(torch.zeros(8, dtype=torch.float64),
                                                      module.shape_parameter().detach().expand(8),
                                                      *(e.detach() for e in module.extras()))
        tangent = module.weight * (value + tangent_slope * inputs) + module.bias
        assert (line(ordinary) - target).norm() <= (tangent - target).norm()  # the fit is the closer line


@pytest.mark.parametrize("cls, shape", [(DyT, 0.3), (ELN, 9.0)])
def test_a_module_without_offset_gets_a_line_through_the_origin(cls, shape):
    module = cls(8, shape, bias=False)  # an RMSNorm's: odd, no bias
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    module = module.double()
    stats = LineStatistics()
    with torch.no_grad():
        stats.add(module, "rmsnorm", x, module(x))
        line = fitted_line(module, "rmsnorm", stats)
        ordinary = x[:, 1:].reshape(-1, 8)
        by_hand = (ordinary * module(ordinary)).sum(0) / (ordinary * ordinary).sum(0)
        torch.testing.assert_close(line(ordinary), by_hand * ordinary, rtol=1e-5, atol=1e-7)
    assert line.bias is None


def _batches():
    return [{"input_ids": torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(s))} for s in (0, 1)]


def test_modules_that_saturate_are_kept_and_the_record_names_each_method(tmp_path):
    model = tiny_model("llama")
    hf_normswap.convert(model, "dyt", calibration=None)
    hot = model.get_submodule("model.layers.0.input_layernorm")
    hot.set_shape_parameter(1e3)  # tanh at +-1 on nearly every input
    report = linearise(model, _batches(), max_saturation=0.5)
    assert list(report.kept) == ["model.layers.0.input_layernorm"] and len(report.linearised) == 4
    assert isinstance(model.get_submodule("model.layers.0.input_layernorm"), DyT)
    assert isinstance(model.get_submodule("model.norm"), Linear)
    hf_normswap.save_pretrained(model, tmp_path / "mixed")
    record = json.loads((tmp_path / "mixed" / "config.json").read_text())["normswap"]
    assert record["method"] == "dyt" and record["converted"]["model.norm"]["method"] == "linear"
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(hf_normswap.load(tmp_path / "mixed")(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(LineariseError, match="no element-wise module"):
        linearise(tiny_model("llama"), _batches())


def test_the_cli_linearises_a_converted_checkpoint_and_saves_it_as_the_stock_architecture(tmp_path, capsys):
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln", calibration=None)
    hf_normswap.save_pretrained(model, tmp_path / "eln", tokenizer=tiny_tokenizer())
    code, _ = run_cli(["convert", tmp_path / "eln", "--to", "linear", "--max-saturation", "1", "--output",
                       tmp_path / "stock", "--stock"], capsys)
    assert code == 0
    config = json.loads((tmp_path / "stock" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["normswap"]["method"] == "linear"
    assert config["normswap"]["stock"]["eps"] >= 1e12
    code, line = run_cli(["convert", tmp_path / "eln", "--to", "dyt", "--stock", "--output", tmp_path / "x"], capsys)
    assert code == 2 and "--stock" in line and not (tmp_path / "x").exists()
