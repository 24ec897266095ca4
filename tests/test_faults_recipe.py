"""Fault injection on the recovery recipe (recipes/finetune.py): secrets, its output_dir, resumes and settings.

Each case asserts the one-line error, exit code 2 before any model loads, and that every file the user had is
byte-for-byte as before and nothing was written.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_runs import file_tree, recipe_refusal
from hf_normswap.training.recovery_run import resolve_run
from hf_normswap.training import recipe_models, recipe_results, recipe_settings, run_dir
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas with different weights, saved."""
    root = tmp_path_factory.mktemp("models")
    for seed in (0, 1):
        tiny_model("llama", seed=seed).save_pretrained(root / f"llama-{seed}")
    return root


# ------------------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("setting", ["training.push_to_hub=true", "training.hub_token=hf_SECRET",
                                     "training.hub_model_id=me/run", "training.hub_strategy=all_checkpoints"])
def test_the_trainers_own_hub_upload_is_refused_and_no_token_is_written(tmp_path, capsys, setting):
    """The Trainer's push uploads all of output_dir, with training_args.bin holding the token; the recipe's
    push_to_hub uploads the final checkpoint alone."""
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", setting], capsys)
    assert f"training.{setting.split('.')[1].split('=')[0]} is refused" in err and "push_to_hub: OWNER/NAME" in err
    assert "hf_SECRET" not in err and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------- the recipe owns output_dir


def test_an_output_dir_the_recipe_did_not_write_is_refused(tmp_path, capsys):
    """A user's checkpoint-3 and summary.json: rotation would delete one and the run would overwrite the other, or
    resume from the foreign checkpoint."""
    out = tmp_path / "mine"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (out / "summary.json").write_text('{"mine": 1}')
    before = file_tree(out)
    for resume in ("true", "false"):
        err = recipe_refusal([f"output_dir={out}", f"resume={resume}"], capsys)
        assert "holds files the recipe did not write (checkpoint-3, summary.json)" in err
    assert file_tree(out) == before and sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "summary.json"]


def test_a_resume_naming_another_model_or_other_weights_is_refused_before_loading(models, tmp_path, capsys):
    out = tmp_path / "run"
    first = recipe_settings.load_config([f"model={models / 'llama-0'}", f"output_dir={out}"])
    run_dir.claim_run_dir(first)  # what the recipe records before calibrating
    (out / "summary.json").write_text('{"calibrated": {}}')
    before = file_tree(out)
    err = recipe_refusal([f"model={models / 'llama-1'}", f"output_dir={out}"], capsys)
    assert "was calibrated and trained from model" in err and "resume=false" in err
    (models / "copy").mkdir()  # the same path, other weights
    for file in (models / "llama-0").iterdir():
        (models / "copy" / file.name).write_bytes(file.read_bytes())
    run_dir.claim_run_dir(recipe_settings.load_config([f"model={models / 'copy'}", f"output_dir={tmp_path / 'other'}"]))
    (models / "copy" / "model.safetensors").write_bytes((models / "llama-1" / "model.safetensors").read_bytes())
    err = recipe_refusal([f"model={models / 'copy'}", f"output_dir={tmp_path / 'other'}"], capsys)
    assert "other weights of" in err
    assert file_tree(out) == before
    recipe_settings.load_config([f"model={models / 'llama-1'}", f"output_dir={out}", "resume=false"])  # a new run: allowed


def test_a_resume_training_other_parameters_is_refused_before_loading(models, tmp_path, capsys):
    """The optimizer state of checkpoint-N fits the parameters it trained; another trainable set crashed on load."""
    out = tmp_path / "run"
    base = [f"model={models / 'llama-0'}", f"output_dir={out}"]
    run_dir.claim_run_dir(recipe_settings.load_config(base))
    recipe_settings.load_config([*base, "trainable=all"])  # no checkpoint yet: nothing to mismatch
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    err = recipe_refusal([*base, "trainable=all"], capsys)
    assert "'trainable': 'norms'" in err and "'trainable': 'all'" in err and "optimizer state" in err
    assert (out / "checkpoint-2" / "trainer_state.json").read_text() == '{"global_step": 2}'


# ----------------------------------------------------------------------------------------- interrupted writes


