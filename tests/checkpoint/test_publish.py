"""Where a finished model goes (``checkpoint.publish``), for convert and recover alike: saved, or kept in a
temporary directory that the one-line error names; and checked to reload with identical logits."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

import hf_normswap
from hf_normswap.checkpoint.directory import CheckpointError
from hf_normswap.checkpoint.publish import probe_logits, reloads_identically, save_or_keep


@pytest.fixture
def converted():
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln", calibration=None)
    return model, tiny_tokenizer()


def test_a_saved_model_reloads_identically_and_a_changed_one_does_not(converted, tmp_path):
    model, tokenizer = converted
    expected = probe_logits(model, tokenizer)
    save = functools.partial(hf_normswap.save_pretrained, model, tokenizer=tokenizer)
    assert save_or_keep(save, tmp_path / "out", overwrite=False) == tmp_path / "out"
    assert reloads_identically(expected, tmp_path / "out", tokenizer)
    assert not reloads_identically(expected + 1e-3, tmp_path / "out", tokenizer)


def test_a_failed_save_keeps_the_model_and_names_where(converted, tmp_path):
    model, tokenizer = converted

    def save(directory, **options):
        if Path(directory) == tmp_path / "out":
            raise OSError(28, "No space left on device")
        return hf_normswap.save_pretrained(model, directory, tokenizer=tokenizer, **options)

    with pytest.raises(CheckpointError) as refused:
        save_or_keep(save, tmp_path / "out", overwrite=True, what="trained model")
    line = str(refused.value)
    assert line.startswith(f"cannot save to {tmp_path / 'out'} (") and "the trained model is kept in " in line
    kept = Path(line.split("kept in ")[1].split(": move")[0])
    assert torch.equal(probe_logits(hf_normswap.load(kept), tokenizer), probe_logits(model, tokenizer))
    shutil.rmtree(kept.parent)
