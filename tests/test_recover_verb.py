"""``normswap recover``: the recovery recipe run from the command line, with its config and overrides."""

from __future__ import annotations

import pytest

from hf_normswap import cli


def test_recover_runs_the_recipe_with_the_config_and_the_overrides(monkeypatch):
    recipe = pytest.importorskip("hf_normswap.training.recipe")
    seen = []
    monkeypatch.setattr(recipe, "main", lambda argv, command: seen.append((argv, command)) or 0)
    assert cli.main(["recover", "--config", "c.yaml", "lr.base=1e-3", "training.max_steps=5"]) == 0
    assert seen == [(["--config", "c.yaml", "lr.base=1e-3", "training.max_steps=5"], "normswap recover")]


def test_recover_names_its_verb_in_an_error(tmp_path, capsys):
    """A bad setting stops the run before loading, in one line that starts with the command the user ran."""
    pytest.importorskip("hf_normswap.training.recipe")
    config = tmp_path / "c.yaml"
    config.write_text("model: offline:smollm2\n")
    with pytest.raises(SystemExit) as exit:
        cli.main(["recover", "--config", str(config), "lr.base=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and err[-1].startswith("normswap recover: error: lr.base"), err
    from hf_normswap.training.recipe import main

    with pytest.raises(SystemExit):
        main(["--config", str(config), "lr.base=-1"])
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("finetune: error: lr.base")


def test_recover_without_a_config_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["recover"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and "--config" in err[0]


def test_the_readme_names_the_verbs_the_command_has():
    """The README's sections for the verbs (Inspect, Convert, Recover, Evaluate) are verbs of `normswap`."""
    from pathlib import Path

    readme = (Path(cli.__file__).parents[2] / "README.md").read_text()
    for verb in ("inspect", "convert", "recover", "eval"):
        assert f"\nnormswap {verb} " in readme, verb
    assert {"inspect", "convert", "recover", "eval"} <= set(cli.VERBS)
