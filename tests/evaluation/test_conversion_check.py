"""The check after a conversion: one line with the ratio, a warning naming the cause and the fix when the converted
model is far off, and its record in config.json and the model card."""

import json

import pytest
import torch
import transformers

from hf_normswap.cli import main
from hf_normswap.evaluation.conversion_check import ConversionCheck
from hf_normswap.model_inputs import ModelFacts
from tiny_models import tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def confident_llama(tmp_path_factory):
    """A tiny llama whose head is 30x larger: its logits matter, so a broken conversion shows in perplexity."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    path = tmp_path_factory.mktemp("confident-llama")
    model.save_pretrained(path)
    return str(path)


def test_a_failed_conversion_warns_and_is_recorded(confident_llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", confident_llama, "--to", "eln", "--calib", "none", "--input-scale", "1e-6",
                 "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert "check: perplexity" in captured.out and "on random token ids" in captured.out  # no tokenizer saved
    warning = [line for line in captured.err.splitlines() if line.startswith("normswap: warning:")]
    assert len(warning) == 1 and "the conversion failed" in warning[0]
    assert "inputs of RMS 1e-06" in warning[0] and "leave --input-scale out" in warning[0]
    check = json.loads((out / "config.json").read_text())["normswap"]["check"]
    assert check["metric"] == "perplexity" and check["failed"] and check["value"] > 50
    assert "Check after the conversion" in (out / "README.md").read_text()


def test_no_check_skips_it(confident_llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", confident_llama, "--to", "eln", "--calib", "none", "--no-check",
                 "--output", str(out)]) == 0
    assert "check:" not in capsys.readouterr().out
    assert "check" not in json.loads((out / "config.json").read_text())["normswap"]


def test_an_encoder_is_checked_by_output_cosine():
    encoder = transformers.BertModel(tiny_config("bert")).eval()
    check = ConversionCheck(encoder, ModelFacts.read(encoder), tiny_tokenizer())
    result = check.after(encoder)
    assert result.metric == "cosine" and result.value == pytest.approx(1.0) and not result.failed
    assert result.warning() is None
    assert "sentences of the offline held-out text" in result.data


def _collapsed(model):
    """The model's output made uniform over its vocabulary, as a conversion that saturates every norm leaves it."""
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def test_a_uniform_output_is_a_failure_whatever_the_ratio():
    """A tiny model collapsed to uniform output (37.7x) passed the 50x check."""
    model = tiny_model("llama")
    check = ConversionCheck(model, ModelFacts.read(model))
    check.original = model.config.vocab_size / 37.7  # a tiny original: uniform output is "only" 37.7x its perplexity
    result = check.after(_collapsed(model))
    assert result.value == pytest.approx(37.7, rel=1e-3) and result.failed
    assert "output is uniform over its vocabulary" in result.warning()


def test_a_non_finite_original_is_reported_as_such_not_blamed_on_calibration():
    """"perplexity inf -> inf (nanx the original's)", then "Cause: calibration ... was too short"."""
    model = tiny_model("llama")
    check = ConversionCheck(model, ModelFacts.read(model))
    check.original = float("inf")
    result = check.after(model)
    assert "not comparable, the original's own is not finite" in result.line() and "nanx" not in result.line()
    warning = result.warning({"calibration": {"data": "generated", "strategy": "block"}})
    assert "the original model's own perplexity" in warning and "calibration" not in warning
