"""scripts/analyses/line_error.py: each element-wise module against the line linearise fits and its tangent."""

from __future__ import annotations

import json

import torch

import hf_normswap
from file_modules import import_file
from tiny_models import tiny_model, tiny_tokenizer


def test_each_module_is_measured_against_its_line_and_its_tangent(tmp_path):
    bench = import_file("scripts/analyses/line_error.py")
    model = tiny_model("llama")
    hf_normswap.convert(model, to="dyt", calibration=None)
    hf_normswap.save_pretrained(model, tmp_path / "dyt", tokenizer=tiny_tokenizer())
    out = tmp_path / "lines.jsonl"
    assert bench.main([str(tmp_path / "dyt"), "--data", "builtin", "--blocks", "2", "--block-len", "16",
                       "--out", str(out)]) == 0
    modules = json.loads(out.read_text())["modules"]
    assert len(modules) == 5
    for e in modules.values():
        assert e["line"] <= e["tangent"] + 1e-9  # the least-squares line is never the farther one
        assert e["line_first_own"] <= e["line_first"] + 1e-9  # position 0's best factor is at least as close as 1
    # by hand for one module: a DyT far out on its curve is off its tangent by tanh(a x) - a x
    module = model.get_submodule("model.norm")
    x = torch.linspace(-30, 30, 32, dtype=torch.float64).expand(1, 8, 32).clone()
    with torch.no_grad():
        curve = module.double()(x)
        line = module.weight.double() * module.alpha.double() * x
        torch.testing.assert_close(bench.tangent(module, x), line)
    assert bench.relative(line, curve) == float((line - curve).norm() / curve.norm())
