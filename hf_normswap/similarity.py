"""Sentence-embedding agreement: how close a converted encoder's embeddings stay to its original's.

Perplexity does not apply to a sentence encoder (all-MiniLM-L6-v2 ends in hidden states); what its users consume
is the mean-pooled last hidden state (sentence-transformers' pooling for MiniLM), so the measure is the mean cosine
similarity of each model's sentence embedding to the original's, on the same sentences.
"""

from __future__ import annotations

import torch


def sentences(texts: list[str], count: int) -> list[str]:
    """The first ``count`` lines of ``texts`` with at least five words that are not WikiText headings."""
    lines = [t.strip() for text in texts for t in text.split("\n")
             if len(t.split()) >= 5 and not t.strip().startswith("=")]
    return lines[:count]


@torch.no_grad()
def sentence_similarity(original, models: dict, tokenizer, texts: list[str], count: int = 512,
                        max_length: int = 256) -> dict[str, float]:
    """``{name: mean cosine similarity}`` of each model's mean-pooled sentence embeddings to the original's."""
    lines = sentences(texts, count)
    if not lines:
        raise ValueError("no sentence of at least five words in the evaluation text")
    sims = {name: [] for name in models}

    def pooled(model, enc, mask):
        return (model(**enc).last_hidden_state * mask).sum(1) / mask.sum(1)

    for start in range(0, len(lines), 32):
        enc = tokenizer(lines[start:start + 32], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        mask = enc["attention_mask"].unsqueeze(-1).float()
        reference = pooled(original, enc, mask)
        for name, model in models.items():
            sims[name].append(torch.nn.functional.cosine_similarity(reference, pooled(model, enc, mask), dim=-1))
    return {name: float(torch.cat(values).mean()) for name, values in sims.items()}


class Similarity:
    """The recipe's evaluation of an encoder, with the same reporting methods as ``evaluate.Evaluation``."""

    def __init__(self, name: str, cosine: float, count: int):
        self.name, self.cosine, self.count = name, cosine, count

    def to_dict(self) -> dict:
        return {"mean_cosine_similarity": {self.name: self.cosine}, "sentences": self.count}

    def table(self) -> str:
        return f"mean cosine similarity of sentence embeddings to the original ({self.count} sentences): " \
               f"{self.cosine:.4f}"

    def card(self, name: str) -> dict:
        return {"mean_cosine_similarity": self.cosine, "sentences": self.count}
