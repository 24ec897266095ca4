"""What a conversion that names no calibration does: the original's samples, the offline text for an encoder, or
the start measured on random token ids; the Python API and the command line choose alike."""

import copy

import pytest
import torch
import transformers

import hf_normswap
from hf_normswap.calibration import defaults
from hf_normswap.calibration.defaults import DEFAULTS, Default, default_calibration, default_for
from hf_normswap.calibration.input_scales import norm_inputs
from hf_normswap.model_inputs import probe_ids
from hf_normswap.surgery import plan
from hf_normswap.modules import ELN
from tiny_models import tiny_config, tiny_model, tiny_tokenizer


def test_the_default_follows_what_the_model_can_do():
    llama, tokenizer = tiny_model("llama"), tiny_tokenizer()
    encoder = transformers.BertModel(tiny_config("bert")).eval()
    assert default_for(llama, tokenizer) is DEFAULTS["samples"]
    assert default_for(encoder, tokenizer) is DEFAULTS["text"]
    assert default_for(llama, None) is None  # no tokenizer: nothing to sample or read
    assert default_calibration(llama, None) == (None, None)
    config, line = default_calibration(llama, tokenizer)
    assert config.data == "generated:length=64,batch_size=16"  # the tiny model's context, not 128
    assert (config.num_blocks, config.strategy, config.block_steps, config.tune_steps) == (16, "block", 20, 60)
    assert line.startswith("calibrating on 16 samples of the original; --calib DATA")


def test_a_model_on_cuda_gets_the_larger_budget_and_the_users_settings_still_win(monkeypatch):
    llama, tokenizer = tiny_model("llama"), tiny_tokenizer()
    monkeypatch.setattr(defaults, "model_device", lambda model: torch.device("cuda"))
    config, line = default_calibration(llama, tokenizer)
    assert config.data == "generated:length=64,batch_size=128"  # one generate call draws them all
    assert (config.num_blocks, config.tune_blocks, config.block_steps, config.tune_steps) == (128, 128, 80, 240)
    assert line.startswith("calibrating on 128 samples of the original")
    chosen, _ = default_calibration(llama, tokenizer, num_blocks=32, block_steps=10)
    assert (chosen.num_blocks, chosen.block_steps, chosen.tune_steps, chosen.data) == (
        32, 10, 240, "generated:length=64,batch_size=32")


def test_the_users_settings_win_over_the_defaults():
    llama, tokenizer = tiny_model("llama"), tiny_tokenizer()
    fast, _ = default_calibration(llama, tokenizer, strategy="fast", num_blocks=4)
    # the default's steps dropped
    assert (fast.strategy, fast.block_steps, fast.tune_steps, fast.num_blocks) == ("fast", None, None, 4)
    longer, _ = default_calibration(llama, tokenizer, block_steps=30, block_len=32)
    assert (longer.block_steps, longer.data) == (30, "generated:length=32,batch_size=16")
    assert fast.data == "generated:length=64,batch_size=4"  # no more samples drawn than are read


def test_the_api_default_is_the_command_lines(monkeypatch, tmp_path):
    """``convert(model, "eln", tokenizer=...)`` calibrates on the original's samples, as ``normswap convert``
    without --calib does (a small budget here, to keep the test fast)."""
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path))
    monkeypatch.setitem(defaults.DEFAULTS, "samples", Default(defaults.SAMPLES, "samples of the original", 2, 16,
                                                              "fast", {}))
    model = tiny_model("llama")
    report = hf_normswap.convert(model, "eln", tokenizer=tiny_tokenizer())
    assert report.calibration["data"] == "generated:length=16,batch_size=2"
    assert report.calibration["strategy"] == "fast"


def test_without_text_each_norm_takes_its_measured_input_scale():
    """A LayerNorm model whose residual stream is 100x larger: the theory at each norm's measured scale, not at
    RMS 1, so the converted model stays close to the original."""
    original = tiny_model("gpt2")
    with torch.no_grad():
        original.transformer.wte.weight.mul_(100)
        original.transformer.wpe.weight.mul_(100)
    measured, assumed = copy.deepcopy(original), copy.deepcopy(original)
    _, selected, _ = plan(original)
    x, is_first = norm_inputs(original, selected[:1], probe_ids(original))[selected[0].name]
    scale = float(x[~is_first].std(-1, unbiased=False).median())
    report = hf_normswap.convert(measured, "eln")
    assert report.calibration is None and measured.config.normswap["convert"]["input_scale"] is None
    first = measured.get_submodule(selected[0].name)
    assert float(first.shape_parameter().detach()) == pytest.approx(ELN.analytic_shape_value("layernorm", 32, scale), rel=1e-4)
    hf_normswap.convert(assumed, "eln", input_scale=1.0)
    inputs = probe_ids(original, seed=3)
    with torch.no_grad():
        reference = original(**inputs).logits
        errors = [float((m(**inputs).logits - reference).norm() / reference.norm()) for m in (measured, assumed)]
    assert errors[0] < 0.5 * errors[1]


def test_without_text_rmsnorm_takes_the_saturating_start_per_channel():
    model = tiny_model("llama")
    report = hf_normswap.convert(model, "eln")
    assert report.calibration is None and model.config.normswap["per_channel"] is True
    assert len(report.converted) == 5
