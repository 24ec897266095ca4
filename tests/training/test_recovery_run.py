"""The run resolved once: the plan and the recipe read the same decisions, and nothing changes the settings."""

from __future__ import annotations

import copy
import types

import pytest

import hf_normswap
from hf_normswap.checkpoint import loading
from hf_normswap.checkpoint.record import converted_config
from hf_normswap.planning import run_plan_settings
from hf_normswap.training.recovery_run import RecoveryRunError, resolve_run
from hf_normswap.training import recipe_models
from hf_normswap.training.config import RecipeConfig
from tiny_models import tiny_model


class Loaded(Exception):
    """Stops the recipe's load once it has named the models it reads."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny_model("llama").save_pretrained(root / "plain")
    converted = tiny_model("llama")
    hf_normswap.convert(converted, to="eln", calibration=None)
    hf_normswap.save_pretrained(converted, root / "converted")
    return root


def loads(run, monkeypatch) -> list[str]:
    """The models the recipe's ``load_models`` reads for ``run``, in order (the student's, then the original's)."""
    read = []

    def load_model(spec, **kwargs):
        read.append(str(spec))
        if len(read) == 2 or not run.calibrates:
            if len(read) == 2:
                raise Loaded
            return tiny_model("llama"), None
        raise Loaded

    monkeypatch.setattr(loading, "load_model", load_model)
    state = types.SimpleNamespace(is_main_process=True, num_processes=run.processes, device=None)
    with pytest.raises(Loaded):
        recipe_models.load_models(run, state)
    return read


@pytest.mark.parametrize("launch", [dict(processes=1), dict(processes=4, sharded=True, load_once=True, device="cuda:0"),
                                    dict(processes=2, sharded=False)])
@pytest.mark.parametrize("model, original, calibrates", [("plain", None, True), ("converted", "plain", False),
                                                          ("converted", "other", False)])
def test_the_plan_and_the_recipe_agree_on_every_field_they_share(models, monkeypatch, tmp_path, launch, model,
                                                                 original, calibrates):
    """A converted checkpoint given with another ``original:`` (or none, reading its record) was planned as
    calibrating: the plan read ``original is None``, the recipe the checkpoint's record."""
    spec = str(models / model)
    config = RecipeConfig(model=spec, original=original and str(models / original) if original != "other" else None,
                          output_dir=str(tmp_path / "out"), train_tokens=10_000)
    if model == "converted" and original == "other":
        record = converted_config(models / "converted")
        record["normswap"]["base_model"] = str(models / "plain")
        monkeypatch.setattr("hf_normswap.training.recovery_run.converted_checkpoint", lambda config: record)
    kept = copy.deepcopy(config.to_dict())
    run = resolve_run(config, **launch)
    planned = run_plan_settings(run)
    training = config.training
    assert (planned.processes, planned.sharding, planned.load_once, planned.calibrate) == \
        (run.processes, "fsdp2" if run.sharded else "ddp", run.load_once, run.calibrates)
    assert run.calibrates is calibrates
    assert (planned.batch_size, planned.seq_len, planned.calibration_blocks) == \
        (run.batch_size, config.block_len, run.calibration.num_blocks)
    assert run.steps * run.tokens_per_step >= 10_000 > (run.steps - 1) * run.tokens_per_step
    assert run.tokens_per_step == config.block_len * run.batch_size * run.accumulation * run.processes
    if not launch.get("device", "cpu").startswith("cuda"):  # on CUDA the step is sized in tokens (step_tokens)
        assert (run.batch_size, run.accumulation) == (training["per_device_train_batch_size"],
                                                      training.get("gradient_accumulation_steps", 1))
    if launch.get("sharded"):  # calibration's blocks visit the training device; the settings keep theirs
        assert run.calibration.device == "cuda:0" and config.calibration.device is None
    read = loads(run, monkeypatch)
    assert read == ([spec] if calibrates else [spec, str(models / "plain")])  # the original the plan sizes
    assert run.original == (spec if calibrates else str(models / "plain"))
    assert config.to_dict() == kept  # nothing changed the settings


def test_a_converted_checkpoint_naming_no_original_is_refused(models, tmp_path, monkeypatch):
    record = converted_config(models / "converted")
    record["normswap"]["base_model"] = None
    monkeypatch.setattr("hf_normswap.training.recovery_run.converted_checkpoint", lambda config: record)
    with pytest.raises(RecoveryRunError, match="original"):
        resolve_run(RecipeConfig(model=str(models / "converted"), output_dir=str(tmp_path / "out")))


def test_roles_with_a_converted_checkpoint_are_refused(models, tmp_path):
    with pytest.raises(RecoveryRunError, match="is converted already, its norms fixed; leave roles unset"):
        resolve_run(RecipeConfig(model=str(models / "converted"), roles=["mlp_input"],
                                 output_dir=str(tmp_path / "out")))


def test_a_step_sized_in_tokens_resolves_the_batch_the_steps_and_the_plan(models, tmp_path):
    """``step_tokens`` gives the run its micro-batch and accumulation, and the steps of ``train_tokens`` follow
    from them; the settings stay as given and the plan reads the run's batch."""
    config = RecipeConfig(model=str(models / "plain"), output_dir=str(tmp_path / "out"), block_len=64,
                          train_tokens=40_000, step_tokens=4096)
    before = copy.deepcopy(config.to_dict())
    run = resolve_run(config, device_memory=2**40)
    assert run.batch_size * run.accumulation * 64 >= 4096 > (run.accumulation - 1) * run.batch_size * 64
    assert run.batch_size != config.training["per_device_train_batch_size"]
    assert run.tokens_per_step == run.batch_size * run.accumulation * 64
    assert run.steps == -(-40_000 // run.tokens_per_step)
    assert run_plan_settings(run).batch_size == run.batch_size
    assert config.to_dict() == before
    unset = resolve_run(RecipeConfig(model=str(models / "plain"), output_dir=str(tmp_path / "o2")))
    assert unset.batch_size == unset.settings.training["per_device_train_batch_size"]  # on the CPU: as configured
