"""Every token's loss under each model on the same tokens: the evaluation text read as one stream (documents joined,
each after the prefix token that starts a document in ``perplexity``) and cut into windows of ``max_length``.

A perplexity is a mean: it hides the few inputs where a converted model blows up and the positions past the
length it was trained on. The tails (``tails.py``) and the ratio by position (``positions.py``) are read from these
losses. Window ``w`` feeds ``stream[w * L : w * L + L]`` and predicts the next token at each of its ``L`` positions,
so every token after the first is scored once, and position ``p`` is a prediction made with ``p + 1`` tokens in view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..model_inputs import model_device
from .perplexity import LOGIT_CHUNK
from .documents import documents


@dataclass
class TokenLosses:
    """Per-token negative log-likelihoods (nats) of each model, with where each predicted token sits."""

    losses: dict[str, torch.Tensor]  # name -> (tokens,) float64
    positions: torch.Tensor  # (tokens,) index of the prediction in its window
    targets: torch.Tensor  # (tokens,) the predicted token ids
    max_length: int

    @property
    def tokens(self) -> int:
        return len(self.targets)


def token_stream(tokenizer, texts: list[str], prefix: int, max_tokens: int | None = None) -> list[int]:
    """The texts' tokens as one stream, each document after ``prefix``; ``max_tokens`` caps the text tokens."""
    stream = []
    for doc in documents(tokenizer, texts, max_tokens):
        stream += [prefix] + doc.tokens
    return stream


def next_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-log p(target)`` at each row of ``logits`` (positions, vocab), a chunk of rows at a time (float64)."""
    parts = []
    for start in range(0, len(targets), LOGIT_CHUNK):
        logp = torch.log_softmax(logits[start:start + LOGIT_CHUNK].float(), dim=-1)
        target = targets[start:start + LOGIT_CHUNK].to(logp.device)
        parts.append(-logp.gather(-1, target[:, None])[:, 0].double().cpu())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def token_losses(models: Mapping[str, nn.Module], stream: list[int], max_length: int,
                 batch_size: int = 1) -> TokenLosses:
    """The loss of every token of ``stream`` after the first under each model, in windows of ``max_length``."""
    ids = torch.tensor(stream, dtype=torch.long)
    windows = [(s, min(max_length, len(ids) - 1 - s)) for s in range(0, len(ids) - 1, max_length)]
    losses = {name: [] for name in models}
    positions, targets = [], []
    i = 0
    while i < len(windows):  # windows of one length batched together: no padding (only the last can be short)
        batch = [w for w in windows[i:i + batch_size] if w[1] == windows[i][1]]
        i += len(batch)
        length = batch[0][1]
        inputs = torch.stack([ids[s:s + length] for s, _ in batch])
        target = torch.cat([ids[s + 1:s + 1 + length] for s, _ in batch])
        for name, model in models.items():
            logits = model(input_ids=inputs.to(model_device(model)), use_cache=False).logits
            losses[name].append(next_token_losses(logits.reshape(-1, logits.shape[-1]), target))
            del logits
        positions.append(torch.arange(length).repeat(len(batch)))
        targets.append(target)
    return TokenLosses({name: torch.cat(parts) for name, parts in losses.items()}, torch.cat(positions),
                       torch.cat(targets), max_length)
