"""ConvertConfig: checked when made, recorded in config.json, and read back into the same conversion."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

import hf_normswap
from hf_normswap import CalibrationConfig, ConversionError, ConvertConfig


@pytest.mark.parametrize("settings, message", [
    (dict(method="rms"), "unknown method 'rms'"),
    (dict(roles=("attention_input", "nope")), "unknown role(s) ['nope']"),
    (dict(include="("), "is not a valid regular expression"),
    (dict(calibration=CalibrationConfig(strategy="xx")), "unknown calibration strategy 'xx'"),
])
def test_a_bad_setting_is_refused_when_the_config_is_made(settings, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        ConvertConfig(**settings)


def test_settings_beside_a_config_are_refused():
    with pytest.raises(ConversionError, match="in the ConvertConfig"):
        hf_normswap.convert(tiny_model("llama"), ConvertConfig(), per_channel=True)


def test_a_config_converts_as_the_same_keywords_do():
    by_config, by_keywords = tiny_model("gpt2"), tiny_model("gpt2")
    hf_normswap.convert(by_config, ConvertConfig(method="dyt", include=r"\.0\.", per_channel=True))
    hf_normswap.convert(by_keywords, "dyt", include=r"\.0\.", per_channel=True)
    assert by_config.config.normswap == by_keywords.config.normswap
    expected = by_keywords.state_dict()
    assert by_config.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in by_config.state_dict().items())


def test_the_recorded_config_reads_back_and_converts_the_same(tmp_path):
    tokenizer = tiny_tokenizer()
    calibration = CalibrationConfig(data="builtin", tokenizer=tokenizer, num_blocks=4, block_len=16, progress=False,
                                    strategy="block", block_steps=3)
    config = ConvertConfig(method="eln", exclude=r"model\.norm$", calibration=calibration)
    model = tiny_model("llama")
    hf_normswap.convert(model, config)
    hf_normswap.save_pretrained(model, tmp_path / "out", tokenizer=tokenizer)

    read = ConvertConfig.from_pretrained(tmp_path / "out")
    assert read.to_dict() == config.to_dict()
    for name in ("data", "num_blocks", "block_len", "strategy", "block_steps", "seed", "precision"):
        assert getattr(read.calibration, name) == getattr(calibration, name), name
    again = tiny_model("llama")
    read.calibration.tokenizer, read.calibration.progress = tokenizer, False
    hf_normswap.convert(again, read)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_directory_that_is_not_a_conversion_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="not a checkpoint converted by hf_normswap"):
        ConvertConfig.from_pretrained(tmp_path)
