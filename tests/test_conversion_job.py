"""A conversion as one job: the same job from a YAML file, from the command line's flags and from Python; a run
from Python writes the checkpoint the command line writes; a bad key is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from cli_runs import file_tree
from tiny_models import tiny_model, tiny_tokenizer

import hf_normswap
from hf_normswap import cli
from hf_normswap.conversion import Budget, CalibrationSettings, ConversionJob, Evaluation, Output, Selection, read_job
from hf_normswap.validation import ValidationError

YAML = """\
model: {model}
to: dyt
per_channel: true
fold: true
check: false
selection:
  roles: [attention_input, mlp_input]
  exclude: 'layers\\.1\\.'
calibration:
  data: none
budget:
  data: builtin
evaluation:
  max_tokens: 64
  batch_size: 2
output:
  directory: {output}
  overwrite: true
"""
FLAGS = ["--to", "dyt", "--per-channel", "--fold", "--no-check", "--roles", "attention_input,mlp_input",
         "--exclude", "layers\\.1\\.", "--calib", "none", "--eval-max-tokens", "64", "--eval-batch-size", "2",
         "--overwrite"]


def flags_job(argv: list[str]) -> ConversionJob:
    args = cli.build_parser().parse_args(["convert", *argv])
    return read_job(cli.convert.job_settings(args), config_file=args.config)


def python_job(model: str, output: str) -> ConversionJob:
    return ConversionJob(model=model, to="dyt", per_channel=True, fold=True, check=False,
                         selection=Selection(roles=["attention_input", "mlp_input"], exclude="layers\\.1\\."),
                         calibration=CalibrationSettings(data="none"), budget=Budget(data="builtin"),
                         evaluation=Evaluation(max_tokens=64, batch_size=2),
                         output=Output(directory=output, overwrite=True))


def weights(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.safetensors")))).hexdigest()


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "source"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_the_job_from_yaml_from_flags_and_from_python_is_one_job(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(YAML.format(model="tiny", output=tmp_path / "out"))
    from_file = flags_job(["--config", str(config)])
    from_flags = flags_job(["tiny", *FLAGS, "--output", str(tmp_path / "out")])
    assert from_file == from_flags == python_job("tiny", str(tmp_path / "out"))
    assert from_flags != ConversionJob(model="tiny", to="dyt")  # the comparison can tell jobs apart


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(YAML.format(model="tiny", output=tmp_path / "out"))
    job = flags_job(["other", "--config", str(config), "--to", "eln", "--roles", "final", "--eval-batch-size", "4"])
    assert (job.model, job.to, job.selection.roles, job.evaluation.batch_size) == ("other", "eln", ["final"], 4)
    assert job.per_channel and job.fold and not job.check and job.evaluation.max_tokens == 64  # the file's
    assert job.max_saturation == 0.01 and job.dtype == "float32" and job.budget.kl is None  # the defaults
    config.write_text("selection:\n  roles: attention_input, mlp_input\n")  # as --roles takes them
    assert flags_job(["--config", str(config)]).selection.roles == ["attention_input", "mlp_input"]


def test_a_run_from_python_writes_the_checkpoint_the_command_line_writes(source, tmp_path, capsys):
    assert cli.main(["convert", str(source), *FLAGS, "--output", str(tmp_path / "by-cli")]) == 0
    report = hf_normswap.run_job(python_job(str(source), str(tmp_path / "by-python")))
    assert report is not None and report.converted
    assert weights(tmp_path / "by-python") == weights(tmp_path / "by-cli")
    saved = [hf_normswap.load(tmp_path / name).config.normswap for name in ("by-cli", "by-python")]
    assert saved[0]["folded"] and saved[0] == saved[1]


@pytest.mark.parametrize("yaml, named", [
    ("to: dyt\ncalibration:\n  blocks: 4\n", "unknown setting calibration.blocks: did you mean calibration.num_blocks?"),
    ("to: dyt\nfolds: true\n", "unknown setting folds: did you mean fold?"),
    ("to: dyt\noutput: here\n", "setting output must be a section of settings"),
    ("to: dyt\nevaluation:\n  batch_size: many\n", "evaluation.batch_size"),
])
def test_a_bad_key_is_one_line_exit_2_and_nothing_written(source, tmp_path, capsys, yaml, named):
    config = tmp_path / "job.yaml"
    config.write_text(yaml)
    before = file_tree(tmp_path)
    code = cli.main(["convert", str(source), "--config", str(config), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"normswap: error: --config {config}: ") and err.count("\n") == 1, err
    assert named in err
    assert file_tree(tmp_path) == before


def test_a_job_without_a_method_or_a_model_is_refused_before_loading(tmp_path):
    with pytest.raises(hf_normswap.ConversionError, match="needs --to METHOD"):
        hf_normswap.run_job(ConversionJob(model=str(tmp_path / "missing")))
    with pytest.raises(hf_normswap.ConversionError, match="needs a model"):
        hf_normswap.run_job(ConversionJob(to="eln"))
    with pytest.raises(ValidationError, match="YAML anchors"):
        read_job(config_file=_write(tmp_path / "alias.yaml", "a: &x 1\nb: *x\n"))


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)
