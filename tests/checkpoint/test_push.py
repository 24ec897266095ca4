"""Push to the Hub with the real huggingface_hub client against a local Hub mirror that records the calls."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, constants

import hf_normswap
from hf_normswap import cli
from hub_mirror import TOKEN, USER, HubMirror
from tiny_models import tiny_model


@pytest.fixture
def hub(monkeypatch):
    with HubMirror() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    torch.set_num_threads(1)
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln")
    directory = tmp_path_factory.mktemp("push") / "tiny-eln"
    hf_normswap.save_pretrained(model, directory, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    return directory


def test_push_command_creates_repo_and_uploads_the_checkpoint(hub, checkpoint_dir, capsys):
    assert cli.main(["push", str(checkpoint_dir), "someone/tiny-eln", "--private"]) == 0
    assert f"pushed to {hub.url}/someone/tiny-eln" in capsys.readouterr().out
    assert hub.created == {"someone/tiny-eln": {"name": "tiny-eln", "organization": "someone", "visibility": "private",
                                              "type": "model"}}
    assert hub.paths()[0] == "/api/repos/create"
    assert hub.paths()[-1] == "/api/models/someone/tiny-eln/commit/main"
    assert all(c["auth"] == f"Bearer {TOKEN}" for c in hub.calls)
    uploaded = hub.files("someone/tiny-eln")
    local = {p.name for p in checkpoint_dir.iterdir()}
    assert set(uploaded) == local
    assert {"config.json", "model.safetensors", "modeling_normswap.py", "README.md", "generation_config.json"} <= local
    for name in local:
        assert uploaded[name] == (checkpoint_dir / name).read_bytes(), name
    config = json.loads(uploaded["config.json"])
    assert config["model_type"] == "normswap_llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_normswap.NormSwapLlamaForCausalLM"
    assert config["normswap"]["method"] == "eln" and "model.norm" in config["normswap"]["converted"]
    card = ModelCard(uploaded["README.md"].decode())
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.library_name == "transformers" and "eln" in card.data.tags
    assert "trust_remote_code=True" in card.text and "Stollenwerk" in card.text
    assert hub.commits[0]["header"]["summary"] == "ELN checkpoint converted with hf-normswap"


def test_convert_push_to_hub_without_output(hub, tmp_path, capsys):
    source = tmp_path / "source"
    tiny_model("gpt2").save_pretrained(source)
    assert cli.main(["convert", str(source), "--to", "dyt", "--calib", "none", "--push-to-hub", "plain-name"]) == 0
    assert "pushed to" in capsys.readouterr().out
    assert hub.created[f"{USER}/plain-name"]["organization"] is None
    assert "visibility" not in hub.created[f"{USER}/plain-name"]
    uploaded = hub.files(f"{USER}/plain-name")
    assert {"config.json", "model.safetensors", "modeling_normswap.py", "README.md"} <= set(uploaded)
    config = json.loads(uploaded["config.json"])
    assert config["normswap"]["method"] == "dyt" and config["model_type"] == "normswap_gpt2"
    assert "tanh(alpha * x)" in uploaded["README.md"].decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # the scratch checkpoint is gone


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("normswap: error: ") and err.count("\n") == 1, err
    return err


def test_missing_token_is_one_line_and_sends_nothing(hub, checkpoint_dir, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert cli.main(["push", str(checkpoint_dir), "someone/x"]) == 2
    assert "no Hugging Face token" in _one_line_error(capsys)
    # convert checks it before loading anything: the model spec does not even exist
    assert cli.main(["convert", str(tmp_path / "missing"), "--to", "eln", "--push-to-hub", "someone/x"]) == 2
    assert "no Hugging Face token" in _one_line_error(capsys)
    assert hub.calls == []


@pytest.mark.parametrize("repo", ["bad name!", "a/b/c", "owner/bad--name", "ends-with-dash-", "x" * 100])
def test_invalid_repo_name_is_one_line_and_sends_nothing(hub, checkpoint_dir, tmp_path, capsys, repo):
    assert cli.main(["push", str(checkpoint_dir), repo]) == 2
    assert "invalid repository name" in _one_line_error(capsys)
    assert cli.main(["convert", str(tmp_path / "missing"), "--to", "eln", "--push-to-hub", repo]) == 2
    assert "invalid repository name" in _one_line_error(capsys)
    assert hub.calls == []


def test_unreachable_endpoint_is_one_line(checkpoint_dir, monkeypatch, capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli.main(["push", str(checkpoint_dir), "someone/x"]) == 2
    err = _one_line_error(capsys)
    assert "cannot reach the Hub" in err and str(port) in err


def test_rejected_token_is_one_line(hub, checkpoint_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert cli.main(["push", str(checkpoint_dir), "someone/x"]) == 2
    assert "rejected the token (401)" in _one_line_error(capsys)
    assert hub.paths()[0] == "/api/repos/create" and hub.created == {} and hub.repos == {}


def test_push_refuses_a_directory_that_is_not_a_checkpoint(hub, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["push", str(tmp_path), "someone/x"]) == 2
    assert "not a checkpoint saved by hf_normswap" in _one_line_error(capsys)
    assert hub.calls == []


def test_private_needs_push_to_hub(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "missing"), "--to", "eln", "--private"]) == 2
    assert "--private needs --push-to-hub" in _one_line_error(capsys)


def test_push_uploads_the_checkpoint_alone_not_what_lies_beside_it(hub, tmp_path, capsys):
    """A checkpoint saved into a Trainer's output_dir: its checkpoint-N folders, notes and the user's README stay
    local, and the command says so."""
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln")
    folder = tmp_path / "trainer-out"
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "checkpoint-2" / "optimizer.pt").write_bytes(b"state")
    (folder / "notes.txt").write_text("private")
    (folder / "README.md").write_text("# my experiment\n")
    model.save_pretrained(folder)
    capsys.readouterr()
    assert cli.main(["push", str(folder), "someone/trainer-out"]) == 0
    uploaded = set(hub.files("someone/trainer-out"))
    assert {"config.json", "model.safetensors", "modeling_normswap.py"} <= uploaded
    assert not uploaded & {"README.md", "notes.txt", "checkpoint-2/optimizer.pt"}, uploaded
    err = capsys.readouterr().err
    assert err == "normswap: warning: not uploaded, not part of the checkpoint: README.md, checkpoint-2, notes.txt\n"


def test_push_api_returns_repo_url(hub, checkpoint_dir):
    url = hf_normswap.checkpoint.hub.push(Path(checkpoint_dir), "org/api-push")
    assert url == f"{hub.url}/org/api-push"
    assert "config.json" in hub.files("org/api-push")


def test_credentials_in_the_endpoint_are_not_printed(checkpoint_dir, monkeypatch, capsys):
    """``HF_ENDPOINT=http://user:token@host``: the push error printed the token."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://me:hf_SECRETinURL@127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli.main(["push", str(checkpoint_dir), "someone/x"]) == 2
    err = _one_line_error(capsys)
    assert "cannot reach the Hub at http://***@127.0.0.1" in err and "hf_SECRETinURL" not in err and "me:" not in err
