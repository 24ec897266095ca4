"""The text an evaluation reads: the evaluation texts (the original's samples drawn from the original), and
those texts as scored documents, tokens with the word and byte counts perplexity is normalized by."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..data import load_texts


def evaluation_texts(spec: str, original, tokenizer, max_tokens: int | None) -> list[str]:
    """The evaluation text of ``spec``; ``generated`` text is sampled from ``original``."""
    return load_texts(spec, "evaluation", model=original, tokenizer=tokenizer, max_tokens=max_tokens)


@dataclass
class Document:
    """One scored text: its tokens (no special tokens) and the word / byte counts of the same text."""

    tokens: list[int]
    words: int
    bytes: int


def count_words(text: str) -> int:
    """lm-eval's word count (``len(re.split(r"\\s+", text))``)."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def documents(tokenizer, texts: Iterable[str], max_tokens: int | None = None) -> list[Document]:
    """Tokenize texts into :class:`Document` s, stopping at ``max_tokens`` tokens in all.

    A document cut by the budget counts the words and bytes of the text its kept tokens cover.
    """
    fast = bool(getattr(tokenizer, "is_fast", False))
    docs: list[Document] = []
    total = 0
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "sequence longer than the model's maximum" is expected: we window it
    try:
        for text in texts:
            if max_tokens is not None and total >= max_tokens:
                break
            encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
            ids = list(encoding["input_ids"])
            if not ids:
                continue
            if max_tokens is not None and total + len(ids) > max_tokens:
                ids = ids[: max_tokens - total]
                text = text[: encoding["offset_mapping"][len(ids) - 1][1]] if fast else tokenizer.decode(ids)
            docs.append(Document(ids, count_words(text), count_bytes(text)))
            total += len(ids)
    finally:
        logger.setLevel(level)
    return docs
