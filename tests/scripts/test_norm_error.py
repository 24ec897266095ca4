"""scripts/analyses/norm_error.py: each converted module against the norm it replaced, on the converted model's inputs."""

from __future__ import annotations

import json

import pytest
import torch

import hf_normswap
from file_modules import import_file
from tiny_models import tiny_model, tiny_tokenizer


def test_each_converted_norm_is_measured_against_the_original_on_its_own_input(tmp_path):
    bench = import_file("scripts/analyses/norm_error.py")
    original_dir, converted_dir = tmp_path / "llama", tmp_path / "llama-eln"
    original = tiny_model("llama")
    original.save_pretrained(original_dir)
    tiny_tokenizer().save_pretrained(original_dir)
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="eln")
    hf_normswap.save_pretrained(model, converted_dir)
    out = tmp_path / "errors.jsonl"
    assert bench.main([str(converted_dir), "--against", str(original_dir), "--data", "builtin", "--blocks", "2",
                       "--block-len", "16", "--out", str(out)]) == 0
    norms = json.loads(out.read_text())["norms"]
    assert set(norms) == {c.name for c in report.converted}
    # by hand for one norm: its input in the converted model, the original's norm on it
    name = "model.layers.1.input_layernorm"
    ids = torch.tensor(tiny_tokenizer()(" ".join(["the"] * 40))["input_ids"][:16])[None]
    captured = {}
    handle = model.get_submodule(name).register_forward_hook(lambda m, a, o: captured.update(x=a[0], y=o))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    with torch.no_grad():
        target = original.get_submodule(name)(captured["x"])
    expected = float((captured["y"] - target)[:, 1:].norm() / target[:, 1:].norm())
    errors = bench.norm_errors(model, original, ids)[name]
    assert errors["rel_error"] == pytest.approx(expected, rel=1e-4)
    # the rescaled error: each channel of the module's output times its least-squares factor toward the norm's
    new, old = captured["y"][0, 1:].double(), target[0, 1:].double()
    factors = (new * old).sum(0) / (new * new).sum(0)
    rescaled = float((old - factors * new).norm() / old.norm())
    assert errors["rel_error_rescaled"] == pytest.approx(rescaled, rel=1e-4)
    assert errors["rel_error_rescaled"] < errors["rel_error"]
    assert all(0 < n["rel_error_rescaled"] <= n["rel_error"] and 0 <= n["saturation"] <= 1 for n in norms.values())


def test_an_output_off_only_by_a_channel_scale_has_no_rescaled_error():
    bench = import_file("scripts/analyses/norm_error.py")
    torch.manual_seed(0)
    old = torch.randn(50, 8, dtype=torch.float64)
    new = old * torch.linspace(0.5, 2.0, 8, dtype=torch.float64)
    sums = torch.stack([new * old, new * new, old * old]).sum(1)
    assert bench.rescaled_error(*sums) == pytest.approx(0.0, abs=1e-6)
    sums = torch.stack([-old * old, old * old, old * old]).sum(1)  # a sign flip is a scale too
    assert bench.rescaled_error(*sums) == pytest.approx(0.0, abs=1e-6)
    noisy = old + torch.randn(50, 8, dtype=torch.float64)
    sums = torch.stack([noisy * old, noisy * noisy, old * old]).sum(1)
    assert 0.1 < bench.rescaled_error(*sums) < float((noisy - old).norm() / old.norm())
