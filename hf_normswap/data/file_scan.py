"""Local data files read once, end to end, before any model loads, in memory that does not grow with their size.

A stream trains on a file as the run reads it: a byte that is not UTF-8 a gigabyte in, a JSON line without the
text column, would stop the run hours later, and every relaunch at the same point. So the check reads every byte
of a text file (an incremental UTF-8 decoder, :data:`CHUNK` bytes at a time), every line of JSON lines (``json``,
a line at a time) and every batch of a parquet file (``pyarrow``'s ``iter_batches``, the text column alone), and
counts what the files hold: the UTF-8 bytes of their text and their documents, which bound the tokens any
tokenizer makes of them (:meth:`FileText.most_tokens`). Nothing is kept but the counts; nothing goes through
``datasets``, which would read a JSON file whole and write it to its cache as Arrow.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..validation import first_line
from .errors import DataError

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # by suffix; any other file is text
CHUNK = 1 << 20  # bytes of a text file decoded at a time
ROWS = 4096  # rows of a parquet batch


@dataclass
class FileText:
    """What local files hold: the UTF-8 bytes of their documents' text, and the documents with any (a text file
    is one document, a row one)."""

    text_bytes: int = 0
    documents: int = 0

    def most_tokens(self) -> int:
        """At most the tokens any tokenizer makes of the text joined by EOS: a token covers a byte at least (a
        byte-level BPE's, a character's), plus a word-start marker (SentencePiece's dummy prefix) and the EOS
        separator a document."""
        return self.text_bytes + 2 * self.documents


def scan(files: list[Path]) -> FileText:
    """Every byte of ``files`` (all of one kind: text, JSON or parquet) read and counted; DataError, in one line
    naming the file and where, for a byte that is not UTF-8, a line that is not a JSON object, a row without the
    text column or a file that does not read."""
    found = FileText()
    if file_kind(files) != "text":
        for value in table_texts(files):
            _count(found, value)
        return found
    for file in files:
        try:
            _text(file, found)
        except OSError as error:
            raise DataError(f"cannot read {file}: {error.strerror or first_line(error)}") from None
    return found


def file_kind(files: list[Path]) -> str:
    """``text``, ``json`` or ``parquet``: the one kind of ``files``; DataError for a mix."""
    kinds = {LOADERS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise DataError("mixed file types: pass text, json/jsonl or parquet files, one kind at a time")
    return kinds.pop()


def table_texts(files: list[Path]) -> Iterator[str | None]:
    """The text column of JSON or parquet files, a row at a time (a null row as None), in file order: ``text``,
    else the first row's first string column, which every row must hold."""
    reader = _json if file_kind(files) == "json" else _parquet
    column: list[str] = []  # the column, once the first row names it
    for file in files:
        try:
            yield from reader(file, column)
        except OSError as error:
            raise DataError(f"cannot read {file}: {error.strerror or first_line(error)}") from None


def _text(file: Path, found: FileText) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    read, text = 0, False
    with open(file, "rb") as handle:
        while True:
            chunk = handle.read(CHUNK)
            start = read - len(decoder.getstate()[0])  # the offset of the bytes the decoder is handed, pending first
            try:
                decoded = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as bad:
                raise DataError(not_utf8(file, bad.object[bad.start], start + bad.start)) from None
            read += len(chunk)
            text = text or bool(decoded.strip())
            if not chunk:
                break
    if text:  # a blank file is no document, as read whole
        found.text_bytes += read
        found.documents += 1


def not_utf8(file: Path, byte: int, offset: int) -> str:
    return (f"{file} is not UTF-8 text (byte {byte:#04x} at offset {offset}); re-encode it as UTF-8, e.g. iconv -f "
            "latin1 -t utf-8")


def _count(found: FileText, value: str | None) -> None:
    """One document's text (a row's column), or None (an empty row)."""
    if value and value.strip():
        found.text_bytes += len(value.encode("utf-8", "surrogatepass"))
        found.documents += 1


def _json(file: Path, column: list[str]) -> Iterator[str | None]:
    """JSON lines, a line at a time; a file that is one JSON document (a list of objects) is read whole, as
    ``datasets`` reads it."""
    offset, first = 0, True
    with open(file, "rb") as handle:
        for number, line in enumerate(handle, 1):
            offset += len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as bad:
                raise DataError(not_utf8(file, bad.object[bad.start], offset - len(line) + bad.start)) from None
            except ValueError as error:
                if first and line.lstrip()[:1] in (b"[", b"{"):  # a JSON document over several lines
                    yield from _json_document(file, column)
                    return
                raise DataError(f"{file} line {number}: not a JSON object ({first_line(error)})") from None
            if first and isinstance(row, list):  # a JSON list of objects on one line
                for index, item in enumerate(row):
                    yield _row_text(item, column, f"{file} row {index}")
                return
            first = False
            yield _row_text(row, column, f"{file} line {number}")


def _json_document(file: Path, column: list[str]) -> Iterator[str | None]:
    try:
        rows = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as bad:
        raise DataError(not_utf8(file, bad.object[bad.start], bad.start)) from None
    except ValueError as error:
        raise DataError(f"{file}: not JSON lines or a JSON list of objects ({first_line(error)})") from None
    if not isinstance(rows, list):
        raise DataError(f"{file}: not JSON lines or a JSON list of objects")
    for number, row in enumerate(rows):
        yield _row_text(row, column, f"{file} row {number}")


def _row_text(row, column: list[str], where: str) -> str | None:
    """A JSON row's text: the column the first row named (``text``, else its first string), a string or null."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: not a JSON object")
    if not column:
        column.append("text" if "text" in row else next((k for k, v in row.items() if isinstance(v, str)), None))
        if column[0] is None:
            raise DataError(f"{where}: no text column among {list(row)}: the data needs a 'text' column")
    if column[0] not in row:
        raise DataError(f"{where}: no {column[0]!r} field (the text column): give every row its text")
    value = row[column[0]]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: the text column {column[0]!r} holds {type(value).__name__}, not a string")
    return value


def _parquet(file: Path, column: list[str]) -> Iterator[str | None]:
    """A parquet file's text column, a batch of :data:`ROWS` rows at a time (the other columns are not read)."""
    import pyarrow  # here: only a parquet file needs it (datasets' dependency, slow to import)
    import pyarrow.parquet as parquet

    try:
        table = parquet.ParquetFile(file)
        names = table.schema_arrow.names
        strings = [f.name for f in table.schema_arrow if pyarrow.types.is_string(f.type)
                   or pyarrow.types.is_large_string(f.type)]
        if not column:
            column.append("text" if "text" in names else next(iter(strings), None))
            if column[0] is None:
                raise DataError(f"{file}: no text column among {names}: the data needs a 'text' column")
        if column[0] not in strings:
            raise DataError(f"{file}: no {column[0]!r} column of strings (the text column) among {names}")
        for batch in table.iter_batches(batch_size=ROWS, columns=[column[0]]):
            yield from batch.column(0).to_pylist()
    except DataError:
        raise
    except (pyarrow.ArrowException, ValueError) as error:
        raise DataError(f"cannot read {file} as parquet ({first_line(error)})") from None
