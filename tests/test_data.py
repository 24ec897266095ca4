"""Text sources: how Hub datasets become documents."""

import datasets
import pytest

from hf_normswap import data


@pytest.mark.parametrize("rows, expected", [
    ([" = Title = ", "", " first line", " second line", ""], [" = Title = \n\n first line\n second line\n"]),
    (["one document", "another document", "   "], ["one document", "another document"]),
])
def test_hub_rows_are_documents_unless_the_dataset_stores_lines(monkeypatch, rows, expected):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"text": rows}))
    assert data.load_texts("someone/text:config:test", "evaluation") == expected
