"""Model inputs from a text source: the one call that calibration (and the sensitivity map) make to get batches.

The source is a text spec (``builtin``, files, a Hub dataset, ``generated``: resolved by :func:`.sources.load_texts`),
a LongTensor ``(N, L)`` of token ids, or a dict with ``input_ids`` and ``attention_mask``. A causal LM gets
``num_blocks`` contiguous blocks of ``block_len`` tokens (packed, no padding); any other model ``num_blocks``
padded paragraphs of at most ``block_len`` tokens, one a row, as an encoder reads sentences.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model_inputs import is_causal_lm, model_device
from .sources import load_texts
from .texts import DataError, fingerprint, token_blocks

MIN_PARAGRAPH_WORDS = 8


def model_batches(model: nn.Module, source, tokenizer=None, *, num_blocks: int, block_len: int,
                  batch_size: int) -> tuple[list[dict], str | None]:
    """Batches of at most ``batch_size`` rows on the model's input device, and the text's :func:`.texts.fingerprint`
    (None for token ids), which a checkpoint records so that evaluation can warn about overlap."""
    text_fingerprint = None
    if isinstance(source, (torch.Tensor, dict)):
        ids = source["input_ids"] if isinstance(source, dict) else source
        mask = source.get("attention_mask") if isinstance(source, dict) else None
        mask = torch.ones_like(ids) if mask is None else mask
    else:
        if tokenizer is None:
            raise ValueError("calibration from text needs a tokenizer: pass CalibrationConfig(tokenizer=...)")
        block_len = min(block_len, getattr(model.config, "max_position_embeddings", None) or block_len)
        texts = load_texts(source, "calibration", model=model, tokenizer=tokenizer, max_tokens=num_blocks * block_len)
        text_fingerprint = fingerprint(texts)
        if is_causal_lm(model):
            ids = token_blocks(tokenizer, texts, num_blocks, block_len)
            mask = torch.ones_like(ids)
        else:
            rows = _paragraphs(texts, num_blocks)
            enc = tokenizer(rows, truncation=True, max_length=block_len, padding=True, return_tensors="pt")
            ids, mask = enc["input_ids"], enc["attention_mask"]
    ids, mask = ids[:num_blocks], mask[:num_blocks]
    device = model_device(model)
    batches = []
    for start in range(0, ids.shape[0], batch_size):
        batch = {"input_ids": ids[start:start + batch_size].to(device),
                 "attention_mask": mask[start:start + batch_size].to(device)}
        if getattr(model.config, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = batch["input_ids"]
        batches.append(batch)
    return batches, text_fingerprint


def _paragraphs(texts: list[str], count: int) -> list[str]:
    rows = []
    for text in texts:
        for line in text.split("\n"):
            line = line.strip()
            if len(line.split()) >= MIN_PARAGRAPH_WORDS and not line.startswith("="):
                rows.append(line)
                if len(rows) >= count:
                    return rows
    if not rows:
        raise DataError(f"the calibration text has no paragraph of {MIN_PARAGRAPH_WORDS} words or more")
    return rows
