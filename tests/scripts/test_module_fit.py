"""scripts/analyses/module_fit.py: every method fitted to every norm of a tiny model on the same captured activations."""

from __future__ import annotations

import json
import math

from file_modules import import_file
from tiny_models import tiny_model, tiny_tokenizer

from hf_normswap.modules import METHODS


def test_every_method_and_start_is_measured_on_every_norm(tmp_path):
    bench = import_file("scripts/analyses/module_fit.py")
    model_dir = tmp_path / "llama"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "fit.jsonl"
    assert bench.main(["--model", str(model_dir), "--data", "builtin", "--blocks", "2", "--block-len", "16",
                       "--max-iter", "5", "--paper", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["results"]) == {f"{m}/{s}" for m in METHODS for s in bench.STARTS}
    for result in record["results"].values():
        assert result["norms"] == 5  # two layers of two norms, and the final norm
        assert all(math.isfinite(result[k]) for k in ("rel_error_mean", "mean_abs_residual", "saturation_mean"))
        assert 0 <= result["saturation_mean"] <= 1
    # the paper's simulation: ELN follows LayerNorm's curve far more closely than the sigmoid-shaped functions
    assert record["paper"]["eln"]["mean"] < 0.2 * min(record["paper"]["dyt"]["mean"], record["paper"]["derf"]["mean"])
