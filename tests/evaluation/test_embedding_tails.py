"""The tails of an encoder's agreement: by hand on made-up embeddings, 1 for a model against itself, and in the CLI."""

import copy
import json

import numpy as np
import pytest
import torch

from hf_normswap import convert
from hf_normswap.cli import main
from hf_normswap.evaluation.embedding_tails import embedding_tails
from hf_normswap.evaluation.embeddings import evaluate_embeddings
from test_perplexity import SENTENCES, word_tokenizer
from tiny_models import tiny_model


def test_tails_equal_a_computation_by_hand():
    angles = torch.tensor([0.0, 0.3, 1.2, 0.1, 2.0, 0.6, 0.05])
    reference = torch.stack([torch.ones_like(angles), torch.zeros_like(angles)], -1)
    converted = torch.stack([angles.cos(), angles.sin()], -1)
    lengths = torch.tensor([5, 20, 20, 40, 300, 15, 100])
    found = embedding_tails(reference, converted, [f"sentence {i}" for i in range(7)], lengths)
    cosine = angles.double().cos().numpy()
    assert found.cosine["mean"] == pytest.approx(cosine.mean())
    assert found.cosine["p10"] == pytest.approx(np.percentile(cosine, 10))
    assert found.cosine["p0_1"] == pytest.approx(np.percentile(cosine, 0.1))
    assert found.cosine["min"] == pytest.approx(np.cos(2.0))
    assert [s.text for s in found.worst] == ["sentence 4", "sentence 2", "sentence 5", "sentence 1", "sentence 3"]
    assert found.worst[0].tokens == 300
    ranges = {(r["start"], r["end"]): (r["sentences"], r["cosine"]) for r in found.by_length}
    assert set(ranges) == {(0, 16), (16, 32), (32, 64), (64, 128), (256, 300)}  # empty ranges left out, last open
    assert ranges[(16, 32)] == (2, pytest.approx((np.cos(0.3) + np.cos(1.2)) / 2))
    assert ranges[(0, 16)] == (2, pytest.approx((1 + np.cos(0.6)) / 2))


def test_a_model_against_itself_has_every_sentence_at_1_and_a_conversion_strays():
    original, tokenizer = tiny_model("bert"), word_tokenizer()
    same = evaluate_embeddings(copy.deepcopy(original), original, tokenizer, [SENTENCES]).tails
    assert same.cosine["min"] == pytest.approx(1.0, abs=1e-6)
    assert sum(r["sentences"] for r in same.by_length) == 5
    converted = copy.deepcopy(original)
    convert(converted, to="dyt", input_scale=30.0)
    drift = evaluate_embeddings(converted, original, tokenizer, [SENTENCES])
    assert drift.tails.cosine["min"] < 0.999
    assert drift.tails.cosine["mean"] == pytest.approx(drift.results["converted"]["cosine"], abs=1e-5)
    assert drift.tails.worst[0].cosine == pytest.approx(drift.tails.cosine["min"])


def test_cli_prints_the_tails_of_an_encoder_and_drops_them_with_no_tails(tmp_path, capsys):
    model, tokenizer = tiny_model("bert"), word_tokenizer()
    model.save_pretrained(tmp_path / "encoder")
    tokenizer.save_pretrained(tmp_path / "encoder")
    data = tmp_path / "sentences.txt"
    data.write_text(SENTENCES)
    args = ["eval", str(tmp_path / "encoder"), "--against", str(tmp_path / "encoder"), "--data", str(data)]
    assert main(args) == 0
    assert "| per-sentence cosine |" in capsys.readouterr().out
    assert main([*args, "--no-tails"]) == 0
    assert "per-sentence cosine" not in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    tails = json.loads(capsys.readouterr().out)["tails"]
    assert tails["cosine"]["min"] == pytest.approx(1.0, abs=1e-6) and len(tails["worst"]) == 5
