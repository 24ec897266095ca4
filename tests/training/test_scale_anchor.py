"""The pre-logit scale anchor (hf_normswap.training.scale_anchor): its formula, its hooks and the recipe's use."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import hf_normswap
from hf_normswap.training.config import read_recipe_config
from hf_normswap.training.scale_anchor import ScaleAnchor, ScaleAnchorError, prelogit_scale_error
from hf_normswap.validation import ValidationError
from test_finetune_recipe import RECIPE, ROOT, tiny_setup, write_config  # noqa: F401 (a fixture)
from tiny_models import tiny_model


def tokens_of_rms(rms: list[list[float]], dim: int = 16) -> torch.Tensor:
    """``(batch, seq, dim)`` whose token ``[b, t]`` has root mean square ``rms[b][t]``."""
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    direction = direction / direction.pow(2).mean().sqrt()
    return torch.tensor(rms).unsqueeze(-1) * direction


def test_the_error_is_the_spread_of_the_counted_tokens_log_scale():
    x = tokens_of_rms([[1000.0, 2.0, 8.0, 4.0], [1000.0, 4.0, 4.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the last token is padding; position 0 never counts
    counted = [math.log(r) for r in (2.0, 8.0, 4.0, 4.0, 4.0)]
    mean = sum(counted) / 5
    expected = sum((v - mean) ** 2 for v in counted) / 5
    assert float(prelogit_scale_error(x, mask)) == pytest.approx(expected, rel=1e-5)
    # every counted token at one scale: no error, whatever the scale and whatever position 0 and padding hold
    level = tokens_of_rms([[1000.0, 3.0, 3.0, 3.0], [0.01, 3.0, 3.0, 1e4]])
    assert float(prelogit_scale_error(level, mask)) == pytest.approx(0.0, abs=1e-9)


def test_the_anchor_hooks_the_final_norm_and_its_gradient_reaches_the_blocks():
    torch.manual_seed(0)
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="eln")
    anchor = ScaleAnchor.of(model, {c.name: c.role for c in report.converted})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    captured = []
    handle = model.model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    model(input_ids=ids)
    handle.remove()
    loss = anchor.loss()
    assert float(loss.detach()) > 0
    torch.testing.assert_close(loss, prelogit_scale_error(captured[0]))
    loss.backward()
    assert model.get_parameter("model.layers.1.mlp.down_proj.weight").grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="a forward of the model"):
        anchor.loss()  # a step's input is read once
    anchor.on_train_end(None, None, None)
    assert not model.model.norm._forward_pre_hooks


def test_a_model_without_a_converted_final_norm_is_refused():
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="eln", roles=["attention_input", "mlp_input"], calibration=None)
    assert "final" not in {c.role for c in report.converted}
    with pytest.raises(ScaleAnchorError, match="distill.scale=0"):
        ScaleAnchor.of(model, {c.name: c.role for c in report.converted})
    with pytest.raises(ValidationError, match="distill.scale"):
        read_recipe_config(None, ["distill.weight=0", "distill.scale=0.5"])
    with pytest.raises(ValidationError, match="distill.scale"):
        read_recipe_config(None, ["distill.scale=-1"])


def test_the_recipe_trains_with_the_anchor_logs_it_and_saves_a_model_without_hooks(tiny_setup):
    root, model_dir = tiny_setup
    output = root / "anchored"
    config = write_config(root, model_dir, output, progressive={"enabled": False},
                          distill={"weight": 1.0, "temperature": 1.0, "scale": 1.0})
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(RECIPE), "--config", str(config)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads((output / "summary.json").read_text())
    logged = [h["scale_loss"] for h in summary["history"] if "scale_loss" in h]
    assert len(logged) == 4 and all(value > 0 for value in logged)
    for h in (h for h in summary["history"] if "scale_loss" in h):  # distill weight 1, no hidden term: KD + S
        assert h["loss"] == pytest.approx(h["kd_loss"] + h["scale_loss"], rel=1e-3, abs=1e-4)
    assert summary["config"]["distill"]["scale"] == 1.0
    assert summary["reload_identical"] is True


def test_anchored_at_all_the_loss_is_the_mean_error_over_every_converted_norm_input_and_works_for_dyt():
    torch.manual_seed(0)
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="dyt", calibration=None)
    roles = {c.name: c.role for c in report.converted}
    anchor = ScaleAnchor.of(model, roles, at="all")
    captured = {}
    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: captured.__setitem__(name, args[0])) for name in roles]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids[:1])  # an evaluation forward that no loss reads is replaced by the next one
    model(input_ids=ids)
    for handle in handles:
        handle.remove()
    expected = torch.stack([prelogit_scale_error(x) for x in captured.values()]).mean()
    assert len(captured) == len(roles) == 5
    torch.testing.assert_close(anchor.loss(), expected)
    assert float(expected.detach()) != pytest.approx(float(prelogit_scale_error(captured["model.norm"]).detach()))
    anchor.on_train_end(None, None, None)
    assert not any(model.get_submodule(name)._forward_pre_hooks for name in roles)
    with pytest.raises(ValidationError, match="distill.scale_at"):
        read_recipe_config(None, ["distill.scale_at=middle"])
