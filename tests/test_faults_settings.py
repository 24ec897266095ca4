"""Fault injection on settings: a secret through each escape YAML offers, values of the wrong kind for transformers'
TrainingArguments, absurd sizes, and the messages a careless user sees. Each refusal is one line, exit code 2,
before any model loads, and writes nothing."""

from __future__ import annotations

import pytest

from cli_runs import recipe_refusal, run_cli

TOKEN = "hf_FAKEtoken0123456789"
ENV = "{oc.env:HF_TOKEN}"
# every way YAML writes a `$`: escapes of double-quoted scalars, then `${` plain, in flow and block collections and
# in block scalars; a key as well as a value
ESCAPED = [f'"\\x24{ENV}"', f'"\\u0024{ENV}"', f'"\\U00000024{ENV}"', f"'${ENV}'", f'"${ENV}"', f"me/${ENV}"]
FILES = ([f"push_to_hub: {v}\n" for v in ESCAPED] + [f"output_dir: {v}\n" for v in ESCAPED]
         + [f"eval_data: {v}\n" for v in ESCAPED]
         + [f'train_data: [generated, "\\x24{ENV}"]\n', f"train_data:\n  - generated\n  - \"\\x24{ENV}\"\n",
            f"push_to_hub: |\n  me/${ENV}\n", f"push_to_hub: >-\n  me/${ENV}\n",
            f'training: {{"\\x24{ENV}": 1}}\n', f'training:\n  report_to: "\\x24{ENV}"\n',
            f'calibration: {{data: "\\x24{ENV}"}}\n'])


pytestmark = pytest.mark.usefixtures("no_loading")


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)


def _nothing_written(root) -> bool:
    return [p.name for p in root.iterdir() if p.name != "config.yaml"] == []


