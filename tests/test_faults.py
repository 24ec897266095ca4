"""Fault injection: tampered checkpoints, bad options and corrupt inputs, and saves killed at random moments.

Each case asserts the one-line error (or the refusal), the exit code, and that nothing the user owned was lost or
executed. Tiny models only; the kills run in subprocesses with fixed seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_normswap
from hf_normswap import checkpoint, cli
from hf_normswap.validation import ValidationError
from tiny_models import tiny_model

PAYLOAD = "LlamaConfig, LlamaForCausalLM #\n-__import__('os').system('touch PWNED')"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A converted tiny Llama saved once; tests copy it before tampering."""
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln")
    directory = tmp_path_factory.mktemp("converted") / "llama-eln"
    hf_normswap.save_pretrained(model, directory)
    return directory


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _cli(argv, capsys) -> tuple[int, str]:
    """Exit code and the error line (one line, no traceback) of a CLI run."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    return code, lines[-1] if lines else ""


# ---------------------------------------------------------------------------------- code from a config.json


@pytest.mark.parametrize("key", ["config_class", "architecture", "model_type"])
def test_code_in_config_class_is_refused_and_never_runs(converted, tmp_path, monkeypatch, capsys, key):
    monkeypatch.chdir(tmp_path)
    tampered = _copy(converted, tmp_path / "tampered")
    _edit_config(tampered, lambda c: c["normswap"]["base"].__setitem__(key, PAYLOAD))
    with pytest.raises(ValidationError, match=f"normswap.base.{key}") as refused:
        hf_normswap.load(tampered).save_pretrained(tmp_path / "other")
    assert "\n" not in str(refused.value)
    code, line = _cli(["eval", tampered, "--max-tokens", "8"], capsys)
    assert code == 2 and f"normswap.base.{key}" in line
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "other").exists()


def test_code_in_a_loaded_models_block_is_refused_when_saving(converted, tmp_path, monkeypatch):
    """The block of a model already in memory (edited after load) is checked again before code is generated."""
    monkeypatch.chdir(tmp_path)
    model = hf_normswap.load(converted)
    model.config.normswap["base"]["config_class"] = PAYLOAD
    with pytest.raises(ValidationError, match="normswap.base.config_class"):
        model.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "other").exists()
