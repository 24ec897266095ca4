"""The tails of an encoder's agreement with its original: the sentences whose embedding strays, and how the
agreement changes with sentence length.

The embedding cosine (``metrics/``) is a mean over sentences, and a mean hides the few sentences whose meaning is
lost. So, on the same sentences: the per-sentence cosine's mean, its low percentiles (the 50th, 10th, 1st and 0.1st)
and minimum, the worst sentences with a snippet of each, and the mean cosine by sentence length in tokens. An encoder
has no ratio by position or repetition check: it predicts no token, and every token attends to every other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .metrics import number

LOW_PERCENTILES = (("p50", 50.0), ("p10", 10.0), ("p1", 1.0), ("p0_1", 0.1))
LENGTH_EDGES = (0, 16, 32, 64, 128, 256)  # sentence lengths in tokens, special tokens included; the last range open
WORST = 5  # sentences listed
SNIPPET = 80  # characters of a sentence shown


@dataclass
class StraySentence:
    """One sentence's cosine to the original's embedding, with its length in tokens and the start of its text."""

    cosine: float
    tokens: int
    text: str


@dataclass
class EmbeddingTails:
    """The per-sentence cosine's distribution, the worst sentences and the cosine by sentence length."""

    cosine: dict  # mean, the low percentiles, min
    worst: list[StraySentence]
    by_length: list[dict]  # {"start", "end", "sentences", "cosine"} for each length range that has sentences

    def table(self) -> str:
        keys = ["mean", *(key for key, _ in LOW_PERCENTILES), "min"]
        lines = ["| per-sentence cosine | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1),
                 "| converted | " + " | ".join(number(self.cosine[key]) for key in keys) + " |", "",
                 "| sentence tokens | " + " | ".join(f"{r['start']}-{r['end']}" for r in self.by_length) + " |",
                 "|" + "---|" * (len(self.by_length) + 1),
                 "| sentences | " + " | ".join(str(r["sentences"]) for r in self.by_length) + " |",
                 "| mean cosine | " + " | ".join(number(r["cosine"]) for r in self.by_length) + " |", "",
                 "worst sentences:", "| cosine | tokens | text |", "|---|---|---|"]
        lines += [f"| {number(s.cosine)} | {s.tokens} | {s.text} |" for s in self.worst]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"cosine": self.cosine, "by_length": self.by_length, "worst": [asdict(s) for s in self.worst]}


def _snippet(sentence: str) -> str:
    text = sentence[:SNIPPET] + ("..." if len(sentence) > SNIPPET else "")
    return text.replace("|", "\\|")  # a Markdown table cell


def embedding_tails(reference: torch.Tensor, converted: torch.Tensor, sentences: list[str],
                    lengths: torch.Tensor) -> EmbeddingTails:
    """The tails of ``converted``'s agreement with ``reference`` (unit-length embeddings, one row per sentence of
    ``sentences``, each ``lengths`` tokens long as the models read it)."""
    cosine = (reference * converted).sum(-1).double().numpy()
    spread = {"mean": float(cosine.mean())}
    spread.update({key: float(np.percentile(cosine, q)) for key, q in LOW_PERCENTILES})
    spread["min"] = float(cosine.min())
    lengths = lengths.numpy()
    worst = [StraySentence(float(cosine[i]), int(lengths[i]), _snippet(sentences[i]))
             for i in np.argsort(cosine, kind="stable")[:WORST]]
    by_length = []
    ends = [*LENGTH_EDGES[1:], max(int(lengths.max()), LENGTH_EDGES[-1] + 1)]
    for start, end in zip(LENGTH_EDGES, ends):
        inside = (lengths > start) & (lengths <= end)
        if inside.any():
            by_length.append({"start": start, "end": end, "sentences": int(inside.sum()),
                              "cosine": float(cosine[inside].mean())})
    return EmbeddingTails(spread, worst, by_length)
