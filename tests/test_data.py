"""Text sources: how Hub datasets become documents."""

import datasets
import pytest

import hf_normswap.data
from hf_normswap import data


@pytest.mark.parametrize("rows, expected", [
    ([" = Title = ", "", " first line", " second line", ""], [" = Title = \n\n first line\n second line\n"]),
    (["one document", "another document", "   "], ["one document", "another document"]),
])
def test_hub_rows_are_documents_unless_the_dataset_stores_lines(monkeypatch, rows, expected):
    monkeypatch.setattr(hf_normswap.data, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"text": rows}))
    assert data.load_texts("someone/text:config:test", "evaluation") == expected


def test_an_unreachable_hub_fails_at_once_naming_the_offline_switch(monkeypatch):
    def retried(*args, **kwargs):
        raise AssertionError("load_dataset was called: its retries take half a minute offline")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_normswap.data, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", retried)
    with pytest.raises(data.DataError, match="unreachable.*HF_HUB_OFFLINE=1"):
        data.load_texts("someone/text:config:test", "evaluation")
