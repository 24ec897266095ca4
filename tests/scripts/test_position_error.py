"""scripts/analyses/position_error.py: the converted model's hidden-state error and residual scale by position."""

from __future__ import annotations

import json

import hf_normswap
from file_modules import import_file
from tiny_models import tiny_model, tiny_tokenizer


def test_a_model_against_itself_has_no_error_and_ratio_1_at_every_range(tmp_path):
    bench = import_file("scripts/analyses/position_error.py")
    assert bench.ranges(2048) == [(1, 128), (128, 512), (512, 1024), (1024, 2048)]
    assert bench.ranges(300) == [(1, 128), (128, 300)]
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln", calibration=None)
    hf_normswap.save_pretrained(model, tmp_path / "eln", tokenizer=tiny_tokenizer())
    out = tmp_path / "positions.jsonl"
    assert bench.main([str(tmp_path / "eln"), "--against", str(tmp_path / "eln"), "--data", "builtin",
                       "--blocks", "1", "--block-len", "200", "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["ranges"] == [[1, 128], [128, 200]] and found["ratio"] == [1.0, 1.0]
    assert all(e == 0 for row in found["layers"] for e in row["error"])
    assert all(row["rms"] == row["rms_original"] for row in found["layers"])
    assert len(found["saturation"]) == 5


def saved_original_and_dyt(tmp_path) -> None:
    """A tiny Llama in ``tmp_path/llama`` and its DyT conversion (no calibration) in ``tmp_path/dyt``."""
    original = tiny_model("llama")
    original.save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    model = tiny_model("llama")
    hf_normswap.convert(model, to="dyt", calibration=None, input_scale=1.0)
    hf_normswap.save_pretrained(model, tmp_path / "dyt", tokenizer=tiny_tokenizer())


def test_the_error_is_measured_against_the_original(tmp_path):
    bench = import_file("scripts/analyses/position_error.py")
    saved_original_and_dyt(tmp_path)
    out = tmp_path / "positions.jsonl"
    assert bench.main([str(tmp_path / "dyt"), "--against", str(tmp_path / "llama"), "--data", "builtin",
                       "--blocks", "1", "--block-len", "140", "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["layers"][0]["error"] == [0.0, 0.0]  # the embeddings, before any norm
    assert all(e > 0 for e in found["layers"][-1]["error"]) and found["ratio"] != [1.0, 1.0]
