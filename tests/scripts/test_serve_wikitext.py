"""scripts/evaluation/serve_wikitext.py: WikiText raw text split into articles as the Hub's document-level dataset has them."""

from __future__ import annotations

from file_modules import import_file

RAW = " = First = \n\n A line .\n\n = = Section = = \n\n More @-@ text .\n\n = Second = \n\n Other .\n"


def test_articles_start_at_top_level_headings_and_keep_every_line(tmp_path):
    serve = import_file("scripts/evaluation/serve_wikitext.py")
    path = tmp_path / "wiki.test.raw"
    path.write_text(RAW)
    pages = serve.articles(path)
    assert pages == [" = First = \n\n A line .\n\n = = Section = = \n\n More @-@ text .\n\n", " = Second = \n\n Other .\n"]
    assert "".join(pages) == RAW
