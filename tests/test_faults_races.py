"""Fault injection on saves that race and on links: two saves into one place end with one checkpoint and one
refusal, and nothing the package writes or uploads follows a link out of its own folder. Tiny models only."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import hf_normswap
from hf_normswap.checkpoint import directory, model_card
from hf_normswap.checkpoint.record import ConversionRecord
from cli_runs import file_tree, run_cli as _cli
from hub_mirror import TOKEN, HubMirror
from tiny_models import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

RENDER = model_card.render


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Llama converted to ELN and the same converted to DyT, each saved once (their file trees kept)."""
    root = tmp_path_factory.mktemp("converted")
    models = {}
    for method in ("eln", "dyt"):
        model = tiny_model("llama")
        hf_normswap.convert(model, to=method)
        hf_normswap.save_pretrained(model, root / method)
        models[method] = model
    return root, models


def _method(folder: Path) -> str:
    return ConversionRecord.read(folder).method


def test_a_checkpoint_another_save_put_there_meanwhile_is_not_replaced(converted, tmp_path, monkeypatch):
    """The DyT save completes while the ELN save writes its card: the ELN save, not told to overwrite, refuses at
    its rename and leaves the DyT checkpoint whole."""
    root, models = converted
    out = tmp_path / "x"
    render = model_card.render

    def render_while_another_save_completes(config):
        assert os.waitpid(_save_in_child(models["dyt"], out, 0), 0)[1] == 0  # another process: this one's own
        return render(config)                                                # leftovers are not its

    monkeypatch.setattr(model_card, "render", render_while_another_save_completes)
    with pytest.raises(directory.OutputExistsError, match="filled by another save while this one ran; pass --overwrite"):
        hf_normswap.save_pretrained(models["eln"], out)
    assert file_tree(out) == file_tree(root / "dyt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no staging folder left


def test_an_empty_folder_filled_meanwhile_is_not_replaced(converted, tmp_path, monkeypatch):
    """A folder filled between the check and the rename (by a program that takes no lock): the rename itself never
    replaces a folder with anything in it."""
    root, models = converted
    out = tmp_path / "x"
    out.mkdir()
    rename = os.rename

    def filled_just_before_the_rename(source, destination):
        if Path(destination) == out:
            (out / "mine.txt").write_text("mine")
        return rename(source, destination)

    monkeypatch.setattr(os, "rename", filled_just_before_the_rename)
    with pytest.raises(directory.OutputExistsError, match="created by another save"):
        hf_normswap.save_pretrained(models["eln"], out)
    monkeypatch.undo()
    assert file_tree(out) == {"mine.txt": b"mine"}


def _save_in_child(model, out: Path, start: float, kill_at_card: bool = False) -> int:
    """Fork a save of ``model`` into ``out`` that starts at time ``start``; its exit code: 0 saved, 3 refused (or
    killed while writing its card)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            model_card.render = (lambda config: os.kill(os.getpid(), signal.SIGKILL)) if kill_at_card else RENDER
            time.sleep(max(0.0, start - time.time()))
            hf_normswap.save_pretrained(model, out)
        except directory.OutputExistsError:
            code = 3
        except BaseException:
            code = 1
        os._exit(code)
    return pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_two_saves_at_once_end_with_one_checkpoint_and_one_refusal(converted, tmp_path):
    """``convert --to eln`` and ``convert --to dyt`` into one new folder at the same moment, ten times: each time one
    exits 0, the other refuses (OutputExistsError), and the folder holds the winner's checkpoint whole; a third save
    killed (SIGKILL) midway at the same time changes nothing of that."""
    root, models = converted
    for round in range(10):
        out = tmp_path / f"x{round}"
        start = time.time() + 0.3
        pids = {method: _save_in_child(models[method], out, start) for method in ("eln", "dyt")}
        killed = _save_in_child(models["eln"], out, start, kill_at_card=True)
        codes = {method: os.WEXITSTATUS(os.waitpid(pid, 0)[1]) for method, pid in pids.items()}
        status = os.waitpid(killed, 0)[1]  # killed midway, or refused before it began (the others were faster)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL or os.WEXITSTATUS(status) == 3
        assert sorted(codes.values()) == [0, 3], codes
        winner = next(method for method, code in codes.items() if code == 0)
        directory.recover_interrupted(out)  # what the next save into the same place runs first
        assert _method(out) == winner and file_tree(out) == file_tree(root / winner), round
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".x{round}.")] == []


# ------------------------------------------------------------------------------------- the recipe's output_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "llama"
    tiny_model("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["calibrated", "final", "summary.json"])
def test_a_link_in_output_dir_is_refused_and_its_target_untouched(converted, llama, tmp_path, capsys, no_loading,
                                                                  name):
    """``OUTPUT/calibrated`` linked to another checkpoint: a ``resume=false`` run wrote its calibration through it."""
    from cli_runs import recipe_refusal
    from hf_normswap.training import recipe_settings, run_dir

    root, _ = converted
    run = [f"model={llama}", f"output_dir={tmp_path / 'run'}"]
    run_dir.claim_run_dir(recipe_settings.load_config(run))
    (tmp_path / "run" / name).symlink_to(root / "dyt" if name != "summary.json" else root / "dyt" / "config.json")
    before = file_tree(root)
    for resume in ("true", "false"):
        err = recipe_refusal([*run, f"resume={resume}"], capsys)
        assert f"{name} is a link (to {root / 'dyt'}" in err and "remove the link" in err
    assert file_tree(root) == before


def finished_run(final: Path, llama, out: Path, steps: int, tokens: int, *settings: str,
                 checkpoint: bool = True) -> list[str]:
    """An output_dir as a finished run leaves it: its lock file, checkpoint-N (unless not ``checkpoint``: deleted,
    or ``save_strategy: no``), and final copied from the checkpoint ``final`` (its record says N steps)."""
    import json
    import shutil

    from hf_normswap.training import recipe_settings, run_dir, run_lock

    run = [f"model={llama}", f"output_dir={out}", *settings]
    config = recipe_settings.load_config(run)
    run_lock.lock_run_dir(out).release()
    run_dir.claim_run_dir(config)
    if checkpoint:
        (out / f"checkpoint-{steps}").mkdir()
        (out / f"checkpoint-{steps}" / "trainer_state.json").write_text(
            json.dumps({"global_step": steps, "num_input_tokens_seen": tokens}))
    shutil.copytree(final, out / "final")
    saved = json.loads((out / "final" / "config.json").read_text())
    saved["normswap"]["training"] = {"steps": steps, "tokens_seen": tokens}
    (out / "final" / "config.json").write_text(json.dumps(saved))
    run_dir.record_save(out, config.save_path, steps, tokens)
    return run


@pytest.mark.parametrize("setting, more", [("training.max_steps=6", "training.max_steps=8"),
                                           ("train_tokens=384", "train_tokens=1000")])
def test_a_finished_run_trains_nothing_and_a_larger_budget_continues(converted, llama, tmp_path, capsys, no_loading,
                                                                     setting, more):
    """Rerunning a finished recipe resumed from its last checkpoint, trained one more step and replaced final."""
    out = tmp_path / "run"
    run = finished_run(converted[0] / "eln", llama, out, 6, 384, setting)
    before = file_tree(out)
    assert no_loading.main([*run, setting]) == 0
    assert "finished at 6 steps / 384 tokens: nothing to train" in capsys.readouterr().out
    assert file_tree(out) == before
    with pytest.raises(RuntimeError, match="a model was loaded"):  # a larger budget continues, as documented
        no_loading.main([*run, more])


# --------------------------------------------------------------------------------------- links out of a folder


def test_a_push_refuses_a_file_linked_out_of_the_checkpoint(converted, tmp_path, monkeypatch, capsys):
    """A checkpoint whose tokenizer_config.json links to a file outside it uploaded that file's content."""
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(converted[0] / "eln", checkpoint)
    (tmp_path / "secret.txt").write_text("private")
    (checkpoint / "tokenizer_config.json").symlink_to(tmp_path / "secret.txt")
    with HubMirror() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        code, line = _cli(["push", checkpoint, "me/linked"], capsys)
        assert code == 2 and "tokenizer_config.json is a link to" in line and "outside the checkpoint" in line
        assert "me/linked" not in hub.created


def test_a_linked_settings_file_in_the_sample_cache_is_replaced_not_written_through(tmp_path):
    """A symlinked settings.json in a cache folder: the next draw overwrote the link's target."""
    from hf_normswap.data.generated import SamplingSettings
    from hf_normswap.data.sample_cache import SampleCache

    cache = SampleCache(tiny_model("llama"), SamplingSettings(length=12, batch_size=2), tmp_path / "cache")
    cache.directory.mkdir(parents=True)
    (tmp_path / "mine.json").write_text("mine")
    (cache.directory / "settings.json").symlink_to(tmp_path / "mine.json")
    cache.prepare()
    assert (tmp_path / "mine.json").read_text() == "mine"
    assert not (cache.directory / "settings.json").is_symlink() and sorted(p.name for p in cache.directory.iterdir()) == ["settings.json"]


def test_a_linked_batch_lock_in_the_sample_cache_is_one_line_and_its_target_untouched(tmp_path):
    """The lock a batch is drawn under (two runs at once draw it once) is a file in the cache folder: a link put
    there must not be followed, and the draw stops in one line naming the cache."""
    from hf_normswap.data.generated import SamplingSettings, draw
    from hf_normswap.data.sample_cache import SampleCache

    model = tiny_model("llama")
    cache = SampleCache(model, SamplingSettings(length=12, batch_size=2, precision="fp32"), tmp_path / "cache")
    cache.prepare()
    (tmp_path / "mine.txt").write_text("mine")
    (cache.directory / ".batch-000000.lock").symlink_to(tmp_path / "mine.txt")
    with pytest.raises(ValueError, match=r"^generated: cannot write the sample cache .* set HF_NORMSWAP_CACHE") as error:
        draw(model, tiny_tokenizer(), cache, [0], progress=False)
    assert "\n" not in str(error.value) and (tmp_path / "mine.txt").read_text() == "mine" and not cache.has(0)


def test_two_draws_preparing_the_sample_cache_at_once_both_succeed(tmp_path):
    """Two threads of one process (two ranks' streams in a test, a background draw) shared one staging name for
    settings.json: one renamed it away under the other, whose draw failed as an unwritable cache."""
    import threading

    from hf_normswap.data.generated import SamplingSettings
    from hf_normswap.data.sample_cache import SampleCache

    cache = SampleCache(tiny_model("llama"), SamplingSettings(length=12, batch_size=2), tmp_path / "cache")
    failures = []

    def prepare():
        for _ in range(300):
            try:
                cache.prepare()
            except ValueError as error:
                failures.append(str(error))

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and sorted(p.name for p in cache.directory.iterdir()) == ["settings.json"]


class _Payload:
    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):  # what a crafted optimizer.pt holds: unpickling it would create the mark
        return (Path.touch, (self.mark,))


