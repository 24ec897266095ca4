"""Every script under scripts/ starts and shows its usage (``--help``), and the flags they share (threads, output,
models, device) come from the one harness: the same spelling and help text in every script that takes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(path for folder in ("benchmarks", "analyses", "evaluation", "jobs")
                  for path in (ROOT / "scripts" / folder).glob("*.py") if path.name != "paper_draw.py")
HARNESS_HELP = {"--threads": "CPU threads, here and in the processes started", "--model": "a Hub id, a local folder",
                "--device": "cpu, cuda"}

# one interpreter for all: each script run as Python runs it (its folder first on sys.path) with --help; torch and
# the package load once
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
shown = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0], out = [path, "--help"], os.path.dirname(path), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = None
        except SystemExit as exit:
            code = exit.code
        except Exception as error:  # reported with the script's name
            code = repr(error)
    shown[path] = [code, out.getvalue()]
print(json.dumps(shown))
"""


def test_every_script_shows_its_usage_with_the_harness_flags(tmp_path):
    assert len(PROGRAMS) >= 20
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, PROGRAMS)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    for path, (code, text) in shown.items():
        name = Path(path).relative_to(ROOT)
        assert code == 0 and text.startswith("usage:"), (str(name), code, text[-1500:])
        flat = " ".join(text.split())
        for flag, help_text in HARNESS_HELP.items():
            if f" {flag} " in flat.split("options:", 1)[-1]:
                assert help_text in flat, (str(name), flag)
