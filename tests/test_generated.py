"""The original's own samples as a text source: cached, resumed without repeats, split between processes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from hf_normswap.data import DataError, load_texts
from hf_normswap.generated import SampleCache, SamplingSettings, sample_texts

SETTINGS = SamplingSettings(length=12, batch_size=3, seed=1)
BUDGET = 12 * 3 * 3  # three batches


def _counting(model, calls: list):
    """``model`` with its generate calls recorded in ``calls``."""
    generate = model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape) or generate(**kw)
    return model


@pytest.fixture()
def counted():
    calls = []
    return _counting(tiny_model("llama"), calls), calls


def test_a_second_call_reads_the_cache_without_sampling(counted, tmp_path):
    model, calls = counted
    tokenizer = tiny_tokenizer()
    first = sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False)
    assert len(calls) == 3 and len(first) == 9 and len(set(first)) == 9
    assert sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False) == first
    assert len(calls) == 3
    assert len(list(tmp_path.rglob("batch-*.safetensors"))) == 3 and not list(tmp_path.rglob("*.partial*"))


def test_a_changed_setting_or_model_makes_a_new_cache(tmp_path):
    model = tiny_model("llama")
    caches = {SampleCache(model, SETTINGS, tmp_path).directory,
              SampleCache(model, SamplingSettings(length=12, batch_size=3, seed=1, temperature=0.5), tmp_path).directory,
              SampleCache(tiny_model("llama", seed=1), SETTINGS, tmp_path).directory}
    assert len(caches) == 3


def test_an_interrupted_draw_resumes_where_it_stopped_and_repeats_nothing(counted, tmp_path):
    model, calls = counted
    tokenizer = tiny_tokenizer()
    part = sample_texts(model, tokenizer, SETTINGS, 12 * 3, cache_dir=tmp_path, progress=False)  # one batch
    whole = sample_texts(model, tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path, progress=False)
    assert len(calls) == 3 and whole[:3] == part and len(set(whole)) == 9  # only the two missing batches drawn
    fresh = sample_texts(tiny_model("llama"), tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path / "fresh",
                         progress=False)
    assert fresh == whole  # each batch has its own seed: launches and processes do not change the text


def test_two_processes_draw_different_shares_of_one_text(tmp_path):
    """Rank 0 of 2 draws batches 0 and 2 and finds batch 1 missing; rank 1 draws only batch 1, then both read the
    same text, the text one process alone would have drawn."""
    tokenizer = tiny_tokenizer()
    first, second = [], []
    with pytest.raises(ValueError, match="1 of 3 batches .* were not drawn by the other processes"):
        sample_texts(_counting(tiny_model("llama"), first), tokenizer, SETTINGS, BUDGET, rank=0, world_size=2,
                     cache_dir=tmp_path, progress=False, wait_seconds=0)
    texts = sample_texts(_counting(tiny_model("llama"), second), tokenizer, SETTINGS, BUDGET, rank=1, world_size=2,
                         cache_dir=tmp_path, progress=False)
    assert (len(first), len(second)) == (2, 1)
    alone = sample_texts(tiny_model("llama"), tokenizer, SETTINGS, BUDGET, cache_dir=tmp_path / "one", progress=False)
    assert texts == alone and len(set(texts)) == 9


@pytest.mark.parametrize("spec, message", [
    ("generated:temperature=0", "temperature must be above 0"),
    ("generated:top_p=0", "top_p must be in (0, 1]"),
    ("generated:top_p=1.5", "top_p must be in (0, 1]"),
    ("generated:length=0", "length must be a whole number of at least 1"),
    ("generated:tempreature=1", "is not one of temperature=..."),
    ("generated:length=abc", "length='abc' is not a int"),
    ("generated:length=65", "beyond the model's context of 64 tokens"),
])
def test_bad_settings_are_one_line(spec, message):
    with pytest.raises(DataError) as error:
        load_texts(spec, model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_tokens=64)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_without_a_language_model_head_or_no_model_is_refused():
    import transformers
    from tiny_models import tiny_config

    encoder = transformers.BertModel(tiny_config("bert"))
    with pytest.raises(DataError, match="needs a model with a language-model head"):
        load_texts("generated", model=encoder, tokenizer=tiny_tokenizer(), max_tokens=64)
    with pytest.raises(DataError, match="sampled from the original model"):
        load_texts("generated", tokenizer=tiny_tokenizer(), max_tokens=64)


def test_calibration_reads_the_originals_samples(tmp_path, monkeypatch):
    import hf_normswap
    from hf_normswap import CalibrationConfig

    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path))
    model = tiny_model("llama")
    config = CalibrationConfig(data="generated:length=16,batch_size=4", tokenizer=tiny_tokenizer(), num_blocks=4,
                               block_len=16, strategy="fast", progress=False)
    report = hf_normswap.convert(model, "eln", calibration=config)
    assert report.calibration["data"] == "generated:length=16,batch_size=4"
    assert report.calibration["tokens"] == 4 * 16  # 4 blocks of 16 (batches that ended early were topped up)
    drawn = sorted(tmp_path.rglob("batch-*.safetensors"))
    assert drawn and torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9]])).logits).all()
    hf_normswap.convert(tiny_model("llama"), "eln", calibration=config)  # another conversion reads the same samples
    assert sorted(tmp_path.rglob("batch-*.safetensors")) == drawn
