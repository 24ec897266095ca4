"""Stock export (hf_normswap.checkpoint.stock_export): a model whose every norm is ``linear`` saved as its original
architecture loads in plain transformers, without remote code, with the linear model's logits; the rest is refused
in one line before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_models import tiny_model

import hf_normswap
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.checkpoint.stock_export import StockExportError, export_stock
from hf_normswap.discovery.roles import ROLES
from hf_normswap.modules import Linear

pytestmark = pytest.mark.usefixtures("one_thread")

AUTO = {"llama": transformers.AutoModelForCausalLM, "gpt2": transformers.AutoModelForCausalLM,
        "bert": transformers.AutoModelForMaskedLM}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(seed))


def _linear(arch: str, **settings):
    model = tiny_model(arch)
    hf_normswap.convert(model, "linear", calibration=CalibrationConfig(data=_ids(0), batch_size=4, block_steps=4,
                                                                       tune_steps=4, progress=False), **settings)
    for module in model.modules():  # a recovered model: the first position at the common scale
        if isinstance(module, Linear):
            with torch.no_grad():
                module.log_first.zero_()
    return model


@pytest.mark.parametrize("arch", sorted(AUTO))
def test_a_linear_model_exports_as_its_stock_architecture_with_the_same_logits(arch, tmp_path):
    model = _linear(arch, roles=ROLES)
    directory, eps, difference = export_stock(model, tmp_path / "stock")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == model.config.model_type and "auto_map" not in config
    assert config["normswap"]["stock"]["eps"] == eps >= 1e12 and difference <= 1e-5
    assert not list(directory.glob("*.py"))
    stock = AUTO[arch].from_pretrained(directory, trust_remote_code=False).eval()
    assert type(stock).__module__.startswith("transformers.models")
    reloaded = hf_normswap.load(directory)
    assert sum(isinstance(m, Linear) for m in reloaded.modules()) == len(config["normswap"]["converted"])
    ids = _ids(1)
    with torch.no_grad():
        ours, theirs, again = (m(input_ids=ids).logits for m in (model, stock, reloaded))
    scale = float(ours.abs().max())
    assert float((theirs - ours).abs().max()) <= 1e-5 * scale
    assert float((again - ours).abs().max()) <= 1e-5 * scale
    assert "trust_remote_code" not in (directory / "README.md").read_text().split("## How to load")[1].split("##")[0]
    hf_normswap.save_pretrained(reloaded, tmp_path / "converted")  # a converted model again, not a stock export
    assert "stock" not in json.loads((tmp_path / "converted" / "config.json").read_text())["normswap"]


@pytest.mark.parametrize("case, message", [
    ("dyt", "element-wise"), ("partial", "partial conversion"), ("first", "position 0"), ("original", "not converted")])
def test_what_cannot_be_exported_is_refused_in_one_line_and_nothing_is_written(case, message, tmp_path):
    if case == "dyt":
        model = tiny_model("llama")
        hf_normswap.convert(model, "dyt", calibration=None)
    elif case == "partial":
        model = _linear("llama", roles=["attention_input", "mlp_input"])
    elif case == "first":
        model = _linear("llama")
        next(m for m in model.modules() if isinstance(m, Linear)).log_first.data.fill_(-1.0)
    else:
        model = tiny_model("llama")
    with pytest.raises(StockExportError, match=message) as error:
        export_stock(model, tmp_path / "stock")
    assert "\n" not in str(error.value) and not (tmp_path / "stock").exists()
