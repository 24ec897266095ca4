"""The repetition check: a passage repeated until the window is full, each model's perplexity on the last copy.

A model that copies from its context predicts a repeated passage almost perfectly; copying across thousands of
tokens is what a model whose activations drift with position loses first. The ratio on the last copy says whether
the converted model still copies as far as the original does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..model_inputs import model_device
from .metrics import exp_or_inf, number
from .perplexity import REFERENCE
from .token_losses import next_token_losses

PASSAGE = 256  # tokens in the repeated passage (fewer when the window holds fewer than two copies)


@dataclass
class Repetition:
    """Perplexities on the first and the last copy of the passage, for both models."""

    passage: int
    copies: int
    original_first: float
    original_last: float
    converted_first: float
    converted_last: float

    @property
    def ratio(self) -> float:
        return self.converted_last / self.original_last

    def line(self) -> str:
        return (f"repetition: a {self.passage}-token passage {self.copies} times; perplexity on the last copy "
                f"{number(self.original_last)} ({REFERENCE}) -> {number(self.converted_last)}, ratio "
                f"{number(self.ratio)} (first copy {number(self.original_first)} -> {number(self.converted_first)})")

    def to_dict(self) -> dict:
        return dict(asdict(self), ratio=self.ratio)


@torch.no_grad()
def repetition(models: dict[str, nn.Module], stream: list[int], max_length: int,
               converted: str = "converted") -> Repetition | None:
    """The check on the first tokens of ``stream`` (which starts with the prefix token), None when the window
    holds fewer than two copies of even a one-token passage."""
    passage = min(PASSAGE, max_length // 2, len(stream) - 1)
    if passage < 1:
        return None
    copies = max_length // passage  # the window reads all but the last token
    ids = torch.tensor(stream[:1] + stream[1:1 + passage] * copies, dtype=torch.long)
    first = slice(0, passage)  # predictions of the first copy's tokens
    last = slice(len(ids) - 1 - passage, len(ids) - 1)
    found = {}
    for name in (REFERENCE, converted):
        model = models[name]
        logits = model(input_ids=ids[None, :-1].to(model_device(model)), use_cache=False).logits[0]
        losses = next_token_losses(logits, ids[1:])
        found[name] = (exp_or_inf(float(losses[first].mean())), exp_or_inf(float(losses[last].mean())))
    return Repetition(passage, copies, *found[REFERENCE], *found[converted])
