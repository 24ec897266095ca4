"""The taper (hf_normswap.training.hand_overs.taper): g * norm(x) + (1 - g) * new(x), g from 1 to 0 over a share of the run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerState

import hf_normswap
from hf_normswap.checkpoint.hub import PushError, push
from hf_normswap.checkpoint.loading import HandOverWarning
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.training.recovery_run import resolve_run
from hf_normswap.training import recipe_models, recipe_settings
from hf_normswap.training.config import read_recipe_config
from hf_normswap.training.hand_overs import converted_roles
from hf_normswap.training.hand_overs.blend import HandOverError, ProgressiveSwap, ProgressiveSwapCallback
from hf_normswap.training.hand_overs.progressive import schedule
from hf_normswap.training.hand_overs.taper import LENGTH, TaperCallback, TaperStage, taper_stages, taper_steps
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


@pytest.mark.parametrize("order, said", [("bogus", "progressive.order 'bogus' is unknown"),
                                         ("/nonexistent/map.json", "/nonexistent/map.json is not a sensitivity map")])
def test_the_tapers_progressive_order_is_checked_with_the_settings(order, said):
    """The order was checked only with progressive.enabled: the taper in stages failed after calibration."""
    with pytest.raises(ValidationError, match="progressive.order") as error:
        read_recipe_config(None, ["taper.fraction=0.5", "taper.schedule=progressive", f"progressive.order={order}"])
    assert said in str(error.value)
    read_recipe_config(None, ["taper.fraction=0.5", f"progressive.order={order}"])  # the cosine taper reads no order


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
    check_mid_hand_over(output / "checkpoint-1", 1, taper_stages({"x": "x"}, 6, "cosine")[0].mix(1), 6)

    second = run_recipe(config, *steps)
    assert "resuming from" in second.stdout and "checkpoint-1" in second.stdout
    summary = json.loads((output / "summary.json").read_text())
    (stage,) = taper_stages({"x": "x"}, 6, "cosine")
    logged = {h["step"]: h["converted_fraction"] for h in summary["history"] if "converted_fraction" in h}
    # the share converted during step k (the gate set at its start, global step k - 1), across both launches
    assert sorted(logged) == list(range(1, 9))
    assert all(logged[k] == pytest.approx(round(stage.mix(k - 1), 4), abs=1e-4) for k in logged)
    assert summary["training"]["taper"] == {"fraction": 0.75, "schedule": "cosine", "steps": 6}
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
    with warnings.catch_warnings():
        warnings.simplefilter("error", HandOverWarning)  # past the taper's end: converted, no warning
        torch.testing.assert_close(logits(hf_normswap.load(output / "checkpoint-8"), ids), logits(model, ids))
        hf_normswap.load(output / "checkpoint-7")
    assert "falling from 1 to 0 (cosine) over its first 6 steps" in (final / "README.md").read_text()
    assert all("hand_over" not in json.loads((path / "config.json").read_text())["normswap"]
               for path in (final, output / "checkpoint-8"))


def check_mid_hand_over(checkpoint, step: int, fraction: float, end: int) -> None:
    """A Trainer checkpoint saved mid-taper looked converted: its record and card did not mention the taper, and
    push and load took it. Now its record and card say where the hand-over was, push refuses it, load warns."""
    block = json.loads((checkpoint / "config.json").read_text())["normswap"]
    assert block["hand_over"] == {"schedule": "taper", "step": step, "converted_fraction": pytest.approx(fraction),
                                  "ends_at_step": end}
    assert 0 < fraction < 1 and "**Mid hand-over**: this checkpoint was saved at step 1 of a taper hand-over" in (
        checkpoint / "README.md").read_text()
    with pytest.raises(PushError, match=f"saved at step {step} of a taper hand-over.*nothing was pushed"):
        push(checkpoint, "me/x", token="hf_unused")
    with pytest.warns(HandOverWarning, match="not the model that was training"):
        hf_normswap.load(checkpoint)


def tapered_tiny(stages_of):
    """A converted tiny Llama blended with its original by ``stages_of(roles)``: (model, swap)."""
    original, model = tiny_model("llama"), tiny_model("llama")
    hf_normswap.convert(model, to="eln", calibration=None)
    roles = converted_roles(model)
    return model, ProgressiveSwap(model, {n: original.get_submodule(n) for n in roles}, stages_of(roles))


def test_a_progressive_schedule_longer_than_the_run_is_refused_and_a_stopped_one_saves_nothing():
    """every=50 on a 20-step run reached a converted fraction of 0.16, then swapped every norm in at once and
    saved the model as converted. The Trainer's own count is checked when training starts (an epoch-based run's);
    a run stopped early keeps its hooks and its record says where the hand-over was, as the taper's does."""
    model, swap = tapered_tiny(lambda roles: schedule(roles, every=50))
    callback = ProgressiveSwapCallback(swap)
    assert callback.end == 149  # the final norm's stage starts at 100, ramped over 50
    with pytest.raises(HandOverError, match="handed over until step 149, after the run's 20 steps: set "
                                            "training.max_steps"):
        callback.on_train_begin(None, TrainerState(max_steps=20), None)
    callback.on_train_begin(None, TrainerState(max_steps=149), None)
    state = TrainerState(max_steps=149, global_step=30)
    callback.on_step_end(None, state, None)
    hand_over = ConversionRecord.of(model).hand_over
    assert hand_over == {"schedule": "progressive", "step": 30, "converted_fraction": pytest.approx(2 * 31 / 50 / 5),
                         "ends_at_step": 149}
    callback.on_train_end(None, state, None)
    assert not callback.finished and callback.stopped_at == 30 and swap.handles  # not taken for converted
    state.global_step = 149
    callback.on_step_end(None, state, None)
    callback.on_train_end(None, state, None)
    assert callback.finished and not swap.handles and ConversionRecord.of(model).hand_over is None


