"""The original's samples and local text files as training streams: the blocks of the text read whole, drawn or
read only as far as the stream is taken, each process drawing its own batches."""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
from tiny_models import full_length_tokenizer, tiny_model, tiny_tokenizer

from hf_normswap.data import load_texts, packed_linear, streaming, token_blocks
from hf_normswap.data.generated import SamplingSettings, sample_texts
from hf_normswap.data.sample_stream import sample_stream

SETTINGS = SamplingSettings(length=12, batch_size=3, seed=1, precision="fp32")
BLOCK = 8


@pytest.fixture(autouse=True)
def unpacked(monkeypatch, tmp_path):
    """Packing is timed and rounds differently (as in test_generated); the cache in the test's folder."""
    monkeypatch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: 1.0)
    monkeypatch.setenv("HF_NORMSWAP_CACHE", str(tmp_path / "cache"))


def counted(model, calls: list):
    generate = model.generate
    model.generate = lambda **kw: calls.append(1) or generate(**kw)
    return model


def take(stream, count: int) -> list[list[int]]:
    return [row["input_ids"] for row in itertools.islice(iter(stream), count)]


def test_the_stream_is_the_blocks_of_the_samples_read_whole_and_draws_only_what_is_taken(tmp_path):
    tokenizer, calls = full_length_tokenizer(), []
    model = counted(tiny_model("llama"), calls)
    streamed = take(sample_stream(model, tokenizer, SETTINGS, BLOCK, progress=False), 4)
    assert len(calls) == 1  # 4 blocks of 8 tokens: one batch of 3 x 12 sampled tokens is enough
    later = take(sample_stream(model, tokenizer, SETTINGS, BLOCK, progress=False), 12)
    assert later[:4] == streamed and len(calls) == 3  # the first batch read again from the cache
    whole = sample_texts(model, tokenizer, SETTINGS, 3 * 3 * 12, progress=False)  # the same three batches
    assert later == token_blocks(tokenizer, whole, 12, BLOCK).tolist() and len(calls) == 3


def test_each_process_draws_its_own_batches_and_reads_the_same_stream(tmp_path):
    tokenizer, calls = full_length_tokenizer(), [[], []]
    models = [counted(tiny_model("llama"), calls[0]), counted(copy.deepcopy(tiny_model("llama")), calls[1])]
    found = [None, None]

    def run(rank):
        stream = sample_stream(models[rank], tokenizer, SETTINGS, BLOCK, rank=rank, world_size=2, progress=False)
        found[rank] = take(stream, 16)  # 128 tokens: four batches of 36

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert found[0] == found[1] and len(found[0]) == 16
    drawn = len(list((tmp_path / "cache").rglob("batch-*.safetensors")))
    assert len(calls[0]) + len(calls[1]) == drawn and len(calls[0]) - len(calls[1]) in (0, 1)  # even, odd batches


def test_a_local_text_file_streams_the_blocks_it_gives_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "PIECE_CHARS", 30)  # many pieces, cut at paragraphs
    tokenizer = tiny_tokenizer()
    paragraphs = ["the model of the norm\nand the data\n", "in the text of the model\n", "the norm\n"] * 20
    files = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "blank.txt"]
    files[0].write_text("\n".join(paragraphs))
    files[1].write_text("the data in the text\n\nof the norm")
    files[2].write_text("  \n")
    streamed = [row["input_ids"] for row in streaming.file_stream(files, tokenizer, BLOCK)]
    pieces = list(streaming.file_documents(files))
    assert len(pieces) > 3 and all(len(text) < 80 for text, _ in pieces)
    assert streamed == token_blocks(tokenizer, load_texts(",".join(map(str, files))), None, BLOCK).tolist()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_json_and_parquet_files_stream_the_blocks_they_give_read_whole(tmp_path, kind):
    """Read a row at a time through ``load_dataset(..., streaming=True)`` (never the file whole), a row a document
    as read whole, the text column found from the first row; a file without one is one line before training."""
    import json

    import pandas

    from hf_normswap.data import DataError
    from hf_normswap.data.sources import source

    tokenizer = tiny_tokenizer()
    documents = [f"the norm {i} " + "of the model " * (i % 7) for i in range(40)] + ["", "  "]
    path = tmp_path / f"rows.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(documents)))
    else:
        pandas.DataFrame({"id": range(len(documents)), "text": documents}).to_parquet(path)
    whole = token_blocks(tokenizer, load_texts(str(path)), None, BLOCK).tolist()
    streamed = take(streaming.table_stream([path], "json" if kind == "jsonl" else "parquet", tokenizer, BLOCK), 10**6)
    assert len(whole) > 20 and streamed == whole
    assert sorted(take(source(str(path)).stream(tokenizer, BLOCK, seed=0), 10**6)) == sorted(whole)  # shuffled
    (tmp_path / "ids.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(DataError, match="no text column"):
        streaming.table_stream([tmp_path / "ids.jsonl"], "json", tokenizer, BLOCK)