def test_an_interrupted_trainer_checkpoint_is_skipped_on_resume(tmp_path):
    """A kill between the Trainer's writes leaves checkpoint-N without trainer_state.json (written last), or with
    a part of it: the resume goes on from the newest whole one."""
    for step, state in ((2, '{"global_step": 2}'), (4, None), (6, '{"global_st')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if state is not None:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-x").mkdir()
    assert run_dir.last_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                          "checkpoint-x"]


def test_summary_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    summary = tmp_path / "summary.json"
    run_dir.write_json(summary, {"calibrated": {"ratio": 1.5}})

    def killed(*args):
        raise KeyboardInterrupt  # between writing the new copy and renaming it into place

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run_dir.write_json(summary, {"calibrated": {"ratio": 1.5}, "finetuned": {}})
    monkeypatch.undo()
    assert json.loads(summary.read_text()) == {"calibrated": {"ratio": 1.5}}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    summary.write_text('{"calibrated": {"ra')  # truncated by an earlier version's in-place write
    assert run_dir.read_json(summary) is None  # the resume measures the calibrated model again


# --------------------------------------------------------------------------------- settings checked up front


@pytest.mark.parametrize("argv, message", [
    (["distill.weight=3"], "distill.weight must be at most 1, got 3"),
    (["distill.weight=-0.5"], "distill.weight must be at least 0"),
    (["distill.hidden=-1"], "distill.hidden must be at least 0"),
    (["distill.embedding=-1"], "distill.embedding must be at least 0"),
    (["distill.sink_weight=-1"], "distill.sink_weight must be at least 0"),
    (["progressive.enabled=true", "progressive.order=dept"], "progressive.order 'dept' is unknown"),
    (["progressive.enabled=true", "progressive.order=/nonexistent/map.json"],
     "progressive.order: /nonexistent/map.json is not a sensitivity map"),
    (["progressive.every=0"], "progressive.every must be at least 1"),
    (["progressive.every=abc"], "setting progressive.every: 'abc' is not an integer"),
    (["train_tokens=abc"], "setting train_tokens: 'abc' is not an integer"),
    (["training.lr_scheduler_type=cosin"], "training: cosin is not a valid SchedulerType"),
    (["training.optim=adamw_torchh"], "training: adamw_torchh is not a valid OptimizerNames"),
    (["push_to_hub=bad repo!!"], "invalid repository name 'bad repo!!'"),
    (["output_dir=/nonexistent/run", "save_dir=/nonexistent/run"], "save_dir /nonexistent/run is output_dir"),
    (["output_dir=/nonexistent/run", "save_dir=/nonexistent/run/calibrated"], "holds it or its calibrated/"),
    (["train_data=[builtin:calibration, /nonexistent/wiki.txt]"], "train_data: data file not found: /nonexistent"),
    (["train_data=[builtin:calibration, generated]", "eval_data=generated"], "samples the same text as the training"),
    (["train_data=[generated, 'generated:temperature=1.0']"], "names the same text twice"),
    (["train_data=[builtin:calibration, builtin:calibration]"], "names the same text twice"),
])
def test_every_setting_is_checked_before_loading(capsys, argv, message):
    assert message in recipe_refusal(argv, capsys)


def test_the_push_is_checked_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE is set" in recipe_refusal(["push_to_hub=me/model",
                                                                 f"output_dir={tmp_path / 'run'}"], capsys)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- the recipe's save


def test_the_save_never_replaces_the_model_it_reads_or_a_checkpoint_it_did_not_save(converted, tmp_path, capsys):
    """``model=conv save_dir=conv`` overwrote the converted checkpoint it trained from (exit 0); a save_dir holding
    another checkpoint of the user's was replaced too. A save_dir a launch of this run saved to may be replaced."""
    import shutil

    conv, other = tmp_path / "conv", tmp_path / "other"
    shutil.copytree(converted, conv)
    shutil.copytree(converted, other)
    before = file_tree(tmp_path)
    run = [f"model={conv}", f"original={converted}", f"output_dir={tmp_path / 'run'}"]
    assert "would replace model" in recipe_refusal([*run, f"save_dir={conv}"], capsys)
    err = recipe_refusal([*run, f"save_dir={other}"], capsys)
    assert "holds a checkpoint the recipe did not save there" in err
    assert file_tree(tmp_path) == before
    config = recipe_settings.load_config([*run, f"save_dir={tmp_path / 'new'}"])
    run_dir.claim_run_dir(config)
    shutil.copytree(converted, tmp_path / "new")  # what the first launch saved
    run_dir.record_save(Path(config.output_dir), config.save_path, 4, 512)
    recipe_settings.load_config([*run, f"save_dir={tmp_path / 'new'}"])  # the next launch replaces its own save
    recipe_settings.load_config([*run, f"save_dir={tmp_path / 'run' / 'final'}"])  # inside output_dir: the run's own


