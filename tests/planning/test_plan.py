"""The memory plan: sizes from the meta device equal the instantiated model's, phases add up, the fit verdict and
the smallest change, the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_normswap import cli
from hf_normswap.planning import PlanError, PlanSettings, model_sizes, plan
from hf_normswap.planning.memory_plan import replan
from hf_normswap.planning.phases import COMPILER_BYTES, RUNTIME_BYTES
from tiny_models import tiny_config, tiny_model


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bert", "qwen3"])
def test_sizes_from_the_config_are_the_instantiated_models(model_type):
    model = tiny_model(model_type)
    sizes = model_sizes(tiny_config(model_type))
    unique = {id(p): p for p in model.parameters()}
    assert sizes.parameters == sum(p.numel() for p in unique.values())
    assert sizes.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    assert sizes.parameter_bytes(4) == sum(p.numel() * 4 for p in unique.values()) + sizes.buffer_bytes
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    assert sizes.units == len(blocks)
    assert sizes.largest_unit == max(sum(p.numel() for p in b.parameters()) for b in blocks)


def test_a_models_weights_are_its_parameter_bytes_in_every_phase_that_holds_it():
    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()) \
        + sum(b.numel() * b.element_size() for b in model.buffers())
    result = plan(tiny_config("llama"), processes=2)
    load = result.recipe[0]
    assert load.other == {"runtime": RUNTIME_BYTES, "original": weights, "student": weights}
    assert load.main == dict(load.other, **{"evaluation window": load.main["evaluation window"],
                                            "compiled kernels": COMPILER_BYTES})
    sharded = plan(tiny_config("llama"), processes=2, sharding="fsdp2").recipe
    step = next(p for p in sharded if p.name == "training step")
    assert step.main["student"] == weights // 2 and step.main["teacher"] == weights // 2
    assert step.main["AdamW moments"] == 2 * step.main["gradients"]
    # under FSDP2 the main process alone reads the weights (the others receive their shards), unless every process
    # reads them or the teacher, held whole everywhere, is not sharded
    # (the teacher is sharded as the trainer is made, before training, the main process sending a unit at a time)
    shard = {"teacher's shard": weights // 2}
    config = tiny_config("llama")
    sizes = model_sizes(config)
    assert sharded[0].main == dict(load.main, **{"shard unit being sent": max(sizes.largest_unit, sizes.root) * 2})
    assert sharded[0].other == {"runtime": RUNTIME_BYTES, **shard,
                                "tensor being received": config.vocab_size * config.hidden_size * 4}
    every = plan(config, processes=2, sharding="fsdp2", load_once=False).recipe[0]
    assert every.other == dict(load.other, **shard)
    whole = plan(config, processes=2, sharding="fsdp2", shard_teacher=False).recipe[0]
    assert whole.other == {"runtime": RUNTIME_BYTES, "original": weights}


def test_phases_are_ordered_and_the_peak_is_their_largest():
    result = plan(tiny_config("llama"), processes=4, sharding="fsdp2", seq_len=64)
    names = [p.name for p in result.recipe]
    assert names == ["load", "calibration: block pass", "calibration: end-to-end steps", "training step",
                     "final evaluation and save"]
    peak = result.peak()
    assert peak["host_main"] == max(p.host_main for p in result.recipe)
    assert peak["host_node"] == max(p.host_main + 3 * p.host_other for p in result.recipe)
    assert peak["device"] == 0  # a CPU run
    assert [p.name for p in plan(tiny_config("llama"), calibrate=False).recipe][1] == "training step"


def test_sharding_divides_and_norms_alone_need_less():
    config = tiny_config("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024)
    ddp = plan(config, processes=4, seq_len=16, calibrate=False)
    fsdp = plan(config, processes=4, sharding="fsdp2", seq_len=16, calibrate=False)
    norms = plan(config, processes=4, seq_len=16, calibrate=False, trainable="norms")
    step = lambda p: next(x for x in p.recipe if x.name == "training step").host_main  # noqa: E731
    assert step(fsdp) < step(ddp) and step(norms) < step(ddp)


def test_it_fits_or_names_the_smallest_change():
    config = tiny_config("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024, vocab_size=512)
    roomy = plan(config, processes=4, sharding="fsdp2", device_memory="80GB", seq_len=64)
    assert roomy.fits and roomy.smallest_change() == {} and "fits" in roomy.describe()
    device = roomy.peak()["device"]
    ddp = plan(config, processes=4, device_memory=device, seq_len=64)
    assert not ddp.fits and ddp.problems()
    change = ddp.smallest_change()
    assert change and plan(config, ddp.settings.replace(**change)).fits
    assert "smallest change that fits" in ddp.describe()
    hopeless = plan(config, processes=1, device_memory=1000, seq_len=64)
    assert hopeless.smallest_change() is None


def test_a_conversion_with_its_weights_on_disk_holds_the_block_pass_alone():
    """``convert --max-host-memory`` below the model: no weight but the block being fitted, no end-to-end steps; the
    smallest change of a CPU conversion that does not fit the host."""
    config = tiny_config("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024, vocab_size=512)
    whole = plan(config, seq_len=64, calibrate=False)
    on_disk = plan(config, whole.settings.replace(weights_on_disk=True))
    assert [p.name for p in on_disk.conversion] == ["load", "calibration: block pass"]
    assert all(p.main["model"] == 0 for p in on_disk.conversion)
    no_steps = plan(config, whole.settings.replace(tune_rows=0))  # the original's logits go with the steps
    block_pass = {p.name: p for p in no_steps.conversion}["calibration: block pass"]
    block = on_disk.sizes.largest_unit * 4  # read from disk: beside the model in memory, a copy of its own
    assert on_disk.conversion[1].host_main == block_pass.host_main - block_pass.main["model"] + block
    limit = max(p.host_main for p in on_disk.conversion)
    tight = plan(config, whole.settings.replace(host_memory=limit))
    assert any(problem.startswith("convert,") for problem in tight.problems())
    assert not any(problem.startswith("convert,") for problem in replan(tight, weights_on_disk=True).problems())
    assert "convert with the weights on disk" in plan(config, on_disk.settings).describe()


@pytest.mark.parametrize("settings, message", [
    (dict(processes=0), "processes must be a whole number"),
    (dict(trainable="everything"), "trainable 'everything' is not one of"),
    (dict(device_memory="80 bananas"), "is not a size"),
    (dict(optimizer_offload=True), "add sharding fsdp2"),
])
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(PlanError, match=message) as error:
        PlanSettings(**settings)
    assert "\n" not in str(error.value)


def _command(argv):
    return cli.main(["plan", *argv])


def test_the_command_plans_a_config_directory(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path)
    code = _command([str(tmp_path), "--processes", "2", "--sharding", "fsdp2", "--device-memory", "80GB"])
    out = capsys.readouterr().out
    assert code == 0 and "recipe: training step" in out and out.rstrip().endswith("fits")
    assert _command([str(tmp_path / "config.json"), "--device-memory", "1KB"]) == 1
    assert "smallest change that fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["{dir}/missing"], "cannot read a config"),
    (["{dir}", "--device-memory", "lots"], "is not a size"),
    ([], "name a MODEL to plan"),
    (["{dir}", "block_len=64"], "name a MODEL to plan"),  # overrides without a recipe's --config
])
def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    tiny_config("llama").save_pretrained(tmp_path)
    assert _command([a.format(dir=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_an_8b_config_plans_without_its_weights():
    """32 GB of fp32 weights are never allocated: the parameters are on the meta device."""
    config = tiny_config("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    sizes = model_sizes(config)
    assert sizes.parameters == 8_030_261_248  # Llama-3-8B's published count
    assert sizes.units == 32 and not sizes.tied_head



def test_a_recipe_config_plans_as_the_recipe_runs(tmp_path):
    from hf_normswap.planning import plan, run_plan_settings
    from hf_normswap.training.recovery_run import resolve_run
    from hf_normswap.training.config import read_recipe_config

    recipe = Path(__file__).parents[2] / "recipes" / "configs" / "smollm2-eln.yaml"
    config = read_recipe_config(str(recipe), ["trainable=all", "block_len=128",
                                              "training.gradient_checkpointing=true"])
    settings = run_plan_settings(resolve_run(config, processes=2, sharded=True))
    assert (settings.sharding, settings.trainable, settings.seq_len, settings.gradient_checkpointing) == \
        ("fsdp2", "all", 128, True)
    assert settings.calibration_blocks == config.calibration.num_blocks and settings.calibrate
    tiny_config("llama").save_pretrained(tmp_path)
    config.model = str(tmp_path)
    run = resolve_run(config, processes=2, sharded=True)
    result = plan(run.original, run_plan_settings(run))
    assert result.sizes.parameters == model_sizes(tiny_config("llama")).parameters
    assert result.recipe[-1].name == "final evaluation and save"



def test_the_command_plans_a_recipe_config_as_the_recipe_resolves_it(tmp_path, capsys):
    """``normswap plan --config``: the recipe's own run (its model, batch, calibration), launched as the flags say;
    a flag the config decides is refused in one line, naming the setting."""
    import dataclasses

    from hf_normswap.planning import plan, run_plan_settings
    from hf_normswap.training.recovery_run import resolve_run
    from hf_normswap.training.config import read_recipe_config

    tiny_config("llama").save_pretrained(tmp_path)
    recipe = str(Path(__file__).parents[2] / "recipes" / "configs" / "smollm2-eln.yaml")
    overrides = [f"model={tmp_path}", "block_len=64", "trainable=norms"]
    assert _command(["--config", recipe, *overrides, "--processes", "2", "--host-memory", "1KB"]) == 1
    printed = capsys.readouterr().out
    run = resolve_run(read_recipe_config(recipe, overrides), processes=2, load_once=True)
    expected = plan(run.original, dataclasses.replace(run_plan_settings(run), host_memory="1KB"))
    assert printed.strip() == expected.describe().strip() and "trainable norms" in printed
    assert _command(["--config", recipe, *overrides, "--batch-size", "8"]) == 2
    assert capsys.readouterr().err.strip() == ("normswap: error: --batch-size: the recipe's config decides it "
                                               "(training.per_device_train_batch_size); set it there or as an override")
    assert _command(["--config", recipe, "no_such_setting=1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--config", "{recipe}", "--processes", "0", "train_tokens=1000"],
                                  ["--config", "{recipe}", "--processes", "0", "--device-memory", "80GB"],
                                  ["{dir}", "--processes", "-1"], ["{dir}", "--node-processes", "0"]])
def test_processes_below_one_are_refused_as_the_flags_are_parsed(tmp_path, capsys, argv):
    """``--processes 0`` was a ZeroDivisionError in step_count (in resolve_run with --device-memory)."""
    tiny_config("llama").save_pretrained(tmp_path)
    recipe = Path(__file__).parents[2] / "recipes" / "configs" / "smollm2-eln.yaml"
    with pytest.raises(SystemExit) as exit:
        _command([a.format(recipe=recipe, dir=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1 and "processes: must be at least 1, got" in err


def test_a_run_on_no_process_is_refused_by_resolve_run():
    from hf_normswap.training.recovery_run import RecoveryRunError, resolve_run
    from hf_normswap.training.config import read_recipe_config

    config = read_recipe_config(str(Path(__file__).parents[2] / "recipes" / "configs" / "smollm2-eln.yaml"),
                                ["train_tokens=1000"])
    for processes in (0, -2):
        with pytest.raises(RecoveryRunError, match="processes must be a whole number of at least 1"):
            resolve_run(config, processes=processes, device="cuda:0", cpu=False, device_memory=80 * 10**9)


def test_a_phase_over_the_host_memory_reads_larger_than_it():
    """``--host-memory 0.7GB`` printed ``host 0.7 GB > 0.7 GB``: the decimals it takes to read apart."""
    config = tiny_config("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=1024, vocab_size=512)
    whole = plan(config, seq_len=64, calibrate=False)
    need = max(p.host_main for p in whole.conversion)
    for limit in (need - 1, need - 10**6, need // 2, need - 4 * 10**7):
        for problem in plan(config, whole.settings.replace(host_memory=limit)).problems():
            shown, _, given = problem.partition(": host ")[2].partition(" > ")
            assert float(shown.removesuffix(" GB")) > float(given.removesuffix(" GB")), problem


def test_planning_a_converted_checkpoint_names_the_problem_and_the_fix(converted, capsys):
    """It printed transformers' 12,036-character list of every model type."""
    assert _command([str(converted)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"normswap: error: {converted} is a converted checkpoint (model_type 'normswap_llama'): plan the "
                   f"original model instead, or its recovery with normswap plan --config RECIPE.yaml "
                   f"model={converted}")
