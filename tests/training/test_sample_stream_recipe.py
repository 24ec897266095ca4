"""The recipe on the original's samples drawn as it trains (tiny llama, in-process): the first step waits for the
same few batches whatever the run's length, and a run killed mid-stream resumes on the same rows and losses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from hf_normswap.training import recipe
from hf_normswap.training.trainer import NormSwapTrainer
from test_finetune_recipe import tiny_setup, write_config  # noqa: F401 (the fixture)

SPEC = "generated:length=32,batch_size=2,temperature=1.0,precision=fp32"


TRAINING_STEP = NormSwapTrainer.training_step


class Killed(Exception):
    """Stands in for a kill between two steps."""


def config_for(root: Path, model_dir: Path, output: Path, **extra) -> Path:
    path = write_config(root, model_dir, output, train_data=SPEC, progressive={"enabled": False}, precision="fp32",
                        **extra)
    settings = yaml.safe_load(path.read_text())
    settings["training"].update({"eval_strategy": "no", "save_steps": 2, "save_total_limit": 3})
    path.write_text(yaml.safe_dump(settings))
    return path


def recorded_steps(monkeypatch, kill_at: int | None = None, on_first=None) -> list:
    """Each training step's rows, as ``(global step, ids)``; ``kill_at``: raise :class:`Killed` before that step."""
    steps, step = [], TRAINING_STEP

    def training_step(self, model, inputs, *args, **kwargs):
        if on_first is not None and not steps:
            on_first()
        if kill_at is not None and self.state.global_step + 1 == kill_at:
            raise Killed
        steps.append((self.state.global_step + 1, inputs["input_ids"].tolist()))
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(NormSwapTrainer, "training_step", training_step)
    return steps


def batches(cache: Path) -> int:
    return len(list(cache.rglob("batch-*.safetensors")))


@pytest.mark.parametrize("train_tokens", [256, 256 * 1000])
def test_the_first_step_waits_for_the_same_few_batches_whatever_the_run_s_length(tiny_setup, tmp_path, monkeypatch,
                                                                                 train_tokens):
    root, model_dir = tiny_setup
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(cache))
    before = []
    recorded_steps(monkeypatch, kill_at=1, on_first=lambda: before.append(batches(cache)))
    config = config_for(root, model_dir, tmp_path / "run")
    with pytest.raises(Killed):
        recipe.main(["--config", str(config), f"train_tokens={train_tokens}"])
    # a global batch is 2 blocks of 32 tokens; a batch of samples is 2 x 32 tokens, some rows ending early at EOS:
    # the precision probe and the first step read the first blocks, a few batches, never the run's 4000 batches
    assert 1 <= before[0] <= 8


def test_a_run_killed_mid_stream_resumes_on_the_same_rows_and_losses(tiny_setup, tmp_path, monkeypatch):
    root, model_dir = tiny_setup
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache-unbroken"))
    unbroken_steps = recorded_steps(monkeypatch)
    start = time.monotonic()
    recipe.main(["--config", str(config_for(root, model_dir, tmp_path / "unbroken")), "training.max_steps=6"])
    unbroken_seconds = time.monotonic() - start
    unbroken = json.loads((tmp_path / "unbroken" / "summary.json").read_text())

    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache-broken"))  # the second run draws its own
    config = config_for(root, model_dir, tmp_path / "broken")
    first = recorded_steps(monkeypatch, kill_at=4)
    with pytest.raises(Killed):  # after checkpoint-2, during the stream's fourth global batch
        recipe.main(["--config", str(config), "training.max_steps=6"])
    drawn = batches(tmp_path / "cache-broken")
    assert [s for s, _ in first] == [1, 2, 3] and drawn < batches(tmp_path / "cache-unbroken")
    resumed = recorded_steps(monkeypatch)
    recipe.main(["--config", str(config), "training.max_steps=6"])
    broken = json.loads((tmp_path / "broken" / "summary.json").read_text())

    assert [s for s, _ in resumed] == [3, 4, 5, 6]  # from checkpoint-2
    assert 0 < unbroken["launches"][-1]["first_step_seconds"] < unbroken_seconds  # loading to the first step
    assert first + resumed[1:] == unbroken_steps[:3] + unbroken_steps[3:] and resumed[0] == unbroken_steps[2]
    losses = [[(h["step"], h["loss"]) for h in run["history"] if "loss" in h] for run in (unbroken, broken)]
    assert len(losses[0]) == 6 and [s for s, _ in losses[1]] == [s for s, _ in losses[0]]
    torch.testing.assert_close(torch.tensor([l for _, l in losses[1]]), torch.tensor([l for _, l in losses[0]]))
