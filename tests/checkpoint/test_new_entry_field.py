"""A field of the per-norm entry is two files: a copy of the package whose ``checkpoint/record.py`` gains a field in
``NormEntry`` and whose ``convert.py`` fills it converts, saves it in ``config.json``, reads it back typed, keeps it
through a reload and a second save, and loads through the package and through the remote code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import hf_normswap

TESTS = Path(__file__).parent.parent
NAME = "model.layers.0.input_layernorm"

CONVERT = textwrap.dedent(f"""
    import json, sys
    from pathlib import Path
    import torch
    import hf_normswap
    from hf_normswap.checkpoint.record import ConversionRecord
    from tiny_models import tiny_model
    assert Path(hf_normswap.__file__).parent == Path(sys.argv[1]), hf_normswap.__file__
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln", calibration=None)
    out = Path(sys.argv[2])
    hf_normswap.save_pretrained(model, out / "first")
    reloaded = hf_normswap.load(out / "first")
    hf_normswap.save_pretrained(reloaded, out / "second")
    inputs = {{"input_ids": torch.arange(12).unsqueeze(0)}}
    torch.save(inputs, out / "inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        torch.save(logits, out / "logits.pt")
        same = torch.equal(logits, reloaded(**inputs).logits)
    print(json.dumps({{"memory": ConversionRecord.of(model).converted["{NAME}"].provenance,
                      "read": ConversionRecord.read(out / "second").converted["{NAME}"].provenance,
                      "reloaded": same}}))
""")

REMOTE = textwrap.dedent("""
    import sys
    sys.modules["hf_normswap"] = None  # remote code alone: no package, not even the copy
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(**torch.load(sys.argv[2])).logits, sys.argv[3])
""")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path.name} changed form: update this test's edit ({old!r})"
    path.write_text(text.replace(old, new))


def _run(args: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_field_added_to_the_entry_is_two_files(tmp_path):
    package = Path(hf_normswap.__file__).parent
    copy = tmp_path / "site" / "hf_normswap"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    _edit(copy / "checkpoint" / "record.py", "    method: str | None = None\n",
          "    method: str | None = None\n    provenance: str | None = None\n")
    _edit(copy / "convert.py", "amplitude=c.amplitude, bias=b)", "amplitude=c.amplitude, bias=b,\n"
          "                                   provenance=f\"{c.source_class} at {c.role}\")")
    changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.py")
                     if p.read_bytes() != (package / p.relative_to(copy)).read_bytes())
    assert changed == ["checkpoint/record.py", "convert.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(copy.parent), str(TESTS)]))
    seen = json.loads(_run(["-c", CONVERT, str(copy), str(tmp_path)], tmp_path, env).strip().splitlines()[-1])
    assert seen == {"memory": "LlamaRMSNorm at attention_input", "read": "LlamaRMSNorm at attention_input",
                    "reloaded": True}
    for saved in ("first", "second"):
        entry = json.loads((tmp_path / saved / "config.json").read_text())["normswap"]["converted"][NAME]
        assert entry["provenance"] == "LlamaRMSNorm at attention_input"
    assert "provenance: str | None = None" in (tmp_path / "second" / "modeling_normswap.py").read_text()
    _run(["-I", "-c", REMOTE, str(tmp_path / "second"), str(tmp_path / "inputs.pt"), str(tmp_path / "remote.pt")],
         tmp_path, env)
    assert torch.equal(torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "logits.pt"))
