"""The hand-over of a linear module's first-position scale to the common one (hf_normswap.training.first_scale)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers

import hf_normswap
from hf_normswap.checkpoint.stock_export import export_stock
from hf_normswap.modules import Linear
from hf_normswap.training.config import read_recipe_config
from hf_normswap.training.first_scale import FirstScaleHandover, handover_progress
from hf_normswap.validation import ValidationError
from test_finetune_recipe import RECIPE, ROOT, tiny_setup, write_config  # noqa: F401 (a fixture)


def test_the_hand_over_runs_over_the_last_fraction_of_the_steps_and_ends_at_the_last():
    assert [handover_progress(step, 8, 0.5) for step in range(8)] == [0, 0, 0, 0, 0.25, 0.5, 0.75, 1.0]
    assert [handover_progress(step, 4, 0.0) for step in range(4)] == [0, 0, 0, 1.0]
    with pytest.raises(ValidationError, match="first_scale_handover"):
        read_recipe_config(None, ["first_scale_handover=2"])


def _module(log_first: float) -> Linear:
    module = Linear(4, 1.0)
    with torch.no_grad():
        module.log_first.fill_(log_first)
    return module


def test_the_first_scale_reaches_the_common_one_and_a_resumed_chunk_goes_on_where_it_stood():
    modules = [_module(math.log(0.1)), _module(0.0)]
    handover = FirstScaleHandover.of(torch.nn.ModuleList(modules), fraction=0.5)
    assert handover.modules == modules[:1]  # one scale already: nothing to hand over
    state = SimpleNamespace(global_step=0, max_steps=8)
    handover.on_train_begin(None, state, None)
    seen = []
    for step in range(5):  # a chunk that stops after 5 of 8 steps
        state.global_step = step
        handover.on_step_begin(None, state, None)
        seen.append(float(modules[0].log_first.detach()))
    state.global_step = 5
    handover.on_train_end(None, state, None)
    assert seen == pytest.approx([math.log(0.1) * v for v in (1, 1, 1, 1, 0.75)])
    assert float(modules[0].log_first.detach()) == pytest.approx(0.75 * math.log(0.1))  # left where the chunk stood
    resumed = FirstScaleHandover.of(torch.nn.ModuleList(modules), fraction=0.5)
    resumed.on_train_begin(None, state, None)
    for step in range(5, 8):
        state.global_step = step
        resumed.on_step_begin(None, state, None)
        seen.append(float(modules[0].log_first.detach()))
    state.global_step = 8
    resumed.on_train_end(None, state, None)
    assert seen[5:] == pytest.approx([0.5 * math.log(0.1), 0.25 * math.log(0.1), 0.0])
    assert float(modules[0].log_first.detach()) == 0.0


def test_the_recipe_recovers_a_linear_model_to_one_scale_that_exports_as_the_stock_architecture(tiny_setup):
    """End to end: calibration gives position 0 its own scale, the recipe (with the scale anchor at every norm)
    hands it over by the last step, and the final checkpoint exports to plain transformers."""
    root, model_dir = tiny_setup
    output = root / "linear"
    config = write_config(root, model_dir, output, method="linear", progressive={"enabled": False},
                          first_scale_handover=0.5, distill={"weight": 1.0, "scale": 1.0, "scale_at": "all"})
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(RECIPE), "--config", str(config)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    calibrated = hf_normswap.load(output / "calibrated")
    assert any(float(m.log_first.detach()) != 0 for m in calibrated.modules() if isinstance(m, Linear))
    final = hf_normswap.load(output / "final")
    modules = [m for m in final.modules() if isinstance(m, Linear)]
    assert len(modules) == 5 and all(float(m.log_first.detach()) == 0 for m in modules)
    _, _, difference = export_stock(final, root / "linear-stock")
    assert difference <= 1e-5
    stock = transformers.AutoModelForCausalLM.from_pretrained(root / "linear-stock").eval()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = final(input_ids=ids).logits, stock(input_ids=ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(ours.abs().max())
