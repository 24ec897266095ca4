"""A recovered element-wise checkpoint, linearised (``normswap convert DIR --to linear``), trains on in the recipe
(``model: DIR``, ``original: ORIGINAL``) and saves a linear model."""

from __future__ import annotations

import os
import subprocess
import sys

import hf_normswap
from hf_normswap import cli
from hf_normswap.modules import Linear
from test_finetune_recipe import RECIPE, ROOT, tiny_setup, write_config  # noqa: F401 (a fixture)


def test_a_linearised_checkpoint_trains_briefly_in_the_recipe(tiny_setup):
    root, model_dir = tiny_setup
    eln = root / "eln-checkpoint"
    model = hf_normswap.load_model(str(model_dir))[0]
    hf_normswap.convert(model, "eln", calibration=None)
    hf_normswap.save_pretrained(model, eln, tokenizer=hf_normswap.load_model(str(model_dir))[1])
    linear = root / "linearised"
    assert cli.main(["convert", str(eln), "--to", "linear", "--max-saturation", "1", "--calib", str(root / "train.txt"),
                     "--calib-blocks", "2", "--calib-len", "32", "--output", str(linear)]) == 0
    output = root / "linearised-run"
    config = write_config(root, linear, output, original=str(model_dir), progressive={"enabled": False},
                          distill={"weight": 1.0})
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(RECIPE), "--config", str(config)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    final = hf_normswap.load(output / "final")
    assert sum(isinstance(m, Linear) for m in final.modules()) == 5
    assert final.config.normswap["method"] == "linear" and final.config.normswap["training"]