# ------------------------------------------------------------------------------------ names too long for a path


@pytest.mark.parametrize("setting, shown", [("model={}", "model"), ("output_dir=/tmp/{}/run", "output_dir"),
                                            ("save_dir=/tmp/{}", "output")])
def test_a_name_longer_than_the_file_system_takes_is_one_line(capsys, setting, shown):
    """ENAMETOOLONG was a traceback where the path was first touched: model= of 5,000 characters, an output_dir
    part of 300."""
    err = recipe_refusal([setting.format("a" * 5000 if shown == "model" else "b" * 300)], capsys)
    assert err.startswith(f"finetune: error: {shown} '") and "the file system takes at most" in err, err


def test_the_command_line_refuses_a_name_too_long_in_one_line(tmp_path, capsys):
    from cli_runs import run_cli

    code, line = run_cli(["inspect", "a" * 5000], capsys)
    assert code == 2 and "a name in it is 5000 bytes long" in line
    code, line = run_cli(["convert", "a" * 5000, "--to", "eln", "--output", tmp_path / ("b" * 300)], capsys)
    assert code == 2 and "a name in it is 300 bytes long" in line and list(tmp_path.iterdir()) == []


def test_a_damaged_run_record_is_one_line(tmp_path, capsys):
    """run.json holding {"model": "x"}: an AttributeError before; resume=false starts over and rewrites it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"written_by": run_dir.WRITTEN_BY, "model": "x"}))
    err = recipe_refusal([f"output_dir={out}"], capsys)
    assert "run.json is damaged (model is 'x', not an object)" in err and "resume=false" in err
    run_dir.claim_run_dir(recipe_settings.load_config([f"output_dir={out}", "resume=false"]))
    assert isinstance(json.loads((out / "run.json").read_text())["model"], dict)


def test_more_threads_than_the_machine_has_cpus_is_refused(capsys):
    err = recipe_refusal(["threads=100000"], capsys)
    assert f"threads must be at most {os.cpu_count()} (the CPUs of this machine), got 100000" in err


# ---------------------------------------------------------------------------- settings against the model's context

ONE_PROCESS = SimpleNamespace(is_main_process=True, main_process_first=contextlib.nullcontext,
                              device=torch.device("cpu"))  # accelerate's PartialState, as load_models reads it
WITHIN = ["block_len=32", "calibration.block_len=32", "final_eval.max_length=32"]  # the tiny Llama has 64 positions


def _within(*overrides: str) -> list[str]:
    """WITHIN with ``overrides`` in place of its own settings."""
    given = {o.split("=")[0] for o in overrides}
    return [*(w for w in WITHIN if w.split("=")[0] not in given), *overrides]
PAST_THE_CONTEXT = {
    "block_len": "block_len=65",
    "calibration.block_len": "calibration.block_len=65",
    "final_eval.max_length": "final_eval.max_length=65",
    "calibration.data": "calibration.data=generated:length=65",
    "train_data": "train_data=generated:length=65",
    "eval_data": "eval_data=generated:length=65,seed=1",
}


def test_the_list_of_settings_checked_against_the_context_is_the_recipes():
    from hf_normswap.training.recovery_run import CONTEXT_SETTINGS

    assert set(PAST_THE_CONTEXT) == set(CONTEXT_SETTINGS)


@pytest.fixture(scope="module")
def llama_with_tokenizer(models):
    from tiny_models import tiny_tokenizer

    tiny_model("llama").save_pretrained(models / "llama-tokenizer")
    tiny_tokenizer().save_pretrained(models / "llama-tokenizer")
    return models / "llama-tokenizer"


@pytest.mark.parametrize("setting", sorted(PAST_THE_CONTEXT))
def test_each_setting_past_the_models_context_is_refused_before_calibration(llama_with_tokenizer, tmp_path,
                                                                             monkeypatch, capsys, setting):
    """Each failed (an IndexError at training start, a DataError traceback) or was cut silently, after the
    calibration and the first evaluation."""
    import hf_normswap

    model = llama_with_tokenizer
    monkeypatch.setattr(hf_normswap, "convert", lambda *a, **k: pytest.fail("calibration started"))
    config = recipe_settings.load_config([f"model={model}", f"output_dir={tmp_path / 'run'}",
                                          *_within(PAST_THE_CONTEXT[setting])])
    with pytest.raises(SystemExit) as exit:
        recipe_models.load_models(resolve_run(config), ONE_PROCESS)  # where main loads the models, then calibrates
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err, err
    named = setting if setting.endswith(("len", "length")) else f"{setting} generated: length"
    assert err.strip().splitlines()[-1] == (f"finetune: error: {named} 65 is longer than the context of {model} "
                                           "(64 tokens); give at most 64")


def test_a_sample_cache_that_cannot_be_written_stops_the_recipe_in_one_line(llama_with_tokenizer, tmp_path,
                                                                             monkeypatch, capsys):
    """The calibration's DataError was a traceback out of the recipe."""
    (tmp_path / "cache").write_text("mine")
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    config = recipe_settings.load_config([f"model={llama_with_tokenizer}", f"output_dir={tmp_path / 'run'}", *WITHIN,
                                          "calibration.data=generated:length=16,batch_size=2"])
    with pytest.raises(SystemExit) as exit:
        recipe_models.load_models(resolve_run(config), ONE_PROCESS)
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(exit.value.code).startswith("finetune: calibration.data: generated: cannot "
                                                                      "write the sample cache"), err
    assert "HF_NORMSWAP_CACHE" in str(exit.value.code) and (tmp_path / "cache").read_text() == "mine"


