"""Streamed Hub datasets for training: read lazily, tokenized and packed on the fly, split between processes.

The recipe's ``streaming: true`` reads ``train_data: NAME[:config][:split]`` with ``load_dataset(...,
streaming=True)``, the switch ``datasets`` users know: nothing is downloaded or tokenized ahead, so a run can train
on a corpus far larger than it could store. Rows are documents, joined by the EOS token and cut into blocks of
``block_len`` tokens, the remainder carried from row to row, so the blocks are the ones the same rows give when read
whole (``texts.token_blocks``).

The packed stream is one ``datasets.IterableDataset`` shard. Under accelerate the main process reads it and
dispatches each global batch to the processes (accelerate's default for a stream), so every process trains on other
blocks and none twice; a resumed run skips the batches it has trained on, so it continues where it stopped. Reading
each process's own files (``split_dataset_by_node``) would pack the files apart, and accelerate would then split
the batches a second time.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..validation import first_line
from .texts import DataError, hub_dataset, row_text

LINE_PROBE_ROWS = 1000  # rows read to tell a dataset of lines from one of documents
PIECE_CHARS = 1 << 16  # characters a dataset of lines is tokenized in at a time (about)


def block_features():
    """The features of packed training blocks, streamed or read whole, so that a mix of both aligns (``datasets``
    infers ``input_ids`` read whole as int32 and a stream's as int64)."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    ids = datasets.Sequence(datasets.Value("int64"))
    return datasets.Features({"input_ids": ids, "labels": ids})


def _source(spec: str, default_split: str):
    source, column = hub_dataset(spec, default_split, streaming=True)
    try:
        first = next(iter(source.take(1)), None)
    except Exception as error:  # a stream reports a missing split or file only when it is read
        raise DataError(f"cannot stream dataset {spec!r} ({first_line(error)})") from None
    if first is None:
        raise DataError(f"the stream {spec!r} is empty: name a split with rows")
    return source, column


def _documents(source, column: str):
    """``(text, ends a document)`` pairs that read as ``data`` reads the split whole. Rows are documents, unless the
    first :data:`LINE_PROBE_ROWS` hold an empty one: then the dataset is one line a row, blank lines kept (WikiText),
    and the split is one text, its rows joined by newlines. That text is handed on in pieces of about
    :data:`PIECE_CHARS`, each cut where a paragraph begins after a blank line: byte-level BPE tokenizers split there
    anyway (a run of newlines is its own token), so the pieces tokenize as the whole does."""
    if not any(row_text(row[column]) == "" for row in source.take(LINE_PROBE_ROWS)):
        yield from ((row[column], True) for row in source if row[column] and row[column].strip())
        return
    piece, size, after_blank = [], 0, False
    for row in source:
        text = row_text(row[column])
        if after_blank and text and size >= PIECE_CHARS:
            yield "\n".join(piece) + "\n", False
            piece, size = [], 0
        piece.append(text)
        size += len(text) + 1
        after_blank = text == ""
    yield "\n".join(piece), True


def packed(documents, tokenizer, block_len: int):
    """Blocks of ``(text, ends a document)`` pairs, in order, remainders carried from one to the next: the blocks
    that ``texts.token_blocks`` cuts from the same documents read whole."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer: list[int] = []
    for text, ends in documents:
        buffer.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + (separator if ends else []))
        while len(buffer) >= block_len:
            block, buffer = buffer[:block_len], buffer[block_len:]
            yield {"input_ids": block, "labels": block}


def _packed(source, column: str, tokenizer, block_len: int):
    yield from packed(_documents(source, column), tokenizer, block_len)


def file_documents(files) -> "Iterator[tuple[str, bool]]":
    """Local text files read a line at a time, each one document (as ``sources.load_texts`` reads it whole), handed
    on in pieces of about :data:`PIECE_CHARS` cut where a paragraph begins after a blank line (as
    :func:`_documents` cuts a dataset of lines): a file of any size is never in memory whole."""
    for file in files:
        piece, size, after_blank, begun = [], 0, False, False
        with open(file, encoding="utf-8") as handle:
            for line in handle:
                if after_blank and line.strip() and size >= PIECE_CHARS:
                    yield "".join(piece), False
                    piece, size, begun = [], 0, True
                piece.append(line)
                size += len(line)
                after_blank = not line.strip()
        text = "".join(piece)
        if text.strip() or begun:  # a blank file is no document, as read whole
            yield text, True


def _file_blocks(files: list, tokenizer, block_len: int):
    yield from packed(file_documents(files), tokenizer, block_len)


def file_stream(files, tokenizer, block_len: int):
    """The training blocks of local text files, read lazily (:func:`file_documents`) as a ``datasets`` stream (the
    files a tuple: ``datasets`` would read a list as shards, each packed apart)."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    return datasets.IterableDataset.from_generator(
        _file_blocks, features=block_features(),
        gen_kwargs={"files": tuple(map(str, files)), "tokenizer": tokenizer, "block_len": block_len})


def table_stream(files, loader: str, tokenizer, block_len: int):
    """The training blocks of local json/jsonl or parquet files (``loader``: ``json`` or ``parquet``), a row a
    document as ``texts.read_local`` reads them, through ``load_dataset(..., streaming=True)``: the files are read
    as the run trains, never whole. DataError, after one row, for files without a text column."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    files = tuple(map(str, files))
    _, column = _table(files, loader)
    return datasets.IterableDataset.from_generator(
        _table_blocks, features=block_features(),
        gen_kwargs={"files": files, "loader": loader, "column": column, "tokenizer": tokenizer,
                    "block_len": block_len})


def _table_blocks(files: tuple[str, ...], loader: str, column: str, tokenizer, block_len: int):
    rows, _ = _table(files, loader)
    yield from packed(((row[column], True) for row in rows if row[column] and row[column].strip()), tokenizer,
                      block_len)


def _table(files: tuple[str, ...], loader: str):
    """``(rows, text column)`` of local files as a ``datasets`` stream: ``text``, else the first row's first string
    (a stream of json has no features before it is read)."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    try:
        rows = datasets.load_dataset(loader, data_files=list(files), split="train", streaming=True)
        first = next(iter(rows.take(1)), None)
    except Exception as error:  # datasets raises many types for malformed json / parquet
        raise DataError(f"cannot read {', '.join(files)} as {loader} ({first_line(error)})") from None
    if first is None:
        raise DataError(f"{', '.join(files)} has no rows")
    column = "text" if "text" in first else next((k for k, v in first.items() if isinstance(v, str)), None)
    if column is None:
        raise DataError(f"no text column among {list(first)} in {', '.join(files)}: the data needs a 'text' column")
    return rows, column


def packed_stream(spec: str, tokenizer, block_len: int, default_split: str = "train"):
    """The training blocks of a streamed Hub dataset ``NAME[:config][:split]``; DataError (after reading one row)
    for a name that does not load or a stream without rows."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    source, column = _source(spec, default_split)
    return datasets.IterableDataset.from_generator(
        _packed, features=block_features(),
        gen_kwargs={"source": source, "column": column, "tokenizer": tokenizer, "block_len": block_len})
