"""Text for calibration and evaluation: a Hub dataset, local files, or a built-in offline corpus.

Spec forms (``--calib`` and ``--data`` take the same):
- ``builtin`` or ``builtin:calibration`` / ``builtin:evaluation``: the Python language reference that ships with
  Python (``pydoc_data.topics``, ~465 kB), split by topic into two disjoint halves so calibration and evaluation
  never see the same text. No download needed.
- a local file or directory: ``.txt`` / ``.raw`` / ``.tokens`` (any other suffix is read as text), ``.json`` /
  ``.jsonl``, ``.parquet``; loaded through ``datasets``. Several paths may be joined with commas.
- a Hub dataset ``name[:config][:split]``, e.g. ``wikitext:wikitext-2-raw-v1:test`` (split defaults to ``train``
  for calibration; callers pass their own default).
- ``generated[:key=value,...]``: the original model's own samples (``generated.py``).

Each kind is a class of :mod:`.sources`, which also holds the calls that take a spec (``load_texts``,
``check_spec``); this module reads the texts they name and packs them into blocks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from pydoc_data.topics import topics

import torch
from huggingface_hub import constants, get_session

from ..validation import first_line
from .errors import DataError
from .file_scan import LOADERS, table_texts
from .generated import SamplingSettings

BUILTIN = "builtin"
BUILTIN_SPLITS = ("calibration", "evaluation")
HUB_PROBE_TIMEOUT = 3.0  # seconds
# Text files above LAZY_BYTES are read only up to a token budget where one is given; no tokenizer makes a token of
# more than CHARS_PER_TOKEN characters of ordinary text, so the prefix holds the budget's tokens.
LAZY_BYTES = 4 << 20
CHARS_PER_TOKEN = 32


def is_builtin(spec: str | None) -> bool:
    """``builtin`` or ``builtin:SPLIT``: the offline text shipped with Python."""
    return isinstance(spec, str) and (spec == BUILTIN or spec.startswith(BUILTIN + ":"))


def read_builtin(split: str) -> list[str]:
    if split not in BUILTIN_SPLITS:
        raise DataError(f"unknown builtin split {split!r}: use builtin:calibration or builtin:evaluation")
    keys = sorted(topics)
    half = keys[BUILTIN_SPLITS.index(split)::2]  # alternating topics: two disjoint halves of similar size
    texts = [topics[k] for k in half]
    if split == "evaluation":  # some topics share one text ("if" and "else"): keep it on the calibration side only
        seen = {topics[k] for k in keys[0::2]}
        texts = [t for t in texts if t not in seen]
    return texts


def _text_column(dataset) -> str:
    if "text" in (dataset.column_names or ()):  # a stream of unknown features has no names
        return "text"
    for name, feature in (dataset.features or {}).items():
        if getattr(feature, "dtype", None) == "string":
            return name
    raise DataError(f"no text column among {dataset.column_names}: the data needs a 'text' column")


def _prefix(files: list[Path], chars: int) -> list[str]:
    """The first ``chars`` characters of the files in turn, each cut at a line end: one text per file read."""
    texts = []
    for file in files:
        if chars <= 0:
            break
        with open(file, encoding="utf-8", errors="strict") as handle:
            text = handle.read(chars)
            if len(text) == chars:  # more follows: end at the last whole line
                text = text[: text.rfind("\n") + 1] or text
        chars -= len(text)
        if text.strip():
            texts.append(text)
    return texts


def files_under(paths: list[Path]) -> list[Path]:
    """The files that paths name: a file itself, a directory's files in sorted order."""
    return [f for p in paths for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]


def read_local(paths: list[Path], max_tokens: int | None = None) -> list[str]:
    """The texts of local files: one per text file, read directly (as ``datasets``' text loader with
    ``sample_by="document"`` reads them, so a machine without ``datasets`` reads them too); json/jsonl and parquet
    a row a document, up to ``max_tokens`` a row at a time (``file_scan.table_texts``), else whole through
    ``datasets``."""
    files = files_under(paths)
    if not files:
        raise DataError(f"no files under {', '.join(map(str, paths))}")
    loaders = {LOADERS.get(f.suffix.lower(), "text") for f in files}
    if len(loaders) > 1:
        raise DataError("mixed file types: pass text, json/jsonl or parquet files, one kind at a time")
    loader = loaders.pop()
    if loader == "text":
        try:
            if max_tokens is not None and sum(f.stat().st_size for f in files) > LAZY_BYTES:
                # a large file read up to the budget: its first CHARS_PER_TOKEN characters a token at most
                return _prefix(files, max_tokens * CHARS_PER_TOKEN)
            return [text for f in files if (text := f.read_text(encoding="utf-8")).strip()]
        except UnicodeDecodeError:
            raise DataError(_decode_problem(None, files, loader)) from None
    if max_tokens is not None:  # a budget: the rows up to it, read a row at a time (never the whole file)
        return _table_prefix(files, max_tokens * CHARS_PER_TOKEN)
    import datasets  # lazy: slow to import (`import hf_normswap` must not load it); text files read without it

    try:
        dataset = datasets.load_dataset(loader, data_files=[str(f) for f in files], split="train")
    except Exception as error:  # datasets raises many types for malformed json / parquet
        raise DataError(f"cannot read {', '.join(map(str, paths))} as {loader}: {_decode_problem(error, files, loader)}") from None
    return [t for t in dataset[_text_column(dataset)] if t and t.strip()]


