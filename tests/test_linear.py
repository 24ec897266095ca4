"""The ``linear`` method (a fixed scale, FakeLN): its formula, and that it converts, calibrates, saves, reloads
(package and remote code) and folds like the element-wise methods, with its scale held fixed while weights train."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from package_copy import REMOTE
from tiny_models import tiny_model

import hf_normswap
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.calibration.fitting import saturated_share
from hf_normswap.fold import fold
from hf_normswap.modules import Linear, adam_groups
from hf_normswap.training.trainable import parameter_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_linear_is_weight_times_the_input_over_a_fixed_scale_centred_for_a_layernorm(kind):
    gamma, beta = 1 + 0.1 * torch.randn(8), torch.randn(8)
    module = Linear.from_norm(gamma, beta, kind=kind, normalized_shape=(8,), input_scale=4.0)
    x = 3 * torch.randn(5, 8) + 2
    centred = x - x.mean(-1, keepdim=True) if kind == "layernorm" else x
    torch.testing.assert_close(module(x), gamma * centred / 4.0 + beta)
    torch.testing.assert_close(module(2 * x) - beta, 2 * (module(x) - beta))  # no saturation anywhere
    assert module.amplitude == 1.0 and not module.per_channel and saturated_share(module, 100 * x) == 0.0


def test_the_scale_has_no_learning_rate_so_the_weight_carries_every_change():
    model = tiny_model("llama")
    hf_normswap.convert(model, "linear", calibration=None, input_scale=1.0)
    modules = [m for m in model.modules() if isinstance(m, Linear)]
    scales = {id(m.log_alpha) for m in modules}
    groups = adam_groups(modules, 1e-2)
    assert all(g["lr"] == 0 for g in groups if any(id(p) in scales for p in g["params"]))
    assert any(g["lr"] == 1e-2 for g in groups)
    groups = parameter_groups(model, lr=1e-3, weight_decay=0.0, shape_lr=1e-1)
    shape_groups = [g for g in groups if g["name"] == "shape"]
    assert shape_groups and all(g["lr"] == 0 for g in shape_groups)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("strategy", ["auto", "block"])
def test_linear_calibrates_saves_reloads_and_folds(arch, strategy, tmp_path):
    original = tiny_model(arch)
    model = tiny_model(arch)
    report = hf_normswap.convert(model, "linear", calibration=CalibrationConfig(
        data=_ids(), batch_size=4, strategy=strategy, block_steps=4, tune_steps=4, progress=False))
    modules = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(modules) == len(report.converted) > 0
    assert all(m.centred == (arch != "llama") for m in modules)  # GPT-2 and BERT have LayerNorms
    ids = _ids(seed=1)[:2]
    with torch.no_grad():
        logits, reference = model(input_ids=ids).logits, original(input_ids=ids).logits
    assert logits.isfinite().all() and float((logits - reference).abs().mean()) < float(reference.abs().mean())
    hf_normswap.save_pretrained(model, tmp_path / "converted")
    assert model.config.normswap["per_channel"] is False
    with torch.no_grad():
        assert torch.equal(hf_normswap.load(tmp_path / "converted")(input_ids=ids).logits, logits)
        assert fold(model).folded
        torch.testing.assert_close(model(input_ids=ids).logits, logits, atol=1e-5, rtol=1e-5)


def test_linear_gpt2_reloads_through_remote_code_with_its_centring(tmp_path):
    model = tiny_model("gpt2")
    hf_normswap.convert(model, "linear", calibration=CalibrationConfig(data=_ids(), batch_size=4, progress=False))
    hf_normswap.save_pretrained(model, tmp_path / "converted")
    inputs = {"input_ids": _ids(seed=1)[:2]}
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", "-c", REMOTE, str(tmp_path / "converted"), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "remote.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "remote.pt"), model(**inputs).logits)


def test_the_first_position_has_its_own_scale_in_a_sequence_and_none_in_one_decoding_step():
    module = Linear.from_norm(torch.ones(8), None, kind="rmsnorm", normalized_shape=(8,), input_scale=2.0)
    module.set_first_scale(50.0, 2.0)
    x = torch.randn(3, 5, 8)
    y = module(x)
    torch.testing.assert_close(y[:, 0], x[:, 0] / 50.0)
    torch.testing.assert_close(y[:, 1:], x[:, 1:] / 2.0)
    torch.testing.assert_close(module(x[:, :1]), x[:, :1] / 2.0)  # a decoding step is never position 0
    torch.testing.assert_close(module.common_rows(x[:, 0], torch.ones(3, dtype=torch.bool)) / 2.0, x[:, 0] / 50.0)


@pytest.mark.parametrize("first_scale", [True, False])
def test_calibration_measures_the_first_position_scale_only_when_asked(first_scale):
    model = tiny_model("llama")
    hf_normswap.convert(model, "linear", calibration=CalibrationConfig(
        data=_ids(), batch_size=4, block_steps=2, tune_steps=0, first_scale=first_scale, progress=False))
    firsts = torch.stack([m.log_first.detach() for m in model.modules() if isinstance(m, Linear)])
    assert bool(firsts.ne(0).any()) == first_scale
    assert model.config.normswap["calibration"]["first_scale"] is first_scale