def test_a_resume_keeps_the_earlier_launches_history(tmp_path):
    """Launch 1 trained 3 steps and saved checkpoint-2 (save_steps 2) and its summary; launch 2 resumed from
    checkpoint-2, whose trainer_state holds the rows up to step 2: launch 1's step 3 and final row were dropped."""
    rows = [{"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8}]
    first = rows + [{"step": 3, "loss": 2.7}, {"step": 3, "train_runtime": 4.3, "train_loss": 2.8}]
    run_dir.write_json(tmp_path / "summary.json", {"history": first})
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": rows}))
    resumed = run_dir.read_json(run_dir.last_checkpoint(tmp_path) / "trainer_state.json")
    second = [{"step": 3, "loss": 2.6}, {"step": 4, "train_runtime": 2.0, "train_loss": 2.6}]
    history = recipe_results.launch_history(run_dir.read_json(tmp_path / "summary.json"), resumed, rows + second)
    assert history == first + second
    assert recipe_results.launch_history({"history": first}, {}, second) == second  # nothing resumed: a new training


@pytest.mark.parametrize("targets, message", [("[c_attn, c_proj]", "names no module of"),
                                              ("'q_pro[j'", "is not a regular expression")])
def test_lora_targets_the_model_lacks_are_refused_before_calibration(llama_with_tokenizer, tmp_path,
                                                                      monkeypatch, capsys, targets, message):
    """GPT-2's module names on a Llama: peft refused them after the calibration and the first evaluation."""
    import hf_normswap

    monkeypatch.setattr(hf_normswap, "convert", lambda *a, **k: pytest.fail("calibration started"))
    config = recipe_settings.load_config([f"model={llama_with_tokenizer}", f"output_dir={tmp_path / 'run'}",
                                          *WITHIN, "trainable=lora", f"lora.target_modules={targets}"])
    with pytest.raises(SystemExit) as exit:
        recipe_models.load_models(resolve_run(config), ONE_PROCESS)
    assert exit.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
    recipe_models.check_lora_targets(["q_proj", "v_proj"], "llama", tiny_model("llama"))  # a Llama's own names pass
