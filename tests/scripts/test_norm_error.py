"""scripts/norm_error.py: each converted module against the norm it replaced, on the converted model's inputs."""

from __future__ import annotations

import json

import pytest
import torch

import hf_normswap
from file_modules import import_file
from tiny_models import tiny_model, tiny_tokenizer


def test_each_converted_norm_is_measured_against_the_original_on_its_own_input(tmp_path):
    bench = import_file("scripts/norm_error.py")
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
    assert bench.norm_errors(model, original, ids)[name]["rel_error"] == pytest.approx(expected, rel=1e-4)
    assert all(0 < n["rel_error"] and 0 <= n["saturation"] <= 1 for n in norms.values())
