"""The recipe's guards on real tiny runs (in-process, one thread): a diverged training is never saved or pushed and
its losses are logged as they were, a bfloat16 checkpoint trains float32 master weights, a finished run without
Trainer checkpoints trains nothing again, and a full disk is one line that keeps what was trained."""

from __future__ import annotations

import errno
import json
import math
import pathlib
import shutil
import tempfile

import pytest
import torch

import hf_normswap
from hf_normswap import cli
from hf_normswap.checkpoint import hub
from hf_normswap.training import recipe
from hf_normswap.training.trainable import norm_parameter_names
from test_finetune_recipe import tiny_setup, write_config  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = ["training.eval_strategy=no", "training.save_strategy=no", "final_eval.max_tokens=64"]


def _config(root, model_dir, output, **extra):
    return ["--config", str(write_config(root, model_dir, output, progressive={"enabled": False}, precision="fp32",
                                         **extra))]


def test_a_diverged_training_is_neither_saved_nor_pushed_and_its_losses_read_nan(tiny_setup, tmp_path, monkeypatch):
    """``lr=1e12`` without clipping: rc 0, every weight NaN, ``saved .../final`` and ``pushed``; the logged losses
    read 0 (the Trainer's NaN filter) and the card recorded the finite steps' mean."""
    root, model_dir = tiny_setup
    pushed = []
    monkeypatch.setattr(hub, "preflight", lambda repo, token=None: "token")
    monkeypatch.setattr(hub, "push", lambda folder, repo, **kwargs: pushed.append(folder))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit:
        recipe.main([*_config(root, model_dir, out), "trainable=all", "lr.base=1e12", "lr.shape=1e12", "lr.gamma=1e12",
                     "training.max_grad_norm=0", "training.max_steps=6", "training.eval_strategy=no",
                     "training.save_steps=3", "push_to_hub=me/x"])
    message = str(exit.value.code)
    assert message.startswith("finetune: the training diverged: its loss is not finite from step "), message
    assert "nothing is saved as final or pushed" in message and "\n" not in message
    assert not (out / "final").exists() and pushed == []
    history = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    losses = [row["loss"] for row in history if "loss" in row]
    diverged = int(message.split("from step ")[1].split(" ")[0])
    assert len(losses) == 6 and not any(math.isfinite(loss) for loss in losses[diverged - 1:]), losses


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_setup):
    """The tiny Llama converted in bfloat16 by the command line."""
    root, model_dir = tiny_setup
    converted = root / "bf16-eln"
    if not converted.exists():
        assert cli.main(["convert", str(model_dir), "--to", "eln", "--dtype", "bfloat16", "--calib", "none",
                         "--output", str(converted)]) == 0
    return converted


def test_a_bfloat16_checkpoint_trains_float32_master_weights_and_a_finished_run_stays_finished(
        tiny_setup, bf16_checkpoint, tmp_path, monkeypatch, capsys):
    """Recovering a bfloat16 checkpoint moved 1 of 320 norm weights (an fp32 one: all): updates vanished in bf16
    rounding. Rerun without Trainer checkpoints (``save_strategy: no``), the finished run trained again."""
    root, model_dir = tiny_setup
    out = tmp_path / "run"
    run = [*_config(root, model_dir, out), f"model={bf16_checkpoint}", f"original={model_dir}",
           "training.max_steps=3", *QUICK]
    assert recipe.main(run) == 0
    start, trained = hf_normswap.load(bf16_checkpoint), hf_normswap.load(out / "final")
    moved = {name: float((trained.get_parameter(name).float() != start.get_parameter(name).float()).float().mean())
             for name in norm_parameter_names(trained)}
    assert len(moved) >= 5 and min(moved.values()) == 1.0, moved  # every element of every norm parameter
    assert start.dtype == torch.bfloat16 and trained.dtype == torch.float32  # saved as it was trained

    before = {p.name: p.read_bytes() for p in (out / "final").iterdir()}
    monkeypatch.setattr(recipe, "load_models", lambda *a, **k: pytest.fail("a finished run loaded its models"))
    capsys.readouterr()
    assert recipe.main(run) == 0
    assert "finished at 3 steps" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (out / "final").iterdir()} == before


@pytest.mark.parametrize("where", ["checkpoint-2", "final", "summary.json"])
def test_a_full_disk_is_one_line_and_keeps_what_was_trained(tiny_setup, tmp_path, monkeypatch, where):
    """A 2.5 MB tmpfs as output_dir: an ``OSError: [Errno 28]`` traceback from the card's write at a checkpoint,
    on every relaunch. The card's write (summary.json's) fails here, as a full disk fails it."""
    root, model_dir = tiny_setup
    out, write_text = tmp_path / "run", pathlib.Path.write_text

    def full_disk(self, *args, **kwargs):  # in output_dir; the temporary folder has room
        staging = f".{where}.partial-"
        card = self.name == "README.md" and self.parent.name.startswith(staging) and self.parent.parent == out
        if card or self.name.startswith(staging) and self.parent == out:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    saving = ["training.save_strategy=steps", "training.save_steps=2"] if where != "final" else []
    with pytest.raises(SystemExit) as exit:
        recipe.main([*_config(root, model_dir, out), "training.max_steps=2", *QUICK, *saving])
    message = str(exit.value.code)
    assert "\n" not in message and "No space left on device" in message, message
    if where == "final":
        assert message.startswith(f"finetune: cannot save to {out / 'final'} ("), message
        kept = pathlib.Path(message.split("kept in ")[1].split(": move")[0])
        assert kept.parent.parent == tmp_path / "tmp" and hf_normswap.load(kept).dtype == torch.float32
        shutil.rmtree(kept.parent)
    elif where == "summary.json":  # written after calibration: nothing trained to keep
        assert message.startswith(f"finetune: cannot write in output_dir {out} ([Errno 28]"), message
    else:
        assert message.startswith(f"finetune: cannot write the Trainer checkpoint {out / 'checkpoint-2'} ("), message
    assert message.endswith("it goes on from its last checkpoint, if any") or where == "final", message
    assert not (out / "final").exists()


def test_float32_master_weights_cast_by_torch_and_a_float32_model_left_as_it_is():
    """A model read from a GGUF file (``offline:smollm2``) is float32 and transformers refuses its ``.float()``: the
    cast must not call it; a bfloat16 model is cast all the same."""
    from tiny_models import tiny_model

    from hf_normswap.training.recipe_models import fp32_master_weights

    def refused():
        raise ValueError("`.float()` is not supported for quantized model")

    model = tiny_model("llama")
    model.float = refused
    assert fp32_master_weights(model) is model
    half = tiny_model("llama").to(torch.bfloat16)
    half.float = refused
    cast = fp32_master_weights(half)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}
