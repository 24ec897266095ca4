"""Norm discovery, classification, roles and conversion over tiny random models of 26 architectures."""

import pytest
import torch
import torch.nn.functional as F

import hf_normswap
from hf_normswap.discovery.norms import norm_parameters
from hf_normswap.model_inputs import dummy_inputs, first_tensor
from hf_normswap.modules import ElementwiseNorm
from hf_normswap.discovery import roles as role_labelling
from hf_normswap.discovery.roles import ROLES
from matrix import ANALYTIC, cases, converted
from tiny_models import ARCHITECTURES, tiny_model

# model_type -> (number of norms in the 2-layer tiny model, kind, Gemma-style 1+w weight)
EXPECTED = {
    "gpt2": (5, "layernorm", False), "gpt_neox": (5, "layernorm", False), "opt": (5, "layernorm", False),
    "bloom": (6, "layernorm", False), "falcon": (5, "layernorm", False), "phi": (3, "layernorm", False),
    "phi3": (5, "rmsnorm", False), "llama": (5, "rmsnorm", False), "mistral": (5, "rmsnorm", False),
    "mixtral": (5, "rmsnorm", False), "qwen2": (5, "rmsnorm", False), "qwen3": (9, "rmsnorm", False),
    "gemma": (5, "rmsnorm", True), "gemma2": (9, "rmsnorm", True), "gemma3_text": (13, "rmsnorm", True),
    "olmo": (5, "layernorm", False), "olmo2": (9, "rmsnorm", False), "cohere": (3, "layernorm", False),
    "starcoder2": (5, "layernorm", False), "stablelm": (5, "layernorm", False), "bert": (6, "layernorm", False),
    "roberta": (6, "layernorm", False), "t5": (12, "rmsnorm", False), "bart": (12, "layernorm", False),
    "vit": (5, "layernorm", False), "whisper": (12, "layernorm", False),
}

# a few roles that a name-based guess gets wrong: the behavioural labels must get them right
ROLE_CHECKS = {
    "llama": {"model.layers.0.input_layernorm": "attention_input",
              "model.layers.0.post_attention_layernorm": "mlp_input", "model.norm": "final"},
    "gemma2": {"model.layers.0.post_attention_layernorm": "post_norm",
               "model.layers.0.pre_feedforward_layernorm": "mlp_input"},
    "bert": {"bert.embeddings.LayerNorm": "embedding", "bert.encoder.layer.0.attention.output.LayerNorm": "post_norm",
             "bert.encoder.layer.0.output.LayerNorm": "post_norm"},
    "bart": {"model.encoder.layers.0.self_attn_layer_norm": "post_norm",
             "model.encoder.layernorm_embedding": "embedding"},
    "whisper": {"model.encoder.layers.0.self_attn_layer_norm": "attention_input",
                "model.decoder.layers.0.encoder_attn_layer_norm": "attention_input",
                "model.encoder.layer_norm": "final"},
    "qwen3": {"model.layers.0.self_attn.q_norm": "qk_norm"},
    "t5": {"decoder.block.0.layer.2.layer_norm": "mlp_input", "encoder.final_layer_norm": "final"},
}


