"""What every term of the recovery's loss is: :class:`LossTerm`, the batch it reads (:class:`Step`), and the
registry (:data:`TERMS`, :func:`register`) the recipe builds the configured terms from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

TERMS: dict[str, type["LossTerm"]] = {}  # by key, in the order the loss sums them


def register(term: type["LossTerm"]) -> type["LossTerm"]:
    """Add a kind of loss term (a class decorator)."""
    if term.key in TERMS:
        raise ValueError(f"two loss terms are named {term.key!r}")
    TERMS[term.key] = term
    return term


@dataclass
class Step:
    """One batch's forwards, as every term reads them: ``outputs`` the student's (``.logits`` hold the hidden
    states that enter the head when ``heads`` is ``(student head, teacher head)``, the chunked head loss),
    ``reference`` the original's under no_grad, ``hidden_states`` and ``attentions`` in both when a term asked for
    them."""

    inputs: dict
    outputs: Any
    reference: Any
    heads: tuple | None
    head_chunk: int
    distill_weight: float

    @property
    def mask(self) -> torch.Tensor | None:
        return self.inputs.get("attention_mask")

    @property
    def zero(self) -> torch.Tensor:
        return torch.zeros((), device=self.inputs["input_ids"].device)


class LossTerm:
    """A term of ``loss = (1 - w) * CE + w * (KD + sum of weight * term)``, ``w`` the distillation weight
    (``distill.weight``). A kind sets :attr:`key` and :attr:`logged` and overrides :meth:`value` and
    :meth:`describe`; the rest has defaults for a term weighted by ``distill.terms.KEY`` (a number, or a mapping
    with ``weight`` and the term's own options)."""

    key = ""  # the name of its setting, distill.terms.KEY
    logged: dict[str, str] = {}  # what it logs each step ({key in the history: label on the plot}), its value first
    hidden_states = False  # reads every block's output of both models (the forwards then return them)
    attentions = False  # reads every layer's attention weights of both models (eager attention then)
    grouped = False  # weight * value summed with the other grouped terms' before w multiplies the sum
    own_setting = False  # read from distill's own keys (the built-in terms), not from distill.terms

    def __init__(self, weight: float, options: dict | None = None):
        self.weight, self.options = float(weight), dict(options or {})

    @classmethod
    def setting(cls, distill) -> tuple[float, dict]:
        """``(weight, options)`` of this term in the ``distill`` settings (weight 0: off)."""
        given = (distill.terms or {}).get(cls.key, 0.0)
        if isinstance(given, dict):
            return float(given.get("weight", 0.0)), {k: v for k, v in given.items() if k != "weight"}
        return float(given), {}

    @classmethod
    def check(cls, weight: float, options: dict) -> str | None:
        """Why these settings cannot work, in a line naming the fix (None: they can); read before any load."""
        return f"distill.terms.{cls.key} takes no options, got {', '.join(options)}" if options else None

    @classmethod
    def build(cls, distill, model) -> "LossTerm | None":
        """The term for training ``model`` (the student, before LoRA wraps it), or None when it is off."""
        weight, options = cls.setting(distill)
        return cls(weight, options) if weight > 0 else None

    @classmethod
    def memory(cls, sizes, tokens: int, value_bytes: int, seq_len: int) -> dict[str, int]:
        """Bytes a training step holds for this term beyond the models' own activations, by name, for the memory
        plan (``sizes``: ``planning.sizes.ModelSizes``; ``tokens`` a step's on one process, in rows of
        ``seq_len``)."""
        return {}

    def value(self, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def parts(self, step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(its share of the loss, {logged key: value})``: ``(w * weight) * value``; a grouped term leaves ``w``
        to the sum of its group."""
        value = self.value(step)
        scale = self.weight if self.grouped else step.distill_weight * self.weight
        return scale * value, {next(iter(self.logged)): value}

    def describe(self) -> str | None:
        """The term in words, for the model card (None: nothing to say)."""
        raise NotImplementedError

    def callbacks(self) -> list:
        """Trainer callbacks the term needs (hooks it removes when training ends)."""
        return []