def _table_prefix(files: list[Path], chars: int) -> list[str]:
    """The non-blank rows of JSON or parquet files in order, up to the first that brings them to ``chars``
    characters."""
    texts = []
    for text in table_texts(files):
        if chars <= 0:
            break
        if text and text.strip():
            texts.append(text)
            chars -= len(text)
    return texts


def _decode_problem(error: BaseException, files: list[Path], loader: str) -> str:
    """Why a load failed: for text or JSON that is not UTF-8 (datasets hides the UnicodeDecodeError behind a generic
    message), the file, the byte and the encoding expected; else the error's first line."""
    for file in files if loader != "parquet" else ():
        try:
            file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as bad:
            return (f"{file} is not UTF-8 text (byte {bad.object[bad.start]:#04x} at offset {bad.start}); "
                    "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8")
    return first_line(error)


def hub_dataset(spec: str, default_split: str, streaming: bool = False):
    """``(dataset, text column)`` of a Hub spec ``name[:config][:split]``, read whole or as a ``datasets`` stream;
    DataError in seconds when the Hub is unreachable, or when the name, config or split does not load."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    name, config, split = (spec.split(":") + [None, None])[:3]
    # datasets' own switch (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE): offline, it reads its cache without retries
    if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():  # fail in seconds, not after minutes of retries
        raise DataError(f"cannot load dataset {spec!r}: the Hub ({constants.ENDPOINT}) is unreachable; name a local "
                        "text file instead, or set HF_HUB_OFFLINE=1 to read the datasets cache")
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or default_split, streaming=streaming)
    except Exception as error:  # datasets raises many types for missing names, configs and network failures
        raise DataError(f"cannot load dataset {spec!r} ({first_line(error)}): offline, name a local text file "
                        "instead") from None
    return dataset, _text_column(dataset)


def row_text(value) -> str:
    """A row's text as read from a dataset: a null (None) row is an empty one, as a blank line reads."""
    return "" if value is None else value


def read_hub(spec: str, default_split: str) -> list[str]:
    dataset, column = hub_dataset(spec, default_split)
    rows = [row_text(value) for value in dataset[column]]
    if "" in rows:  # one line per row, blank lines kept (WikiText): the split is one text, as its raw file reads
        return ["\n".join(rows)]
    return [t for t in rows if t and t.strip()]


def generation_settings(spec: str) -> SamplingSettings:
    """The sampling settings of a ``generated`` spec; DataError for a bad one (cheap: no model needed)."""
    try:
        return SamplingSettings.from_spec(spec)
    except ValueError as error:
        raise DataError(str(error)) from None


def names_paths(spec: str) -> bool:
    """Whether a spec names local paths: one exists, or it reads as a path (``./``, ``/``, ``~``, a suffix)."""
    paths = [Path(p).expanduser() for p in spec.split(",")]
    return any(p.exists() for p in paths) or spec.startswith((".", "/", "~")) or bool(Path(spec).suffix)


def named_paths(spec: str) -> list[Path]:
    """The paths a spec names; DataError for one that does not exist."""
    paths = [Path(p).expanduser() for p in spec.split(",")]
    missing = ", ".join(str(p) for p in paths if not p.exists())
    if missing:
        raise DataError(f"data file not found: {missing}")
    return paths


def fingerprint(texts: list[str]) -> str:
    """Short content hash, so calibration and evaluation data can be checked for overlap and recorded."""
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode())
    return digest.hexdigest()[:16]


def token_stream(tokenizer, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """All documents tokenized and joined by the EOS token (when the tokenizer has one), as a 1-D LongTensor."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + separator)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids if max_tokens is None else ids[:max_tokens], dtype=torch.long)


def token_blocks(tokenizer, texts: list[str], num_blocks: int | None, block_len: int) -> torch.Tensor:
    """``(num_blocks, block_len)`` contiguous token blocks (fewer when the text runs out; None: all the text)."""
    stream = token_stream(tokenizer, texts, max_tokens=None if num_blocks is None else num_blocks * block_len)
    count = len(stream) // block_len
    if count == 0:
        raise DataError(f"the text gives {len(stream)} tokens, fewer than one block of {block_len}")
    return stream[: count * block_len].view(count, block_len)


def hub_reachable() -> bool:
    """One quick request to the Hub endpoint, so an offline machine fails in seconds, not after a minute of retries."""
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except Exception:  # any network failure: DNS, refused, timeout, proxy
        return False
    return True
