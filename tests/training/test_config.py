"""The recipe's typed settings: every key, type and range is checked from the dataclasses, before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_normswap.training.config import RecipeConfig, read_recipe_config
from hf_normswap.settings import read_settings
from hf_normswap.surgery import DEFAULT_ROLES
from hf_normswap.validation import ValidationError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "recipes" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("overrides, message", [
    (["distill.wieght=1"], "unknown setting distill.wieght: did you mean distill.weight?"),
    (["calibration.num_blok=3"], "unknown setting calibration.num_blok: did you mean calibration.num_blocks?"),
    (["training.max_stpes=3"], "unknown setting training.max_stpes: did you mean training.max_steps?"),
    (["trainable=some"], "setting trainable: Invalid value 'some', expected one of ['norms', 'all', 'lora']"),
    (["block_len=abc"], "setting block_len: 'abc' is not an integer (digits, e.g. 64)"),
    (["distill.logits=maybe"], "setting distill.logits: Value 'maybe' is not a valid bool"),
    (["distill=3"], "setting distill must be a section of settings, got 3"),
    (["lr.base=-1"], "lr.base must be at least 0, got -1"),
    (["block_len=0"], "block_len must be at least 1, got 0"),
    (["method=rms"], "method 'rms' is unknown: choose from"),
    (["calibration.strategy=xx"], "calibration: unknown calibration strategy 'xx'"),
    (["trainable=lora", "progressive.enabled=true"], "progressive conversion works with trainable: norms or all"),
    (["trainable=lora", "hand_over.kind=taper", "taper.fraction=0.5"], "the taper works with trainable: norms or all"),
    (["taper.fraction=0.5", "hand_over.kind=progressive"],
     "hand_over.kind=progressive and taper.fraction both hand the norms over: keep one, set hand_over.kind=none or "
     "taper.fraction=0"),
    (["hand_over.kind=slowly"], "hand_over.kind 'slowly' is unknown: choose none, progressive, taper"),
    (["hand_over.kind=taper"], "hand_over.kind=taper needs taper.fraction > 0"),
    (["hand_over.kind=progressive", "hand_over.options={every: 2}"], "hand_over.options: progressive takes none"),
    (["distill.terms.hidden=1"], "distill.terms.hidden is not a loss term added to training/loss_terms"),
    (["training.output_dir=x"], "unknown setting training.output_dir"),  # the recipe's own output_dir sets it
    (["block_len"], "override 'block_len' is not KEY=VALUE"),
    (["train_data=[builtin:calibration]"], "train_data must be a text source, or a list of two or more to mix"),
    (["train_data=[builtin:calibration, '']"], "train_data must be a text source, or a list of two or more to mix"),
    (["train_data=[a.txt, 3]"], "setting train_data: Value '['a.txt', 3]' of type 'ListConfig' is incompatible"),
    (["streaming=true", "train_data=[a, b]"], "streaming reads one Hub dataset: name one train_data"),
    (["train_data=[generated:length=256,batch_size=128, a.txt]"], "train_data: 'batch_size=128' is an option cut off"),
    (["train_data=[generated, repeated:words=3,copies=3:/data/a.txt]"], "'copies=3:/data/a.txt' is an option cut off"),
    (["roles=[mlp_input, attention]"], "roles: unknown role(s) ['attention']: choose from attention_input, mlp_input"),
    (["roles=[]"], "roles names no role: leave it unset (convert's default) or name some"),
])
def test_a_wrong_setting_is_one_error_that_names_it(overrides, message):
    with pytest.raises(ValidationError) as error:
        read_recipe_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_roles_converted_are_convert_s_default_a_list_or_a_comma_separated_string():
    assert RecipeConfig().roles_to_convert == DEFAULT_ROLES
    assert read_recipe_config(None, ["roles=[mlp_input, final]"]).roles_to_convert == ("mlp_input", "final")
    assert read_recipe_config(None, ["roles=mlp_input,final"]).roles_to_convert == ("mlp_input", "final")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_reads_into_the_dataclasses_and_back(path):
    config = read_recipe_config(str(path), [])
    settings = config.to_dict()
    assert read_settings(RecipeConfig, settings).to_dict() == settings


def test_sections_update_their_defaults_and_overrides_reach_into_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("calibration: {block_steps: 5}\ndistill: {hidden: 2.0}\ntraining: {max_steps: 7}\n")
    config = read_recipe_config(str(path), ["distill.weight=1", "calibration.num_blocks=3"])
    default = RecipeConfig()
    assert (config.calibration.block_steps, config.calibration.num_blocks) == (5, 3)
    assert config.calibration.block_len == default.calibration.block_len  # a section keeps what it does not set
    assert (config.distill.hidden, config.distill.weight) == (2.0, 1)
    assert config.training["max_steps"] == 7
    assert config.training["lr_scheduler_type"] == default.training["lr_scheduler_type"]


def test_an_exponent_without_a_point_is_a_float():
    """YAML 1.1 reads 1e-3 as a string; it is the learning rate users type most."""
    assert read_recipe_config(None, ["lr.base=1e-3", "lr.shape=5E-2"]).lr.base == 1e-3


def test_an_exponent_in_a_config_file_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: {base: 2e-4}\ndistill: {temperature: 1e0}\n")
    config = read_recipe_config(str(path), [])
    assert (config.lr.base, config.distill.temperature) == (2e-4, 1.0)


def test_the_hand_over_kind_and_the_old_keys_name_the_same_hand_over():
    """``hand_over.kind`` and the keys of the ``progressive`` and ``taper`` sections are one setting: either way the
    run has one kind, and every reader of the sections sees it."""
    cases = [(["progressive.enabled=true"], "progressive"), (["hand_over.kind=progressive"], "progressive"),
             (["taper.fraction=0.5"], "taper"), (["hand_over.kind=taper", "taper.fraction=0.5"], "taper"), ([], "none")]
    for overrides, kind in cases:
        config = read_recipe_config(None, overrides)
        assert config.hand_over.kind == kind, overrides
        assert config.progressive.enabled == (kind == "progressive") and bool(config.taper.fraction) == (kind == "taper")
