"""A data source is one class: a copy of the package whose ``data/sources.py`` alone gains a registered class reads
that source wherever a spec is taken (documents, the CLI's check, calibration's batches, the recipe's checks and
training rows, the overlap checks), and the sources that were there read as before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import hf_normswap

TESTS = Path(__file__).parent

REPEAT = '''

@register
class Repeat(Source):
    """``repeat:N:TEXT``: TEXT written N times, one document: a source that only this test's copy has."""

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec.startswith("repeat:")

    def texts(self, default_split="calibration", **_):
        _, count, text = self.spec.split(":", 2)
        if not count.isdigit():
            raise texts.DataError(f"repeat: {count!r} is not a count; write repeat:N:TEXT")
        return [" ".join([text] * int(count))]

'''

USE = textwrap.dedent("""
    import json, sys, types
    from pathlib import Path
    import hf_normswap
    from hf_normswap.data import DataError, check_spec, load_texts, model_batches, same_sample
    from hf_normswap.data.sources import source
    from hf_normswap.training import recipe_data, recipe_settings
    from tiny_models import tiny_model, tiny_tokenizer
    assert Path(hf_normswap.__file__).parent == Path(sys.argv[1]), hf_normswap.__file__
    spec = "repeat:400:the model of the norm and the data"
    tokenizer, model = tiny_tokenizer(), tiny_model("llama")
    documents = load_texts(spec)
    batches, fingerprint = model_batches(model, spec, tokenizer, num_blocks=4, block_len=16, batch_size=2)
    try:
        load_texts("repeat:many:words")
        bad = None
    except DataError as error:
        bad = str(error)
    config = recipe_settings.load_config([f"train_data={spec}", "eval_data=builtin:evaluation", "block_len=16",
                                          f"output_dir={sys.argv[2]}"])
    recipe_data.check_data(config, calibrates=False)
    state = types.SimpleNamespace(process_index=0, num_processes=1)
    rows = recipe_data.training_stream(spec, None, config.block_len, config.seed, tokenizer, None, state)["input_ids"]
    print(json.dumps({"kind": type(source(spec)).__name__, "documents": documents, "check": check_spec(spec),
                      "batches": [list(b["input_ids"].shape) for b in batches], "fingerprint": fingerprint,
                      "bad": bad, "rows": len(rows), "same": same_sample(spec, spec),
                      "others": [type(source(s)).__name__ for s in ("builtin", "generated", sys.argv[3], "a/b")]}))
""")


def test_a_source_added_in_sources_py_alone_is_read_wherever_a_spec_is_taken(tmp_path):
    copy = tmp_path / "site" / "hf_normswap"
    shutil.copytree(Path(hf_normswap.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    sources = copy / "data" / "sources.py"
    text = sources.read_text()
    anchor = "\nclass LocalFiles(Source):"
    assert text.count(anchor) == 1, "data/sources.py changed form: update this test's edit"
    sources.write_text(text.replace(anchor, REPEAT + anchor))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(copy.parent), str(TESTS)]))
    local = tmp_path / "local.txt"
    local.write_text("a local file\n")
    result = subprocess.run([sys.executable, "-c", USE, str(copy), str(tmp_path / "run"), str(local)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["kind"] == "Repeat" and seen["documents"] == [" ".join(["the model of the norm and the data"] * 400)]
    assert seen["check"] is None and seen["batches"] == [[2, 16], [2, 16]] and seen["fingerprint"]
    assert "repeat: 'many' is not a count" in seen["bad"]
    assert seen["rows"] > 10 and not seen["same"]
    assert seen["others"] == ["Builtin", "Generated", "LocalFiles", "HubDataset"]
