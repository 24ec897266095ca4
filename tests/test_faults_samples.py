"""Fault injection on the original's samples: their cache on disk, where it lives, and the prompts they start from.

A damaged or foreign batch is named in one line and drawn again (or refused), never read as samples or left to
fail every later run; a cache that cannot be written is one line naming HF_NORMSWAP_CACHE. Tiny models only.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hf_normswap.data import packed_linear
from hf_normswap.data import DataError, load_texts
from tiny_models import full_length_tokenizer, tiny_model

SPEC = "generated:length=8,batch_size=2,seed=1,precision=fp32"
TOKENS = 8 * 2  # one batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def unpacked(monkeypatch):
    """Packing is timed, and packed matmuls round differently: a batch drawn again must give the same rows."""
    monkeypatch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: 1.0)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), full_length_tokenizer()


@pytest.fixture(scope="module")
def drawn(llama, tmp_path_factory):
    """A cache holding the one batch of SPEC, and its texts: each case damages a copy."""
    folder = tmp_path_factory.mktemp("drawn")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: 1.0)
        patch.setenv("HF_NORMSWAP_CACHE", str(folder / "cache"))
        return folder / "cache", _samples(llama)


def _samples(llama, spec: str = SPEC) -> list[str]:
    model, tokenizer = llama
    return load_texts(spec, model=model, tokenizer=tokenizer, max_tokens=TOKENS)


def _ids(**changes) -> dict:
    return {"input_ids": torch.randint(0, 128, (2, 8), dtype=torch.int32), "lengths": torch.full((2,), 8,
                                                                                                 dtype=torch.int32),
            **changes}


def _damage(batch, case: str) -> None:
    if case == "truncated":
        batch.write_bytes(batch.read_bytes()[: batch.stat().st_size // 2])
    elif case == "empty":
        batch.write_bytes(b"")
    elif case == "garbage":
        batch.write_bytes(random.Random(52).randbytes(512))
    elif case == "symlink":
        foreign = batch.parent.parent / "foreign.safetensors"
        save_file(_ids(), foreign)
        batch.unlink()
        batch.symlink_to(foreign)
    else:
        tensors = {"negative ids": _ids(input_ids=-torch.ones(2, 8, dtype=torch.int32)),
                   "float ids": _ids(input_ids=torch.rand(2, 8)),
                   "3-D ids": _ids(input_ids=torch.zeros(2, 8, 2, dtype=torch.int32)),
                   "no lengths": {"input_ids": _ids()["input_ids"]},
                   "ids past the vocabulary": _ids(input_ids=torch.full((2, 8), 500, dtype=torch.int32)),
                   "lengths past the rows": _ids(lengths=torch.full((2,), 99, dtype=torch.int32)),
                   "zero lengths": _ids(lengths=torch.zeros(2, dtype=torch.int32))}[case]
        save_file({k: v.contiguous() for k, v in tensors.items()}, batch)


DAMAGE = ["truncated", "empty", "garbage", "symlink", "negative ids", "float ids", "3-D ids", "no lengths",
          "ids past the vocabulary", "lengths past the rows", "zero lengths"]


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_or_foreign_batch_is_named_and_drawn_again(llama, drawn, tmp_path, monkeypatch, capsys, case):
    """Each was a traceback on every run until the file was deleted, or (a link, ids past the vocabulary, lengths
    past the rows) read silently as samples."""
    shutil.copytree(drawn[0], tmp_path / "cache")
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    first = drawn[1]
    [batch] = (tmp_path / "cache").rglob("batch-*.safetensors")
    _damage(batch, case)
    capsys.readouterr()
    assert _samples(llama) == first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(batch) in err[0] and "drawing it again" in err[0], err
    assert not batch.is_symlink() and _samples(llama) == first and capsys.readouterr().err == ""
    assert [p.name for p in batch.parent.iterdir() if "partial" in p.name] == []
    if case == "symlink":
        assert (batch.parent.parent / "foreign.safetensors").is_file()  # the link's target is left as it was


def test_a_directory_at_a_batch_path_is_refused_and_leaves_nothing(llama, drawn, tmp_path, monkeypatch):
    shutil.copytree(drawn[0], tmp_path / "cache")
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    [batch] = (tmp_path / "cache").rglob("batch-*.safetensors")
    batch.unlink()
    batch.mkdir()
    for _ in range(2):
        with pytest.raises(DataError, match=f"{batch} is a directory, not a batch of samples: move it away"):
            _samples(llama)
    assert sorted(p.name for p in batch.parent.iterdir()) == [batch.name, "settings.json"]


@pytest.mark.parametrize("case", ["a file", "read-only", "full"])
def test_a_cache_that_cannot_be_written_is_one_line_naming_its_setting(llama, tmp_path, monkeypatch, case):
    if case == "a file":
        (tmp_path / "cache").write_text("mine")
    elif case == "read-only":
        (tmp_path / "cache").mkdir(mode=0o555)
        if os.access(tmp_path / "cache", os.W_OK):
            pytest.skip("root writes anywhere")
    else:
        from hf_normswap.data import sample_cache

        def full(tensors, filename, **kwargs):
            open(filename, "wb").write(b"\0" * 10)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(sample_cache, "save_file", full)
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError) as error:
        _samples(llama)
    message = str(error.value)
    assert "cannot write the sample cache" in message and "HF_NORMSWAP_CACHE" in message and "\n" not in message
    if case == "full":
        assert "No space left on device" in message
        assert not [p for p in (tmp_path / "cache").rglob("*") if "partial" in p.name or p.name.startswith("batch")]
    if case == "a file":
        assert (tmp_path / "cache").read_text() == "mine"


# ------------------------------------------------------------------------------------------------ the prompts

PROMPTED = "generated:length=12,batch_size=2,seed=1,precision=fp32,prompt=p.txt"


def test_a_prompt_file_of_other_content_draws_other_samples(llama, tmp_path, monkeypatch):
    """prompt=p.txt run from two folders whose p.txt differ: the second run read the first one's samples (the key
    held the spec, not the prompt's content)."""
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    drawn = []
    for folder, text in (("a", "ABCDEFGHIJ the model\n"), ("b", "KLMNOPQRST the data\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.txt").write_text(text * 4)
        monkeypatch.chdir(tmp_path / folder)
        drawn.append(_samples(llama, PROMPTED))
    assert drawn[0] != drawn[1]
    assert [text[:8] for text in drawn[1]] == ["KLMNOPQR"] * 2
    assert len(list((tmp_path / "cache").rglob("batch-*.safetensors"))) == 2


def test_one_long_prompt_document_gives_many_starts_tokenized_once(llama, tmp_path, monkeypatch):
    """One 32 MB document: every row of every batch started with its same 8 tokens, and the whole source was
    tokenized again for each batch (125 s, 6.6 GB). Each line now starts a row, and lines are tokenized as far as
    the rows drawn reach."""
    model, tokenizer = llama
    lines = [f"{'the model' if i % 2 else 'norm data'} {i:04d} of the text in the norm and the data\n"
             for i in range(2000)]
    (tmp_path / "p.txt").write_text("".join(lines))
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    tokenized = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **kw: tokenized.append(
        sum(map(len, text)) if isinstance(text, list) else len(text)) or real(self, text, **kw))
    texts = load_texts(PROMPTED, model=model, tokenizer=tokenizer, max_tokens=12 * 2 * 3)
    assert [text[:14] for text in texts] == [line[:14] for line in lines[:6]]  # a line a row, in turn
    assert sum(tokenized) < len("".join(lines)) // 4
