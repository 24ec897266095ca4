"""scripts/analyses/attention_agreement.py: attention distance by position and induction scores."""

from __future__ import annotations

import json

import pytest
import torch

import hf_normswap
from file_modules import import_file
from test_position_error import saved_original_and_dyt
from tiny_models import tiny_model, tiny_tokenizer


def test_induction_score_reads_the_key_after_the_earlier_occurrence():
    bench = import_file("scripts/analyses/attention_agreement.py")
    length, period = 12, 4
    rows = torch.zeros(2, length, length)
    for i in range(period, length):
        rows[0, i, i - period + 1] = 1.0  # head 0 copies
        rows[1, i, 0] = 1.0  # head 1 attends to the first token
    assert bench.induction_scores([rows], period, 1) == [[1.0, 0.0]]
    assert bench.induction_scores([rows[:, ::2]], period, 2) == [[1.0, 0.0]]  # every second query kept
    assert bench.repeated(torch.arange(10), 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_a_model_against_itself_has_distance_0_and_the_same_induction(tmp_path):
    bench = import_file("scripts/analyses/attention_agreement.py")
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln", calibration=None)
    hf_normswap.save_pretrained(model, tmp_path / "eln", tokenizer=tiny_tokenizer())
    out = tmp_path / "attention.jsonl"
    assert bench.main([str(tmp_path / "eln"), "--against", str(tmp_path / "eln"), "--data", "builtin",
                       "--block-len", "200", "--period", "50", "--query-stride", "3", "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["ranges"] == [[1, 128], [128, 200]]
    assert all(d == 0 for layer in found["distance"] for head in layer for d in head)
    assert found["induction"]["original"] == found["induction"]["converted"]


def test_the_distance_is_measured_against_the_original(tmp_path):
    bench = import_file("scripts/analyses/attention_agreement.py")
    saved_original_and_dyt(tmp_path)
    out = tmp_path / "attention.jsonl"
    assert bench.main([str(tmp_path / "dyt"), "--against", str(tmp_path / "llama"), "--data", "builtin",
                       "--block-len", "140", "--period", "40", "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    assert all(0 < d <= 1 for layer in found["distance"] for head in layer for d in head)
    assert found["induction"]["original"] != found["induction"]["converted"]
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "dyt"), "--against", str(tmp_path / "llama"), "--block-len", "140",
                    "--period", "140"])


def test_restoring_every_converted_norm_gives_back_the_original(tmp_path):
    bench = import_file("scripts/analyses/attention_agreement.py")
    saved_original_and_dyt(tmp_path)
    out = tmp_path / "attention.jsonl"
    common = [str(tmp_path / "dyt"), "--against", str(tmp_path / "llama"), "--data", "builtin",
              "--block-len", "140", "--period", "40", "--out", str(out)]
    assert bench.main([*common, "--restore", "attention_input", "mlp_input", "final"]) == 0
    assert bench.main([*common, "--restore", "attention_input"]) == 0
    assert bench.main([*common, "--restore", "attention_input", "mlp_input", "final", "--restore-first"]) == 0
    every, attention_only, first = (json.loads(line) for line in out.read_text().splitlines())
    assert first["first_only"] and not every["first_only"]
    assert max(d for layer in first["distance"] for head in layer for d in head) > 1e-4  # the rest converted
    assert every["restored"] == ["attention_input", "mlp_input", "final"]
    assert all(d < 1e-6 for layer in every["distance"] for head in layer for d in head)
    assert torch.allclose(torch.tensor(every["induction"]["original"]),
                          torch.tensor(every["induction"]["converted"]), atol=1e-6)
    assert max(d for layer in attention_only["distance"][1:] for head in layer for d in head) > 1e-4  # the MLPs'
    assert max(d for head in attention_only["distance"][0] for d in head) < 1e-6  # the first layer's input: the same
    with pytest.raises(SystemExit, match="no converted norm has that role"):
        bench.main([*common, "--restore", "qk_norm"])
    with pytest.raises(SystemExit):
        bench.main([*common, "--restore-first"])


def test_the_first_position_alone_comes_from_the_original_norm():
    bench = import_file("scripts/analyses/attention_agreement.py")
    norm = torch.nn.RMSNorm(8)
    converted = hf_normswap.DyT(8, 0.5)
    x = torch.randn(2, 5, 8) * 30
    out = bench.FirstFromOriginal(converted, norm)(x)
    assert torch.equal(out[:, :1], norm(x[:, :1]))
    assert torch.equal(out[:, 1:], converted(x)[:, 1:])
