"""Inference folding (hf_normswap.fold): logits preserved, only foldable norms folded, state dict unchanged."""

import pytest
import torch
from tiny_models import tiny_model

from hf_normswap import convert
from hf_normswap.fold import FoldError, fold
from hf_normswap.model_inputs import dummy_inputs, first_tensor
from hf_normswap.modules import ElementwiseNorm


def _converted(arch, method="eln"):
    model = tiny_model(arch)
    convert(model, to=method)
    torch.manual_seed(5)
    with torch.no_grad():  # non-trivial gamma and bias, as after calibration or fine-tuning
        for module in model.modules():
            if isinstance(module, ElementwiseNorm):
                module.weight.mul_(1 + 0.5 * torch.randn_like(module.weight))
                if module.bias is not None:
                    module.bias.add_(0.3 * torch.randn_like(module.bias))
    return model


def _logits(model, inputs):
    with torch.no_grad():
        return first_tensor(model(**inputs))


def _assert_fp32_close(got, want):
    assert got.shape == want.shape
    scale = want.abs().max().item()
    assert scale > 0
    assert (got - want).abs().max().item() <= 1e-5 * scale  # fp32 rounding of the refactored products


@pytest.mark.parametrize("method", ["eln", "dyt", "derf"])
def test_llama_fold_preserves_logits_and_folds_every_norm(method):
    model = _converted("llama", method)
    inputs = dummy_inputs(model, batch=2, seq_len=12, seed=3)
    before = _logits(model, inputs)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    report = fold(model)
    _assert_fp32_close(_logits(model, inputs), before)
    assert report.folded["model.layers.0.input_layernorm"] == [
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert report.folded["model.layers.1.post_attention_layernorm"] == [
        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert "model.norm" in report.folded  # lm_head is not tied in this tiny config: folding it is exact
    assert not report.skipped
    for name in report.folded:
        assert torch.equal(model.get_submodule(name).weight, torch.ones_like(model.get_submodule(name).weight))
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # same keys and shapes: loadable
    assert model.config.normswap["folded"] == report.folded


def test_gpt2_fold_moves_bias_into_conv1d_and_refuses_tied_lm_head():
    model = _converted("gpt2", "dyt")
    inputs = dummy_inputs(model, batch=2, seq_len=12, seed=3)
    before = _logits(model, inputs)
    report = fold(model)
    _assert_fp32_close(_logits(model, inputs), before)
    assert set(report.folded) == {f"transformer.h.{i}.{n}" for i in range(2) for n in ("ln_1", "ln_2")}
    assert report.folded["transformer.h.0.ln_1"] == ["transformer.h.0.attn.c_attn"]
    (skipped,) = report.skipped
    assert skipped["name"] == "transformer.ln_f" and "tied" in skipped["reason"]
    assert torch.equal(model.transformer.h[0].ln_1.bias, torch.zeros(32))
    # the embeddings the tied lm_head shares were not touched
    assert torch.equal(model.transformer.wte.weight, _converted("gpt2", "dyt").transformer.wte.weight)


def test_norms_feeding_residuals_or_model_outputs_are_refused():
    model = _converted("bert")
    inputs = dummy_inputs(model, batch=2, seq_len=12, seed=3)
    before = _logits(model, inputs)
    report = fold(model)
    _assert_fp32_close(_logits(model, inputs), before)
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert "feeds add" in reasons["bert.encoder.layer.0.attention.output.LayerNorm"]  # residual stream
    assert "tied" in reasons["cls.predictions.transform.LayerNorm"]
    base = _converted("bart")  # the encoder's last norm output is returned as encoder_last_hidden_state
    base_report = fold(base)
    assert "output of the model" in {s["name"]: s["reason"] for s in base_report.skipped}[
        "model.encoder.layers.1.final_layer_norm"]


def test_folded_state_dict_loads_into_a_converted_model():
    model = _converted("llama")
    inputs = dummy_inputs(model, batch=1, seq_len=10, seed=4)
    fold(model)
    fresh = tiny_model("llama")
    convert(fresh, to="eln")
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(_logits(fresh, inputs), _logits(model, inputs))


def test_fold_needs_converted_norms():
    with pytest.raises(FoldError, match="convert it before folding"):
        fold(tiny_model("llama"))
