"""The check after a conversion: one line with the ratio, a warning naming the cause and the fix when the converted
model is far off, and its record in config.json and the model card."""

import json

import pytest
import torch
import transformers

from hf_normswap.cli import main
from hf_normswap.evaluation.conversion_check import ConversionCheck
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
    check = ConversionCheck(encoder, tiny_tokenizer())
    result = check.after(encoder)
    assert result.metric == "cosine" and result.value == pytest.approx(1.0) and not result.failed
    assert result.warning() is None
    assert "sentences of the offline held-out text" in result.data
