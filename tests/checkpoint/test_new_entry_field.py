"""A field of the per-norm entry is two files: a copy of the package whose ``checkpoint/record.py`` gains a field in
``NormEntry`` and whose ``surgery.py`` fills it converts, saves it in ``config.json``, reads it back typed, keeps it
through a reload and a second save, and loads through the package and through the remote code."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from package_copy import PACKAGE, REMOTE, copy_package, run_python

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

def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path.name} changed form: update this test's edit ({old!r})"
    path.write_text(text.replace(old, new))


def test_a_field_added_to_the_entry_is_two_files(tmp_path):
    copy, env = copy_package(tmp_path)
    _edit(copy / "checkpoint" / "record.py", "    method: str | None = None\n",
          "    method: str | None = None\n    provenance: str | None = None\n")
    _edit(copy / "surgery.py", "amplitude=c.amplitude, bias=b)", "amplitude=c.amplitude, bias=b,\n"
          "                                   provenance=f\"{c.source_class} at {c.role}\")")
    changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.py")
                     if p.read_bytes() != (PACKAGE / p.relative_to(copy)).read_bytes())
    assert changed == ["checkpoint/record.py", "surgery.py"]
    seen = json.loads(run_python(["-c", CONVERT, str(copy), str(tmp_path)], tmp_path, env).strip().splitlines()[-1])
    assert seen == {"memory": "LlamaRMSNorm at attention_input", "read": "LlamaRMSNorm at attention_input",
                    "reloaded": True}
    for saved in ("first", "second"):
        entry = json.loads((tmp_path / saved / "config.json").read_text())["normswap"]["converted"][NAME]
        assert entry["provenance"] == "LlamaRMSNorm at attention_input"
    assert "provenance: str | None = None" in (tmp_path / "second" / "modeling_normswap.py").read_text()
    run_python(["-I", "-c", REMOTE, str(tmp_path / "second"), str(tmp_path / "inputs.pt"), str(tmp_path / "remote.pt")],
         tmp_path, env)
    assert torch.equal(torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "logits.pt"))
