"""Linearising a converted model (hf_normswap.linearise and ``normswap convert CONVERTED --to linear``): each
element-wise module that rarely saturates becomes its slope at 0, the rest stay, and the result saves, reloads and
(when every norm is linear) exports as the stock architecture."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runs import run_cli
from tiny_models import random_elementwise, tiny_model, tiny_tokenizer

import hf_normswap
from hf_normswap.linearise import LineariseError, linear_part, linearise
from hf_normswap.modules import DyT, ELN, Derf, Linear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("cls, shape", [(DyT, 0.3), (ELN, 9.0), (Derf, 0.3)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_the_linear_part_is_the_module_s_value_and_slope_at_zero(cls, shape, per_channel):
    module = random_elementwise(cls, 8, shape=shape, amplitude=2.0, per_channel=per_channel, dtype=torch.float64)
    linear = linear_part(module, "rmsnorm")
    x = 1e-4 * torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    zero = torch.zeros(1, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(linear(zero), module(zero), rtol=1e-6, atol=1e-6)
        step = (module(x) - module(zero)) / (linear(x) - linear(zero))
    assert float((step - 1).abs().max()) < 1e-3  # the same slope: only the curvature differs


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