@pytest.mark.parametrize("damage", ["truncated", "pickle payload"])
def test_a_damaged_trainer_checkpoint_is_named_with_the_fix(llama, tmp_path, capsys, no_loading, damage):
    """A truncated checkpoint-3/optimizer.pt failed every relaunch with a PytorchStreamReader traceback that did not
    name the file; a pickle payload there gave an UnpicklingError traceback."""
    import torch

    from cli_runs import recipe_refusal
    from hf_normswap.training import recipe_settings, run_dir

    out = tmp_path / "run"
    run = [f"model={llama}", f"output_dir={out}"]
    run_dir.claim_run_dir(recipe_settings.load_config(run))
    checkpoint = out / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text('{"global_step": 3}')
    torch.save({"cpu": torch.random.get_rng_state()}, checkpoint / "rng_state.pth")
    optimizer = checkpoint / "optimizer.pt"
    if damage == "truncated":
        torch.save({"state": {0: {"exp_avg": torch.ones(1000)}}}, optimizer)
        optimizer.write_bytes(optimizer.read_bytes()[:3000])
    else:
        torch.save({"state": _Payload(tmp_path / "ran")}, optimizer)
    err = recipe_refusal(run, capsys)
    assert f"{checkpoint} is damaged: optimizer.pt cannot be read" in err
    assert f"delete {checkpoint} to resume from the one before, or set resume=false" in err
    assert not (tmp_path / "ran").exists()