def _reference_output(module, info, x):
    weight, bias = norm_parameters(module, info)
    if info.kind == "layernorm":
        y = F.layer_norm(x, x.shape[-1:], eps=info.eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + info.eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_norm_found_and_classified_by_its_numerics(arch):
    model = tiny_model(arch)
    norms = hf_normswap.inspect(model)
    count, kind, offset = EXPECTED[arch]
    assert len(norms) == count
    for info in norms:
        assert info.kind == kind and info.weight_offset == offset, info
        assert info.role in ROLES
        module = model.get_submodule(info.name)
        x = torch.randn(3, *info.normalized_shape) * 4 + 2
        with torch.no_grad():
            torch.testing.assert_close(module(x), _reference_output(module, info, x), rtol=1e-4, atol=1e-4)
    for name, role in ROLE_CHECKS.get(arch, {}).items():
        assert next(n.role for n in norms if n.name == name) == role, name


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_role_labelling_costs_the_same_forward_passes_whatever_the_depth(arch):
    passes, roles = [], []
    for layers in (2, 8):
        model = tiny_model(arch, num_hidden_layers=layers)
        calls = []
        model.register_forward_pre_hook(lambda module, args: calls.append(1))
        roles.append([n.role for n in hf_normswap.inspect(model)])
        passes.append(len(calls))
    assert passes[0] == passes[1] <= 2
    assert len(roles[1]) > len(roles[0]) and set(roles[1]) == set(roles[0])


@pytest.mark.parametrize("failing", ["inputs", "forward"])
def test_a_model_that_cannot_run_on_dummy_inputs_is_labelled_by_name(failing, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError(f"no {failing}")

    model = tiny_model("llama")
    if failing == "inputs":
        monkeypatch.setattr(role_labelling, "dummy_inputs", fail)
    else:
        model.model.layers[0].register_forward_pre_hook(fail)
    labels = {n.name: n.role for n in hf_normswap.inspect(model)}
    assert labels["model.norm"] == "final"
    assert {labels[f"model.layers.{i}.{k}"] for i in (0, 1) for k in ("input_layernorm", "post_attention_layernorm")
            } == {"other"}


@cases(ANALYTIC)
def test_convert_all_norms_and_forward_is_finite_in_fp32_and_bf16(case):
    model, report = converted(case)
    arch, method = case.arch, case.method
    assert len(report.converted) == len(report.found) == EXPECTED[arch][0]
    assert not report.skipped
    modules = [m for m in model.modules() if isinstance(m, ElementwiseNorm)]
    assert len(modules) == len(report.converted)
    assert model.config.normswap["method"] == method
    assert set(model.config.normswap["converted"]) == {c.name for c in report.converted}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        with torch.no_grad():
            out = first_tensor(model(**dummy_inputs(model)))
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_default_selection_leaves_qk_norms_and_reports_why():
    model = tiny_model("qwen3")
    report = hf_normswap.convert(model, to="eln")
    assert len(report.converted) == 5
    assert {s["name"] for s in report.skipped} == {f"model.layers.{i}.self_attn.{p}_norm" for i in (0, 1) for p in "qk"}
    assert all("qk_norm not selected" in s["reason"] for s in report.skipped)


def test_converted_modules_carry_weights_and_gemma_offset():
    model = tiny_model("gemma")
    source = model.model.layers[0].input_layernorm
    expected = (1 + source.weight.detach()) * source.weight.shape[0] ** 0.5
    hf_normswap.convert(model, to="dyt", input_scale=1.0)  # the theory's start: the weights carried over as they are
    torch.testing.assert_close(model.model.layers[0].input_layernorm.weight.detach(), expected)


def test_include_exclude_patterns_select_subsets():
    report = hf_normswap.convert(tiny_model("llama"), to="eln", include=r"layers\.1\.", exclude="post_attention")
    assert [c.name for c in report.converted] == ["model.layers.1.input_layernorm"]


def test_user_errors_are_conversion_errors():
    with pytest.raises(hf_normswap.ConversionError, match="unknown method"):
        hf_normswap.convert(tiny_model("llama"), to="batchnorm")
    with pytest.raises(hf_normswap.ConversionError, match="matches no norm"):
        hf_normswap.convert(tiny_model("llama"), to="eln", include="nothing_like_this")
    with pytest.raises(hf_normswap.ConversionError, match="no LayerNorm or RMSNorm"):
        hf_normswap.convert(torch.nn.Sequential(torch.nn.Linear(3, 3)), to="eln")


def test_bf16_model_keeps_shape_parameters_in_fp32():
    model = tiny_model("llama").to(torch.bfloat16)
    hf_normswap.convert(model, to="eln")
    module = model.model.norm
    assert module.weight.dtype == torch.bfloat16 and module.log_beta.dtype == torch.float32
