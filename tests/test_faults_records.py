"""Fault injection on a converted checkpoint's record: each entry of the ``normswap`` block checked by type and value
when it loads, and before the recipe loads anything, in one line naming the field and the checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest

import hf_normswap
from cli_runs import recipe_refusal, run_cli
from hf_normswap.validation import ValidationError

NORM = "model.norm"
TAMPERED = {  # a change of the final norm's entry -> what the one line names
    "role a list": ({"role": ["final"]}, "role: ['final'] is not a role"),
    "role unknown": ({"role": "tail"}, "role: 'tail' is not a role"),
    "kind banana": ({"kind": "banana"}, "kind: 'banana' is not a norm kind (layernorm, rmsnorm)"),
    "size not the weights'": ({"size": 64}, "size: 64 is not the last size of normswap.converted.model.norm.normalized_shape [32]"),
    "size and shape not the weights'": ({"size": 64, "normalized_shape": [64]},
                                         "normalized_shape: [64], but the weights hold model.norm.weight of shape"),
    "unknown field": ({"colour": "red"}, "colour: not a field of a converted norm"),
}


def _tampered(converted, tmp_path, change: dict):
    directory = tmp_path / "tampered"
    shutil.copytree(converted, directory)
    config = json.loads((directory / "config.json").read_text())
    config["normswap"]["converted"][NORM].update(change)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_malformed_entry_is_refused_when_the_checkpoint_loads(converted, tmp_path, capsys, case):
    """A role set to a list loaded, and the recipe died at its first save (``unhashable type: 'list'`` in the model
    card); a kind, a size or a field nobody reads were accepted silently."""
    change, message = TAMPERED[case]
    directory = _tampered(converted, tmp_path, change)
    with pytest.raises(ValidationError, match="normswap.converted.model.norm.") as error:
        hf_normswap.load(directory)
    assert message in str(error.value) and "\n" not in str(error.value)
    code, line = run_cli(["inspect", directory], capsys)
    assert code == 2 and line.startswith(f"normswap: error: {directory}: config.json normswap.converted.{NORM}.")
    assert message in line


@pytest.mark.usefixtures("no_loading")
def test_the_recipe_refuses_a_malformed_entry_before_loading(converted, tmp_path, capsys):
    directory = _tampered(converted, tmp_path, {"role": ["final"]})
    err = recipe_refusal([f"model={directory}", f"original={converted}", f"output_dir={tmp_path / 'run'}"], capsys)
    assert f"{directory}: config.json normswap.converted.{NORM}.role: ['final'] is not a role" in err
    assert not (tmp_path / "run").exists()


def test_an_entry_as_saved_loads(converted):
    assert hf_normswap.load(converted) is not None
