"""Fault injection on the recipe's run folder: two launches into one output_dir, a resume that changes what its
optimizer state would keep, a finished run whose Trainer checkpoints are gone. Each refusal is one line, exit code 2,
before any model loads, and leaves every file of the folder as it was."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import file_tree, recipe_refusal
from test_faults_races import finished_run
from hf_normswap.training import recipe_settings, run_dir, run_lock
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# holds the lock as a running launch does, until killed
HOLD = ("import sys\nfrom filelock import FileLock\nlock = FileLock(sys.argv[1])\nlock.acquire()\n"
        "print('held', flush=True)\nsys.stdin.read()\n")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "llama"
    tiny_model("llama").save_pretrained(folder)
    return folder


def _launched(llama, out: Path, *settings: str) -> list[str]:
    """The settings of a run and its output_dir as its first launch leaves it, with checkpoint-2 written."""
    run = [f"model={llama}", f"output_dir={out}", *settings]
    run_lock.lock_run_dir(out).release()
    run_dir.claim_run_dir(recipe_settings.load_config(run))
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    return run


# --------------------------------------------------------------------------------- one launch at a time


def test_a_second_launch_into_a_folder_in_use_is_refused_and_a_killed_holder_blocks_nothing(llama, tmp_path, capsys,
                                                                                            no_loading):
    """Two launches into one output_dir both trained, rotated each other's checkpoints away and both said
    "saved"; the second is refused before loading, and once the first is killed (-9) a launch goes on."""
    out = tmp_path / "run"
    run = _launched(llama, out)
    before = file_tree(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / run_lock.LOCK)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        err = recipe_refusal(run, capsys)
        assert f"output_dir {out} is in use by another launch of the recipe" in err and "name another output_dir" in err
        assert file_tree(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with pytest.raises(RuntimeError, match="a model was loaded"):  # the lock died with its holder
        no_loading.main(run)


def test_the_lock_is_held_for_the_whole_launch_and_released_after(llama, tmp_path, monkeypatch):
    """While a launch loads and trains, the folder's lock is taken; when it ends (here: at the load), it is free."""
    from filelock import FileLock, Timeout

    from hf_normswap.training import recipe

    out = tmp_path / "run"
    run = _launched(llama, out)
    seen = []

    def loaded(*args, **kwargs):
        with pytest.raises(Timeout):
            FileLock(out / run_lock.LOCK, timeout=0).acquire()
        seen.append("held")
        raise RuntimeError("stop here")

    monkeypatch.setattr(recipe, "load_models", loaded)
    with pytest.raises(RuntimeError, match="stop here"):
        recipe.main(run)
    assert seen == ["held"]
    FileLock(out / run_lock.LOCK, timeout=0).acquire()


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(llama, tmp_path, capsys):
    out = tmp_path / "run"
    run = _launched(llama, out)
    (out / run_lock.LOCK).unlink()
    (tmp_path / "mine.txt").write_text("mine")
    (out / run_lock.LOCK).symlink_to(tmp_path / "mine.txt")
    err = recipe_refusal(run, capsys)
    assert f"{run_lock.LOCK} is a link" in err and (tmp_path / "mine.txt").read_text() == "mine"


def test_a_folder_holding_only_the_lock_of_a_launch_killed_as_it_began_is_the_runs(llama, tmp_path, no_loading):
    out = tmp_path / "run"
    run_lock.lock_run_dir(out).release()
    with pytest.raises(RuntimeError, match="a model was loaded"):
        no_loading.main([f"model={llama}", f"output_dir={out}"])


# ------------------------------------------------------------------------- what the optimizer state keeps


@pytest.mark.parametrize("setting, old, new", [("lr.base", "0.0001", "0.3"), ("lr.shape", "None", "0.01"),
                                               ("lr.gamma", "0.001", "0.002"), ("training.weight_decay", "0.0", "0.1"),
                                               ("training.adam_beta2", "0.999", "0.95")])
def test_a_resume_that_changes_an_optimizer_setting_is_refused_before_loading(llama, tmp_path, capsys, no_loading,
                                                                             setting, old, new):
    """``lr.base=0.3`` on a resume trained at the checkpoint's 0.0001 (its optimizer state restores every group's
    rate) while final/config.json and summary.json recorded 0.3."""
    out = tmp_path / "run"
    run = _launched(llama, out, "lr.gamma=0.001")
    before = file_tree(out)
    err = recipe_refusal([*run, f"{setting}={new}"], capsys)
    assert f"trained with {setting} {old} (the config: {new})" in err, err
    assert "checkpoint-2's optimizer state" in err and "set them back, name a new output_dir" in err
    assert file_tree(out) == before
    shutil.rmtree(out / "checkpoint-2")  # no optimizer state to restore: the new value trains
    with pytest.raises(RuntimeError, match="a model was loaded"):
        no_loading.main([*run, f"{setting}={new}"])
    assert json.loads((out / "run.json").read_text())["optimizer"][setting] == json.loads(new.replace("None", "null"))


# ----------------------------------------------------------------------------- a finished run is a fact


@pytest.mark.parametrize("setting, more", [("training.max_steps=6", "training.max_steps=8"),
                                           ("train_tokens=384", "train_tokens=1000")])
def test_a_finished_run_without_checkpoints_trains_nothing_and_a_larger_budget_is_refused(converted, llama, tmp_path,
                                                                                          capsys, no_loading, setting,
                                                                                          more):
    """With ``save_strategy: no`` (or checkpoint-* deleted), a rerun of a finished run trained again from the
    calibrated model and replaced final."""
    out = tmp_path / "run"
    run = finished_run(converted, llama, out, 6, 384, setting, checkpoint=False)
    before = file_tree(out)
    assert no_loading.main([*run, setting]) == 0
    said = capsys.readouterr().out
    assert "finished at 6 steps / 384 tokens: nothing to train" in said and "set resume=false to train anew" in said
    err = recipe_refusal([*run, more], capsys)
    assert "finished at 6 steps / 384 tokens" in err and "holds no Trainer checkpoint to continue from" in err
    assert "set resume=false to do that, or name a new output_dir" in err
    assert file_tree(out) == before
    with pytest.raises(RuntimeError, match="a model was loaded"):  # a new run, as asked
        no_loading.main([*run, more, "resume=false"])