def test_an_output_dir_inside_the_models_folder_is_refused(llama, tmp_path, capsys):
    from cli_runs import recipe_refusal

    before = file_tree(llama)
    err = recipe_refusal([f"model={llama}", f"output_dir={llama / 'run'}"], capsys)
    assert f"output_dir {llama / 'run'} is inside model" in err and file_tree(llama) == before
    assert not (llama / "run").exists()


def test_a_tokenizers_auto_map_is_not_carried_into_a_saved_checkpoint(tmp_path):
    """The code an input tokenizer's auto_map names is never run; the recipe's output named it and failed on load."""
    import json

    from hf_normswap.checkpoint.loading import load_model
    from tiny_models import tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    settings = json.loads((tmp_path / "llama" / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps(settings))
    model, tokenizer = load_model(str(tmp_path / "llama"))
    hf_normswap.convert(model, to="eln", calibration=None)
    hf_normswap.save_pretrained(model, tmp_path / "out", tokenizer=tokenizer)
    assert "auto_map" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    load_model(str(tmp_path / "out"))


def test_the_card_says_the_remote_code_does_not_check_the_record(converted):
    """Remote code loads a checkpoint of format_version 99, or with a changed method or a dropped norm, which the
    package's loader refuses: the card says which loader checks."""
    root, _ = converted
    card = (root / "eln" / "README.md").read_text()
    assert "refuses a checkpoint edited since it\nwas saved; the remote code builds what the record says without those checks" in card