@pytest.mark.parametrize("text", FILES)
def test_no_escape_of_an_interpolation_reaches_omegaconf_from_a_file(tmp_path, capsys, monkeypatch, text):
    """``"me/model-\\x24{oc.env:HF_TOKEN}"`` passed the check of the raw text, and OmegaConf resolved it: the push
    went to a repository named with the token, output_dir's folder was named with it, an error printed it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(f"output_dir: {tmp_path / 'run'}\n" * ("output_dir" not in text) + text)
    err = recipe_refusal(["--config", tmp_path / "config.yaml"], capsys)
    assert "interpolations (${...}) are not read" in err and TOKEN not in err
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("value", ESCAPED + [f'[generated, "\\x24{ENV}"]'])
def test_no_escape_of_an_interpolation_reaches_omegaconf_from_an_override(tmp_path, capsys, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", f"eval_data={value}"], capsys)
    assert "interpolations (${...}) are not read" in err and TOKEN not in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--calib-device", "--calib"])
def test_no_interpolation_reaches_omegaconf_from_a_flag(tmp_path, capsys, flag):
    """``convert --calib-device '${oc.env:HF_TOKEN}'`` printed the token."""
    code, line = run_cli(["convert", "offline:nothing", "--to", "eln", flag, f"${ENV}", "--output", tmp_path / "x"],
                         capsys)
    assert code == 2 and f"{flag}: interpolations" in line and TOKEN not in line
    assert list(tmp_path.iterdir()) == []


def test_a_dollar_brace_in_a_yaml_comment_is_only_a_comment(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(f"# the token: ${ENV} is never read\nmethod: nothing\n")
    err = recipe_refusal(["--config", tmp_path / "config.yaml"], capsys)
    assert "interpolations" not in err and "method" in err


def test_settings_nested_thousands_deep_are_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    err = recipe_refusal(["--config", tmp_path / "config.yaml"], capsys)
    assert "exceeded maximum nesting depth (line 1)" in err or "nested deeper than a settings file is" in err


@pytest.mark.parametrize("setting, message", [
    ("training.max_steps=[1,2]", "training.max_steps must be int, got [1, 2]"),
    ("training.eval_steps=abc", "training.eval_steps must be null or float, got 'abc'"),
    ("training.gradient_accumulation_steps=0", "training.gradient_accumulation_steps must be at least 1, got 0"),
    ("training.per_device_train_batch_size=[2]", "training.per_device_train_batch_size must be int, got [2]"),
    ("training.report_to=surely_not_an_integration", "names surely_not_an_integration, which is not installed")])
def test_training_values_are_checked_before_loading(tmp_path, capsys, setting, message):
    """Each was a TypeError, ZeroDivisionError or RuntimeError traceback after loading and calibration (the batch
    size one before loading)."""
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", setting], capsys)
    assert message in err and list(tmp_path.iterdir()) == []


def test_a_reporting_integration_not_installed_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    import transformers.integrations

    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: ["tensorboard"])
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", "training.report_to=[tensorboard, wandb]"], capsys)
    assert "training.report_to names wandb, which is not installed here" in err


def test_a_nan_weight_is_refused_in_one_line_before_sampling(tmp_path, capsys):
    """The default convert failed with `index 2 is out of bounds` in the sampler."""
    import torch

    from tiny_models import tiny_model, tiny_tokenizer

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    code, line = run_cli(["convert", tmp_path / "llama", "--to", "eln", "--output", tmp_path / "out"], capsys)
    assert code == 2 and "model.layers.0.mlp.up_proj.weight holds NaN or infinite values" in line
    assert not (tmp_path / "out").exists()


def test_an_output_below_a_file_names_the_file(tmp_path, capsys):
    """``--output FILE/sub`` said "permission denied"."""
    (tmp_path / "file").write_text("mine")
    code, line = run_cli(["convert", tmp_path / "no-such-model", "--to", "eln", "--output", tmp_path / "file" / "sub"],
                         capsys)
    assert code == 2 and f"{tmp_path / 'file'} is a file, not a folder; choose another --output" in line
    assert (tmp_path / "file").read_text() == "mine"


def test_a_list_longer_than_any_setting_is_one_short_line(tmp_path, capsys):
    """A 120,000-entry train_data gave a 1.3 MB error line after 57 s (OmegaConf merging the list)."""
    (tmp_path / "config.yaml").write_text("train_data: [" + ",".join(f"f{i}" for i in range(120_000)) + "]\n")
    err = recipe_refusal(["--config", tmp_path / "config.yaml", f"output_dir={tmp_path / 'run'}"], capsys)
    assert "train_data: 120,000 entries; a setting holds at most 1,000" in err and len(err) < 300


def test_a_calibration_tokenizer_is_refused_not_ignored(tmp_path, capsys):
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", "calibration.tokenizer=gpt2"], capsys)
    assert "calibration.tokenizer is not a setting of the recipe" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "64", "hidden_size is '64'; it must be a positive integer"),
    ("num_attention_heads", 0, "num_attention_heads is 0; it must be a positive integer"),
    ("hidden_size", 2**40, "hidden_size is 1,099,511,627,776; no model has more than 16,777,216"),
    ("num_hidden_layers", 10**7, "num_hidden_layers is 10,000,000; no model has more than 10,000")])
@pytest.mark.parametrize("verb", ["plan", "inspect"])
def test_absurd_config_values_are_one_line_in_plan_and_inspect(tmp_path, capsys, key, value, message, verb):
    """``plan`` gave tracebacks where ``inspect`` refused in one line; 10**7 layers hung both."""
    import json

    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, key: value}))
    code, line = run_cli([verb, tmp_path / "llama"], capsys)
    assert code == 2 and f"config.json {message}" in line


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("5E4", 5e4), (".5", 0.5), ("-.5", -0.5), ("+.5e-3", 5e-4),
                                         ("1_000.5", 1000.5), ("2026-11-29", "2026-11-29")])
def test_settings_read_yaml_1_2_numbers_and_no_dates(value, text):
    """OmegaConf's YAML loader reads the floats YAML 1.2 does (YAML 1.1 reads 1e-3 as a string) and no dates."""
    from hf_normswap.settings import read_overrides

    assert read_overrides([f"a={text}"]) == {"a": value}


@pytest.mark.parametrize("setting, key", [("train_data=generated:length=abc", "train_data"),
                                          ("train_data=[builtin, 'generated:lenth=5']", "train_data"),
                                          ("calibration.data=generated:seed=x", "calibration.data"),
                                          ("eval_data=generated:length=-1", "eval_data")])
def test_a_malformed_sample_spec_is_one_line_naming_its_key(tmp_path, capsys, setting, key):
    """Resolving the run reads each samples spec's length (the context check): a malformed one was a DataError
    traceback there, before the data check that names the key."""
    err = recipe_refusal([setting, f"output_dir={tmp_path / 'run'}"], capsys)
    assert err.startswith(f"finetune: error: {key}: generated: ")
    assert not (tmp_path / "run").exists()
