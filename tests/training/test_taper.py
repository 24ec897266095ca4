"""The taper (hf_normswap.training.taper): g * norm(x) + (1 - g) * new(x), g from 1 to 0 over a share of the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_normswap
from hf_normswap.training.config import read_recipe_config
from hf_normswap.training.progressive import ProgressiveSwap
from hf_normswap.training.taper import TaperStage, taper_stages, taper_steps
from hf_normswap.validation import ValidationError
from test_finetune_recipe import RECIPE, ROOT, logits, tiny_setup, write_config  # noqa: F401 (a fixture)
from tiny_models import tiny_model


def test_gates_fall_from_one_to_zero_in_each_shape():
    roles = {f"model.layers.{i}.{r}": r for i in range(4) for r in ("input_layernorm", "post_attention_layernorm")}
    roles["model.norm"] = "final"
    for shape in ("cosine", "linear"):
        (stage,) = taper_stages(roles, 10, shape)
        gates = [stage.gate(step) for step in range(12)]
        assert gates[0] == 1.0 and gates[10] == gates[11] == 0.0
        assert all(a > b for a, b in zip(gates[:11], gates[1:11]))
    assert TaperStage(0, 10, [], "cosine").gate(5) == pytest.approx(0.5)
    assert TaperStage(0, 10, [], "cosine").gate(2) > TaperStage(0, 10, [], "linear").gate(2)  # held near 1 longer
    stages = taper_stages(roles, 12, "progressive", group=2)  # blocks 0-1, 2-3, then the final norm
    assert [len(s.names) for s in stages] == [4, 4, 1] and stages[-1].names == ["model.norm"]
    assert [(s.start, s.end) for s in stages] == [(0, 4), (4, 8), (8, 12)]
    assert stages[0].gate(4) == 0.0 and stages[1].gate(4) == 1.0 and stages[2].gate(12) == 0.0
    assert taper_steps(0.5, 100) == 50 and taper_steps(1.0, 7) == 7 and taper_steps(0.01, 10) == 1


@pytest.mark.parametrize("override", ["taper.fraction=1.5", "taper.schedule=step"])
def test_bad_taper_settings_are_refused_by_name(override):
    with pytest.raises(ValidationError, match="taper"):
        read_recipe_config(None, [override])
    with pytest.raises(ValidationError, match="progressive.enabled=false"):
        read_recipe_config(None, ["taper.fraction=0.5", "progressive.enabled=true"])


def test_at_g_one_the_model_and_its_gradient_are_the_original():
    """The run starts at the original: its logits, and the gradient its other weights get (through the norm's
    branch: the frozen norm passes the gradient on to its input)."""
    torch.manual_seed(0)
    original = tiny_model("llama")
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="eln")
    names = [c.name for c in report.converted]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    converted = logits(model, ids)
    swap = ProgressiveSwap(model, {n: original.get_submodule(n) for n in names},
                           taper_stages({n: "x" for n in names}, 10, "cosine"))
    swap.set_step(0)
    for net in (model, original):
        net.zero_grad()
        net(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(logits(model, ids), logits(original, ids))
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert original.get_parameter(weight).grad.abs().sum() > 0
    torch.testing.assert_close(model.get_parameter(weight).grad, original.get_parameter(weight).grad)
    swap.set_step(5)
    halfway = logits(model, ids)
    assert not torch.allclose(halfway, converted) and not torch.allclose(halfway, logits(original, ids))
    swap.set_step(10)
    torch.testing.assert_close(logits(model, ids), converted)


def run_recipe(config, *overrides) -> subprocess.CompletedProcess:
    command = [sys.executable, str(RECIPE), "--config", str(config), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_a_stopped_taper_saves_nothing_and_resumes_its_schedule_to_a_model_without_norms(tiny_setup):
    root, model_dir = tiny_setup
    output = root / "taper"
    config = write_config(root, model_dir, output, progressive={"enabled": False},
                          taper={"fraction": 0.75, "schedule": "cosine"})
    steps = ["training.max_steps=8", "training.save_steps=1"]

    first = run_recipe(config, *steps, "max_minutes=0.000001")  # stops after its first step
    assert "taper: stopped at step 1 of its 6" in first.stdout and "no converted model saved" in first.stdout
    assert not (output / "final").exists() and (output / "checkpoint-1").is_dir()
    assert "finetuned" not in json.loads((output / "summary.json").read_text())

    second = run_recipe(config, *steps)
    assert "resuming from" in second.stdout and "checkpoint-1" in second.stdout
    summary = json.loads((output / "summary.json").read_text())
    (stage,) = taper_stages({"x": "x"}, 6, "cosine")
    logged = {h["step"]: h["converted_fraction"] for h in summary["history"] if "converted_fraction" in h}
    # the share converted during step k (the gate set at its start, global step k - 1), across both launches
    assert sorted(logged) == list(range(1, 9))
    assert all(logged[k] == pytest.approx(round(stage.mix(k - 1), 4), abs=1e-4) for k in logged)
    assert summary["training"]["taper"] == {"fraction": 0.75, "schedule": "cosine"}
    assert summary["reload_identical"] is True
    final = output / "final"
    saturation = [json.loads(line) for line in (output / "saturation.jsonl").read_text().splitlines()]
    assert [line["step"] for line in saturation] == list(range(1, 9))  # both launches, every logging step
    assert set(saturation[-1]["saturation"]) == set(json.loads((final / "config.json").read_text())["normswap"]
                                                     ["converted"])

    model = hf_normswap.load(final)
    assert not [n for n, m in model.named_modules() if "RMSNorm" in type(m).__name__]
    remote = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    assert not [n for n, m in remote.named_modules() if "RMSNorm" in type(m).__name__]
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(remote, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    # the plain formula: the converted model of the last checkpoint, no blend
    torch.testing.assert_close(logits(hf_normswap.load(output / "checkpoint-8"), ids), logits(model, ids))
    assert "falling from 1 to 0 (cosine) over the first 0.75" in (final / "README.md").read_text()
