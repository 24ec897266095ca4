"""A copy of the package that a test edits (a new method, a new field of the record), and Python run on it in a
fresh process: what a contributor's change would be, checked end to end without touching the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import hf_normswap

TESTS = Path(__file__).parent
PACKAGE = Path(hf_normswap.__file__).parent

# the checkpoint loaded by its remote code alone: logits of the inputs in argv[2] saved to argv[3]
REMOTE = textwrap.dedent("""
    import sys
    sys.modules["hf_normswap"] = None  # remote code alone: no package, not even the copy
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(**torch.load(sys.argv[2])).logits, sys.argv[3])
""")


def copy_package(tmp_path: Path) -> tuple[Path, dict]:
    """(the copy's folder, the environment a process needs to import it and the tests' helpers, offline)."""
    copy = tmp_path / "site" / "hf_normswap"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(copy.parent), str(TESTS)]))
    return copy, env


def run_python(args: list[str], cwd: Path, env: dict) -> str:
    """stdout of ``python ARGS``, which must succeed."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
