"""--device / --dtype: checked before any model loads, passed through to the loader, and the passes run where the
model is (on this CPU machine: cpu in bfloat16; tests/test_cuda.py does CUDA)."""

from __future__ import annotations

import pytest
import torch

import hf_normswap.cli as cli
from hf_normswap.checkpoint.loading import load_model
from hf_normswap.conversion import run as conversion_run
from hf_normswap.conversion.job import read_job
from hf_normswap.modules import ElementwiseNorm
from hf_normswap.placement import check_device, default_device
from tiny_models import tiny_model, tiny_tokenizer

COMMANDS = {"inspect": [], "convert": ["--to", "eln"], "eval": [], "sensitivity": ["--to", "eln"]}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", max_position_embeddings=256).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture
def loaded(monkeypatch):
    """The models the command line loads, through the real loader, and the arguments it got."""
    seen = []

    def spy(*args, **kwargs):
        model, tokenizer = load_model(*args, **kwargs)
        seen.append((model, kwargs))
        return model, tokenizer

    for verb in (cli.inspect, conversion_run, cli.evaluate, cli.sensitivity):
        monkeypatch.setattr(verb, "load_model", spy)
    return seen


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("normswap: error: "), err
    return err[0]


def test_check_device():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'gpu0' is not a torch device: name one such as cpu, cuda or cuda:1"):
        check_device("gpu0")
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


@no_cuda
def test_cuda_is_refused_without_one():
    with pytest.raises(ValueError, match="--device 'cuda:1': this machine has no cuda device; pass --device cpu"):
        check_device("cuda:1", "--device")


def test_defaults(model_dir):
    for command, extra in COMMANDS.items():
        args = cli.build_parser().parse_args([command, model_dir, *extra])
        if command == "convert":  # the flags set what is given; the job holds the defaults
            assert read_job(cli.convert.job_settings(args)).placement() == {"device": default_device(),
                                                                            "dtype": torch.float32}
        else:
            assert (args.device, args.dtype) == (default_device(), "float32")


def test_convert_loads_and_calibrates_in_the_dtype_and_on_the_device_given(model_dir, loaded, tmp_path):
    out = tmp_path / "converted"
    argv = ["convert", model_dir, "--to", "eln", "--device", "cpu", "--dtype", "bfloat16", "--calib", "builtin",
            "--calib-blocks", "2", "--calib-len", "16", "--strategy", "fast", "--output", str(out)]
    assert cli.main(argv) == 0
    (model, kwargs), = loaded
    assert kwargs == {"device": "cpu", "dtype": torch.bfloat16, "weights_memory": None}  # the whole model fits
    norms = [m for m in model.modules() if isinstance(m, ElementwiseNorm)]
    assert len(norms) == 5 and all(m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu" for m in norms)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    reloaded, _ = load_model(str(out), with_tokenizer=False, dtype=torch.bfloat16, device="cpu")
    assert next(reloaded.parameters()).dtype == torch.bfloat16


def test_eval_loads_both_models_in_the_dtype_and_on_the_device_given(model_dir, loaded, capsys):
    argv = ["eval", model_dir, "--against", model_dir, "--device", "cpu", "--dtype", "bfloat16", "--max-tokens", "64",
            "--json"]
    assert cli.main(argv) == 0
    assert all(kwargs["device"] == "cpu" and kwargs["dtype"] == torch.bfloat16 for _, kwargs in loaded)
    assert len(loaded) == 2
    assert all(next(model.parameters()).dtype == torch.bfloat16 for model, _ in loaded)
    assert '"kl"' in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_device_is_one_line_before_the_model_loads(command, capsys):
    """The model path does not exist: the flag's error, not 'model not found', shows the check ran first."""
    argv = [command, "/nonexistent/model", *COMMANDS[command]]
    assert cli.main([*argv, "--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a torch device" in _error_line(capsys)
    with pytest.raises(SystemExit) as exit:
        cli.main([*argv, "--dtype", "float64"])
    assert exit.value.code == 2
    assert "argument --dtype: invalid choice: 'float64'" in _error_line(capsys)


@no_cuda
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cuda_on_a_machine_without_one_is_one_line(command, capsys):
    assert cli.main([command, "/nonexistent/model", *COMMANDS[command], "--device", "cuda"]) == 2
    assert _error_line(capsys) == ("normswap: error: --device 'cuda': this machine has no cuda device; "
                                   "pass --device cpu")
