"""Text sources: how Hub datasets become documents."""

import sys

import datasets
import pytest

from hf_normswap.data import load_texts
from hf_normswap.data import texts as data


@pytest.mark.parametrize("rows, expected", [
    ([" = Title = ", "", " first line", " second line", ""], [" = Title = \n\n first line\n second line\n"]),
    (["one document", "another document", "   "], ["one document", "another document"]),
])
def test_hub_rows_are_documents_unless_the_dataset_stores_lines(monkeypatch, rows, expected):
    monkeypatch.setattr(data, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"text": rows}))
    assert load_texts("someone/text:config:test", "evaluation") == expected


def test_an_unreachable_hub_fails_at_once_naming_the_offline_switch(monkeypatch):
    def retried(*args, **kwargs):
        raise AssertionError("load_dataset was called: its retries take half a minute offline")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", retried)
    with pytest.raises(data.DataError, match="unreachable.*HF_HUB_OFFLINE=1"):
        load_texts("someone/text:config:test", "evaluation")


def test_local_text_files_read_as_datasets_documents_without_datasets(tmp_path, monkeypatch):
    """One text per file, newlines as ``datasets``' text loader gives them, also where ``datasets`` is missing."""
    (tmp_path / "a.txt").write_bytes(b" = Title = \r\n\r\n first line\n second line\n")
    (tmp_path / "b.txt").write_text("another document")
    (tmp_path / "blank.txt").write_text("  \n")
    theirs = datasets.load_dataset("text", data_files=[str(tmp_path / n) for n in ("a.txt", "b.txt", "blank.txt")],
                                   split="train", sample_by="document", cache_dir=str(tmp_path / "cache"))
    expected = [t for t in theirs["text"] if t.strip()]
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    assert load_texts(str(tmp_path / "a.txt"), "calibration") + load_texts(
        str(tmp_path / "b.txt"), "calibration") == expected == [" = Title = \n\n first line\n second line\n",
                                                                  "another document"]
