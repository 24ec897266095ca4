"""The recovery's loss, the sum of its configured terms (``loss_terms``): what :class:`NormSwapTrainer` computes on
each batch, and what ``precision: auto`` times.

    loss = (1 - w) * CE + w * (KD + h * H + e * E) + (w * s) * S + ...

with ``w`` the distillation weight (``distill.weight``), the grouped terms (layer-wise ``H``, embedding ``E``)
summed before ``w`` multiplies them and every other term added after in the order of ``loss_terms.TERMS``: the
order the loss has always been computed in, so that a run's numbers do not move."""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from .head_loss import DEFAULT_CHUNK
from .loss_terms import TERMS, LossTerm, Step
from .loss_terms.logits import LogitTerms
from .losses import forwards, unwrapped


class EagerAttention(TrainerCallback):
    """Eager attention, the only implementation that returns the weights, on the models a term reads them from,
    each put back as it was when training ends: the saved model then reloads, and the original scores, as before."""

    def __init__(self):
        self.switched: dict[int, tuple[nn.Module, str]] = {}

    def switch(self, *models: nn.Module) -> None:
        for m in models:
            if m.config._attn_implementation != "eager":
                self.switched.setdefault(id(m), (m, m.config._attn_implementation))
                m.set_attn_implementation("eager")

    def on_train_end(self, args, state, control, **kwargs):
        for m, implementation in self.switched.values():
            m.set_attn_implementation(implementation)
        self.switched = {}


class RecoveryLoss:
    """The terms of one recovery (the logit terms always, the others when their weight is above 0) at
    distillation weight ``distill_weight``; ``head_chunk`` tokens at a time through the output head when both
    heads allow it (``losses.head_chunk_for``; 0: full logits)."""

    def __init__(self, terms: list[LossTerm], distill_weight: float, head_chunk: int = DEFAULT_CHUNK):
        self.terms, self.distill_weight, self.head_chunk = terms, float(distill_weight), int(head_chunk or 0)
        self.eager = EagerAttention() if any(term.attentions for term in terms) else None
        kd = any(isinstance(t, LogitTerms) and t.logits for t in terms)
        if not kd and not any(not isinstance(t, LogitTerms) for t in terms):
            raise ValueError("distill.logits=false leaves the distillation no term: set distill.hidden or "
                             "distill.embedding > 0")

    @classmethod
    def of(cls, distill, model: nn.Module | None = None, head_chunk: int = DEFAULT_CHUNK) -> "RecoveryLoss":
        """The loss of the ``distill`` settings (``config.DistillSettings``) for training ``model`` (the student,
        before LoRA wraps it: a term's hooks sit on its modules)."""
        terms = [term for kind in TERMS.values() if (term := kind.build(distill, model)) is not None]
        return cls(terms, distill.weight, head_chunk)

    @property
    def hidden_states(self) -> bool:
        """Whether a term reads every block's output."""
        return any(term.hidden_states for term in self.terms)

    @staticmethod
    def logged() -> tuple[str, ...]:
        """Every term's logged keys (a term that is off logs 0)."""
        return tuple(key for kind in TERMS.values() for key in kind.logged)

    def __call__(self, model: nn.Module, teacher: nn.Module, inputs: dict,
                 head_chunk: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, {logged key: value})`` of one batch, the teacher's forward under no_grad (``head_chunk``: the
        chunk the trainer found both heads allow; None: this loss's own)."""
        chunk = self.head_chunk if head_chunk is None else head_chunk
        if self.eager is not None:
            self.eager.switch(unwrapped(model), teacher)
        outputs, reference, heads = forwards(model, teacher, inputs, head_chunk=chunk,
                                             hidden_states=self.hidden_states, attentions=self.eager is not None)
        step = Step(inputs, outputs, reference, heads, chunk, self.distill_weight)
        loss, group, logged = None, None, {}
        for term in self.terms:
            share, values = term.parts(step)
            logged.update(values)
            if term.grouped:
                group = share if group is None else group + share
                continue
            if group is not None:  # the group's sum joins before the next term after it
                loss, group = loss + self.distill_weight * group, None
            loss = share if loss is None else loss + share
        if group is not None:
            loss = loss + self.distill_weight * group
        return loss, logged

    def describe(self) -> list[str]:
        """The distillation's terms in words (the logit KL, the layer-wise term ...), for the model card."""
        return [text for term in self.terms if (text := term.describe())]

    def callbacks(self) -> list:
        own = [self.eager] if self.eager is not None else []
        return [callback for term in self.terms for callback in term.callbacks()] + own
