"""Calibration with the weights on disk, block by block: the same checkpoint, bit for bit, as calibrating the model
in memory, from a model whose weights stay in its safetensors shards."""

import os

import pytest
import torch

import hf_normswap
from hf_normswap import cli, offload
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.checkpoint.loading import ModelLoadError, load_model
from hf_normswap.planning import PlanSettings, disk, model_sizes
from hf_normswap.planning.phases import Phase
from hf_normswap.planning.recipe_memory import conversion_phases
from hf_normswap.planning.recipe_plan import calibration_settings
from cli_runs import run_cli
from tiny_models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Llama with tied embeddings (as SmolLM2, Llama-3.2) saved as several safetensors shards, with its
    tokenizer."""
    folder = tmp_path_factory.mktemp("sharded")
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(folder, max_shard_size="20KB")
    tiny_tokenizer().save_pretrained(folder)
    return folder


def saved_names(folder):
    from safetensors import safe_open

    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names


def calibration(**changes):
    ids = torch.randint(3, 120, (8, 32), generator=torch.Generator().manual_seed(0))
    settings = dict(data=ids, strategy="block", block_steps=3, tune_steps=0, progress=False)
    return CalibrationConfig(**{**settings, **changes})


@pytest.mark.parametrize("method", ["eln", "dyt"])
def test_calibrating_from_disk_gives_the_in_memory_checkpoint(sharded, tmp_path, method):
    in_memory, _ = load_model(str(sharded), with_tokenizer=False)
    on_disk, _ = load_model(str(sharded), with_tokenizer=False, weights_memory=1)
    assert not offload.is_offloaded(in_memory)
    assert offload.is_offloaded(on_disk) and all(p.device.type == "meta" for p in on_disk.model.layers.parameters())
    reports = [hf_normswap.convert(m, method, calibration=calibration()) for m in (in_memory, on_disk)]
    assert all(p.device.type == "meta" for p in on_disk.model.layers.parameters())  # calibrated blocks back on disk
    hf_normswap.save_pretrained(on_disk, tmp_path / "out")
    hf_normswap.save_pretrained(in_memory, tmp_path / "memory")
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "memory")  # the tied head written once
    reloaded = hf_normswap.load(tmp_path / "out")
    expected, saved = in_memory.state_dict(), reloaded.state_dict()
    assert expected.keys() == saved.keys()
    assert all(torch.equal(expected[k], saved[k]) for k in expected), [k for k in expected
                                                                     if not torch.equal(expected[k], saved[k])]
    assert [c.shape_parameter for c in reports[0].converted] == [c.shape_parameter for c in reports[1].converted]
    assert reports[0].calibration["block_tuning"] == reports[1].calibration["block_tuning"]


def test_on_disk_the_end_to_end_steps_are_skipped_and_said(sharded, caplog):
    on_disk, _ = load_model(str(sharded), with_tokenizer=False, weights_memory=1)
    report = hf_normswap.convert(on_disk, "eln", calibration=calibration(tune_steps=5))
    assert report.calibration["tune_steps"] == 0 and "tuning" not in report.calibration
    assert "calibrating block by block, without the end-to-end steps" in caplog.text


def test_the_user_files_are_only_read_and_the_offload_folder_goes_with_the_model(sharded):
    before = {p.name: p.read_bytes() for p in sharded.iterdir()}
    on_disk, _ = load_model(str(sharded), with_tokenizer=False, weights_memory=1)
    folder = getattr(on_disk, offload.FOLDER_ATTRIBUTE).name
    hf_normswap.convert(on_disk, "eln", calibration=calibration())
    assert {p.name: p.read_bytes() for p in sharded.iterdir()} == before
    getattr(on_disk, offload.FOLDER_ATTRIBUTE).cleanup()
    assert not os.path.exists(folder)


def test_a_gguf_file_cannot_stay_on_disk(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="a GGUF file loads whole"):
        load_model(str(tmp_path / "model.gguf"), weights_memory=2**30)


def test_the_budget_leaves_room_for_the_block_pass(sharded):
    """Within a limit below the whole conversion's peak, the weights get what the block pass (no end-to-end steps)
    leaves of it; below the block pass's own needs, a refusal."""
    config = calibration(tune_steps=30, tune_blocks=8)
    sizes, settings = model_sizes(str(sharded)), PlanSettings(**calibration_settings(config))
    whole = max(phase.host_main for phase in conversion_phases(sizes, settings))
    on_disk = conversion_phases(sizes, settings.replace(weights_on_disk=True))
    assert all(phase.main["model"] == 0 for phase in on_disk)
    block_pass = max(phase.host_main for phase in on_disk)
    assert block_pass < whole - sizes.parameter_bytes()  # the end-to-end steps' logits are left out
    assert disk.weights_in_memory(str(sharded), config, whole) is None
    assert disk.weights_in_memory(str(sharded), config, whole - 1) == whole - 1 - block_pass
    with pytest.raises(disk.PlanError, match="not above what calibration needs beside the weights"):
        disk.weights_in_memory(str(sharded), config, block_pass)


def test_the_command_line_keeps_weights_on_disk_within_the_limit(sharded, tmp_path, monkeypatch, capsys):
    """A limit below the whole conversion's needs: the line says so and calibration runs from disk (no end-to-end
    steps); a limit below the block pass's needs, or no size at all, is one line and writes nothing."""
    text = tmp_path / "calib.txt"
    text.write_text("the model of the norm and the data in the text " * 200)
    flags = ["--to", "eln", "--calib", text, "--calib-blocks", "8", "--calib-len", "32", "--block-steps", "3",
             "--no-check"]
    assert run_cli(["convert", sharded, *flags, "--output", tmp_path / "memory"], capsys)[0] == 0
    monkeypatch.setattr(disk, "conversion_phases", lambda sizes, settings: [  # a model of 1 MiB beside 1 MiB
        Phase("calibration", main={"model": 0 if settings.weights_on_disk else 2**20, "runtime": 2**20})])
    assert cli.main([str(a) for a in ["convert", sharded, *flags, "--max-host-memory", "1.01MiB", "--output",
                                      tmp_path / "disk"]]) in (0, None)
    assert "stay on disk: calibrating block by block (--max-host-memory: 0.0 GiB)" in capsys.readouterr().out
    in_memory, on_disk = (hf_normswap.load(tmp_path / name).config.normswap["calibration"]
                          for name in ("memory", "disk"))
    assert (in_memory["tune_steps"], on_disk["tune_steps"]) == (30, 0)  # the block strategy's end-to-end steps
    line = run_cli(["convert", sharded, *flags, "--max-host-memory", "1MiB", "--output", tmp_path / "x"], capsys)[1]
    assert "a host memory of 1.0 MiB is not above what calibration needs beside the weights (1.0 MiB)" in line
    assert line.endswith("allow more, or calibrate on fewer or shorter sequences")
    assert run_cli(["convert", sharded, *flags, "--max-host-memory", "lots", "--output", tmp_path / "x"],
                   capsys)[1].endswith("is not a size: write it as e.g. 80GB, 80GiB or 512MB")
    assert not (tmp_path / "x").exists()
