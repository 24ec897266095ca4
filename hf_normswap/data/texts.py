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
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from huggingface_hub import constants, get_session

from ..validation import first_line
from .generated import DEFAULT_TOKENS, SamplingSettings, is_generated, sample_texts

BUILTIN = "builtin"
BUILTIN_SPLITS = ("calibration", "evaluation")
LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
HUB_PROBE_TIMEOUT = 3.0  # seconds
# Text files above LAZY_BYTES are read only up to a token budget where one is given; no tokenizer makes a token of
# more than CHARS_PER_TOKEN characters of ordinary text, so the prefix holds the budget's tokens.
LAZY_BYTES = 4 << 20
CHARS_PER_TOKEN = 32


class DataError(ValueError):
    """The text source cannot be read; the message says what to pass instead."""


def is_builtin(spec: str | None) -> bool:
    """``builtin`` or ``builtin:SPLIT``: the offline text shipped with Python."""
    return isinstance(spec, str) and (spec == BUILTIN or spec.startswith(BUILTIN + ":"))


def _builtin(split: str) -> list[str]:
    if split not in BUILTIN_SPLITS:
        raise DataError(f"unknown builtin split {split!r}: use builtin:calibration or builtin:evaluation")
    from pydoc_data.topics import topics

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


def _local(paths: list[Path], max_tokens: int | None = None) -> list[str]:
    """The texts of local files: one per text file, read directly (as ``datasets``' text loader with
    ``sample_by="document"`` reads them, so a machine without ``datasets`` reads them too); json/jsonl and parquet
    through ``datasets``."""
    files = [f for p in paths for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]
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
    import datasets

    try:
        dataset = datasets.load_dataset(loader, data_files=[str(f) for f in files], split="train")
    except Exception as error:  # datasets raises many types for malformed json / parquet
        raise DataError(f"cannot read {', '.join(map(str, paths))} as {loader}: {_decode_problem(error, files, loader)}") from None
    return [t for t in dataset[_text_column(dataset)] if t and t.strip()]


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
    import datasets

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


def _hub(spec: str, default_split: str) -> list[str]:
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


def sample_length(spec: str | None) -> int | None:
    """The tokens of a sequence of a ``generated`` spec (to check against the model's context), else None."""
    return generation_settings(spec).length if is_generated(spec) else None


def check_spec(spec: str) -> list[Path] | None:
    """What a text spec can be checked for before a model loads (local files exist, sampling settings are valid);
    returns the local files it names, None for other sources."""
    if is_generated(spec):
        prompt = generation_settings(spec).prompt
        if prompt != "bos":
            check_spec(prompt)
        return None
    return local_paths(spec)


def same_sample(spec: str | None, other: str | None) -> bool:
    """Whether two specs name the same samples of the original (same settings: the same batches)."""
    return is_generated(spec) and is_generated(other) and generation_settings(spec) == generation_settings(other)


def _generated(spec: str, model, tokenizer, max_tokens: int | None, rank: int, world_size: int) -> list[str]:
    try:  # a bad setting, a model that cannot sample: one DataError line
        settings = SamplingSettings.from_spec(spec)
        prompts = None if settings.prompt == "bos" else load_texts(settings.prompt, "calibration")
        return sample_texts(model, tokenizer, settings, max_tokens or DEFAULT_TOKENS, prompt_texts=prompts, rank=rank,
                            world_size=world_size, progress=rank == 0)
    except ValueError as error:
        raise DataError(str(error)) from None


def local_paths(spec: str) -> list[Path] | None:
    """The files a spec names, ``None`` for builtin and Hub specs; ``DataError`` for a path that does not exist.

    Cheap, so the CLI can refuse a mistyped path before loading a model.
    """
    if is_builtin(spec) or is_generated(spec):
        return None
    return _named_paths(spec)


def _named_paths(spec: str) -> list[Path] | None:
    """:func:`local_paths` of a spec known to be neither builtin nor generated."""
    paths = [Path(p).expanduser() for p in spec.split(",")]
    if all(p.exists() for p in paths):
        return paths
    if any(p.exists() for p in paths) or spec.startswith((".", "/", "~")) or Path(spec).suffix:
        missing = ", ".join(str(p) for p in paths if not p.exists())
        raise DataError(f"data file not found: {missing}")
    return None


def load_texts(spec: str | None, default_split: str = "calibration", *, model=None, tokenizer=None,
               max_tokens: int | None = None, rank: int = 0, world_size: int = 1) -> list[str]:
    """Documents of a text source. ``default_split`` picks the builtin half (and the Hub split, as train/test).
    ``generated`` text is sampled from ``model`` (the original) with ``tokenizer``, at least ``max_tokens`` tokens
    (default: :data:`generated.DEFAULT_TOKENS`);
    process ``rank`` of ``world_size`` draws its share and reads the others'. A large local text file is read only
    up to ``max_tokens`` (:data:`LAZY_BYTES`)."""
    spec = spec or BUILTIN
    if is_generated(spec):
        return _generated(spec, model, tokenizer, max_tokens, rank, world_size)
    if is_builtin(spec):
        return _builtin(spec.partition(":")[2] or default_split)
    paths = _named_paths(spec)
    if paths is not None:
        return _local(paths, max_tokens)
    hub_split = {"calibration": "train", "evaluation": "test"}.get(default_split, default_split)
    return _hub(spec, hub_split)


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
