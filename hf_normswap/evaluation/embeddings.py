"""How closely a converted encoder (a model without a language-model head, such as MiniLM) keeps its original's
sentence embeddings: the counterpart of perplexity for models that do not predict tokens.

Embeddings are the attention-mask-weighted mean of the last hidden states (sentence-transformers' pooling for
MiniLM). Each model's embeddings and their pair similarities are compared with the original's by the embedding
metrics of ``metrics/``, one file each: the embedding cosine, the nearest-neighbour agreement and the similarity
rank correlation, each 1.0 for a perfect copy of the original.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data import fingerprint
from ..model_inputs import context_length, mean_pool, model_device
from .embedding_tails import EmbeddingTails, embedding_tails
from .metrics import EmbeddingMetric, Similarities, registered
from .perplexity import REFERENCE, EvaluationError, check_window

MIN_WORDS, MAX_WORDS = 5, 64
MAX_SENTENCES = 2000  # the pair statistics grow with the square: 2 million pairs at most
DEFAULT_MAX_LENGTH = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2


def sentences(texts: list[str], tokenizer, max_tokens: int | None = None,
              max_sentences: int | None = MAX_SENTENCES) -> list[str]:
    """Prose sentences of MIN_WORDS to MAX_WORDS words from the texts (wrapped lines joined), the first
    ``max_sentences`` of them (None: all), up to ``max_tokens``."""
    found, total = [], 0
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if MIN_WORDS <= len(sentence.split()) <= MAX_WORDS and sentence[0].isalpha():
                    total += len(tokenizer(sentence, add_special_tokens=False)["input_ids"])
                    if max_tokens is not None and total > max_tokens:
                        return found
                    found.append(sentence)
                    if len(found) == max_sentences:
                        return found
    return found


@torch.no_grad()
def mean_pooled(model: nn.Module, encoded: dict) -> torch.Tensor:
    """One embedding per row of a tokenized batch (on the CPU or anywhere: it goes to the model's device): the
    attention-mask-weighted mean of the last hidden states, on the model's device."""
    encoded = {key: value.to(model_device(model)) for key, value in encoded.items()}
    return mean_pool(model(**encoded, output_hidden_states=True).hidden_states[-1], encoded["attention_mask"])


def _embed(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """The embeddings on the CPU, where the pair statistics compare models that may sit on different devices."""
    return torch.cat([mean_pooled(model, encoded).cpu() for encoded in batches])


def _similarities(embeddings: torch.Tensor) -> Similarities:
    """What the embedding metrics compare: the embeddings at unit length, every pair's cosine, each nearest other."""
    embeddings = F.normalize(embeddings, dim=-1)
    matrix = embeddings @ embeddings.T
    i, j = torch.triu_indices(len(matrix), len(matrix), offset=1)
    pairs = matrix[i, j]
    matrix.fill_diagonal_(-2.0)  # a sentence is not its own neighbour
    return Similarities(embeddings, pairs, matrix.argmax(-1))


@dataclass
class EmbeddingEvaluation:
    """Embedding agreement of each model with the reference, on the same sentences: the registered embedding
    metrics (``metrics/``) as rows, and the tails of the per-sentence cosine."""

    results: dict[str, dict[str, float]]  # model -> metric key -> figure
    data: str | None = None
    fingerprint: str | None = None
    sentences: int = 0
    tokens: int = 0
    tails: EmbeddingTails | None = None

    def describe(self) -> str:
        data = f"{self.data} " if self.data else ""
        return (f"{data}({self.sentences} sentences, {self.tokens} tokens, mean-pooled embeddings; "
                f"fingerprint {self.fingerprint or '-'})")

    def table(self) -> str:
        """Markdown table as for language models: metrics as rows, the original and each model as columns."""
        names = list(self.results)
        lines = ["| " + " | ".join(["metric", REFERENCE, *names]) + " |", "|" + "---|" * (len(names) + 2)]
        for metric in registered(EmbeddingMetric):
            cells = [metric.format(metric.perfect), *(metric.format(self.results[n][metric.key]) for n in names)]
            lines.append("| " + " | ".join([metric.label, *cells]) + " |")
        return "\n\n".join(["\n".join(lines), *([self.tails.table()] if self.tails else [])])

    def to_dict(self) -> dict:
        return {"data": self.data, "fingerprint": self.fingerprint, "sentences": self.sentences,
                "tokens": self.tokens, "reference": REFERENCE,
                "results": {name: dict(figures) for name, figures in self.results.items()},
                "tails": self.tails.to_dict() if self.tails else None}


def evaluate_embeddings(model: nn.Module, against: nn.Module, tokenizer, texts: list[str], *,
                        max_tokens: int | None = None, max_length: int | None = None, batch_size: int = 32,
                        data: str | None = None) -> EmbeddingEvaluation:
    """The embedding metrics (cosine, nearest-neighbour agreement, similarity rank correlation, ...) of ``model``
    to ``against``."""
    found = sentences(texts, tokenizer, max_tokens)
    if len(found) < 3:
        raise EvaluationError(f"the evaluation text gives {len(found)} prose sentences of {MIN_WORDS}-{MAX_WORDS} "
                              "words; embedding agreement needs at least 3")
    models = {REFERENCE: against, "converted": model}
    check_window(max_length, models)
    max_length = min([max_length or DEFAULT_MAX_LENGTH, *filter(None, map(context_length, models.values()))])
    padding = tokenizer.pad_token is not None
    batch_size = batch_size if padding else 1  # nothing to pad with: one sentence a pass
    batches = [tokenizer(found[i:i + batch_size], padding=padding, truncation=True,
                         max_length=max_length, return_tensors="pt")
               for i in range(0, len(found), batch_size)]
    reference = _similarities(_embed(against.eval(), batches))
    converted = _similarities(_embed(model.eval(), batches))
    result = {metric.key: metric.value(reference, converted) for metric in registered(EmbeddingMetric)}
    lengths = torch.cat([b["attention_mask"].sum(-1) for b in batches])
    tails = embedding_tails(reference.embeddings, converted.embeddings, found, lengths)
    return EmbeddingEvaluation({"converted": result}, data, fingerprint(texts), len(found), int(lengths.sum()), tails)
