"""The command line and the recipe run in-process, as the fault tests read them: the exit code and the one error
line; and the files a refused command must leave as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_normswap import cli
from hf_normswap.training import recipe


def run_cli(argv, capsys) -> tuple[int, str]:
    """Exit code and the last stderr line of ``normswap ARGV``; a traceback fails the test."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    return code, lines[-1] if lines else ""


def recipe_refusal(argv, capsys) -> str:
    """The recipe's (``hf_normswap.training.recipe``) one error line for ``argv``, asserting exit code 2."""
    with pytest.raises(SystemExit) as exit:
        recipe.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def file_tree(root: Path) -> dict:
    """Every file under ``root`` with its bytes: what must survive a refused or partial save."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