def test_the_tapers_length_is_fixed_at_its_start_from_the_trainers_count_and_kept_by_a_resume():
    """An epoch-based run (max_steps -1) tapered over 1 step; a resume with a larger max_steps took the new
    length, and g rose again from 0."""
    model, swap = tapered_tiny(lambda roles: taper_stages(roles, 1, "cosine"))
    callback = TaperCallback(swap, 0.5, lambda steps: taper_stages(converted_roles(model), steps, "cosine"),
                             log=lambda line: None)
    first = TrainerState(max_steps=50)  # the Trainer's count of an epoch-based run
    callback.on_train_begin(None, first, None)
    assert callback.steps == callback.end == 25 and first.stateful_callbacks[LENGTH] == {"steps": 25}
    resumed = TrainerState(max_steps=100, global_step=30, stateful_callbacks={LENGTH: {"steps": 25}})
    callback.on_train_begin(None, resumed, None)
    assert callback.steps == 25 and swap.converted_fraction() == 1.0
    with pytest.raises(HandOverError, match="until step 25, after the run's 20 steps: its length was fixed"):
        callback.on_train_begin(None, TrainerState(max_steps=20, stateful_callbacks={LENGTH: {"steps": 25}}), None)


ONE_PROCESS = SimpleNamespace(is_main_process=True, main_process_first=contextlib.nullcontext,
                              device=torch.device("cpu"))  # accelerate's PartialState, as load_models reads it


@pytest.mark.parametrize("settings, said", [
    ({"taper": {"fraction": 0.5, "schedule": "progressive"}, "progressive": {"enabled": False, "order": "MAP"}},
     "progressive.order: MAP does not rank 4 converted norm(s), e.g. model.layers.0.input_layernorm"),
    ({"progressive": {"enabled": True, "order": "MAP"}}, "progressive.order: MAP does not rank 4 converted norm(s)"),
    ({"progressive": {"enabled": True, "every": 50}},
     "progressive: the norms are handed over until step 149, after the run's 20 steps: set training.max_steps")])
def test_a_hand_over_that_does_not_fit_the_norms_or_the_run_is_refused_before_calibration(
        tiny_setup, tmp_path, monkeypatch, capsys, settings, said):
    """A map ranking only model.norm was a traceback after calibration and the first evaluation; a schedule longer
    than the run saved a model whose last norms were swapped in untrained."""
    root, model_dir = tiny_setup
    order = tmp_path / "map.json"
    order.write_text(json.dumps({"order": ["model.norm"]}))
    settings = json.loads(json.dumps(settings).replace('"MAP"', json.dumps(str(order))))
    monkeypatch.setattr(hf_normswap, "convert", lambda *a, **k: pytest.fail("calibration started"))
    config = recipe_settings.load_config(["--config", str(write_config(root, model_dir, tmp_path / "run", **settings)),
                                          "training.max_steps=20"])
    with pytest.raises(SystemExit) as exit_info:
        recipe_models.load_models(resolve_run(config), ONE_PROCESS)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("finetune: error: " + said.replace("MAP", str(order))), err


def test_an_epoch_based_run_tapers_over_the_steps_the_trainer_counts(tiny_setup):
    """training.max_steps=-1 logged `g from 1 to 0 over 1 steps` and trained converted from the second step."""
    root, model_dir = tiny_setup
    output = root / "epoch-taper"
    config = write_config(root, model_dir, output, progressive={"enabled": False}, taper={"fraction": 0.5})
    result = run_recipe(config, "training.max_steps=-1", "training.num_train_epochs=1", "max_train_tokens=512",
                        "train_data=builtin:calibration")  # read whole: a local file is a stream, without epochs
    summary = json.loads((output / "summary.json").read_text())
    steps = summary["training"]["steps"]
    length = taper_steps(0.5, steps)
    assert steps >= 6 and length >= 3 and f"taper: g from 1 to 0 over {length} steps" in result.stdout
    (stage,) = taper_stages({"x": "x"}, length, "cosine")
    logged = {h["step"]: h["converted_fraction"] for h in summary["history"] if "converted_fraction" in h}
    assert sorted(logged) == list(range(1, steps + 1))
    assert all(logged[k] == pytest.approx(round(stage.mix(k - 1), 4), abs=1e-4) for k in logged)
    assert 0 < logged[2] < 1 and summary["training"]["taper"]["steps"] == length


def test_extending_a_finished_taper_keeps_g_at_zero(tiny_setup):
    """A taper.fraction=1.0 run of 4 steps, then the same folder with more steps (max_steps, then train_tokens): g
    followed the new length and the norms were blended back in."""
    root, model_dir = tiny_setup
    output = root / "extended-taper"
    config = write_config(root, model_dir, output, progressive={"enabled": False}, taper={"fraction": 1.0})
    run_recipe(config, "training.max_steps=4")
    assert json.loads((output / "summary.json").read_text())["training"]["steps"] == 4
    second = run_recipe(config, "training.max_steps=6")
    third = run_recipe(config, "train_tokens=512")  # 2 blocks of 32 tokens a step: 8 steps
    summary = json.loads((output / "summary.json").read_text())
    logged = {h["step"]: h["converted_fraction"] for h in summary["history"] if "converted_fraction" in h}
    assert sorted(logged) == list(range(1, 9)) and logged[4] < 1
    assert [logged[k] for k in range(5, 9)] == [1.0] * 4
    for launch in (second, third):
        assert "over 4 steps (its length when it started)" in launch.stdout
    state = json.loads((output / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"][LENGTH] == {"steps": 4}
    assert "over its first 4 steps" in (output / "final" / "README.md").read_text()
