"""The command line run in-process, as the fault tests read it: its exit code and its one error line."""

from __future__ import annotations

from hf_normswap import cli


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
