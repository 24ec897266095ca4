"""The attention term: every layer's attention rows pulled toward the original's, a KL divergence a query. The
element-wise modules lose the original's copying heads (an induction head attends from a token of a repeated
passage to the token after its earlier copy), which recovery on the logits and block outputs alone does not bring
back; this term asks for the original's attention pattern itself. The forwards run eager attention for it (the
weights exist only there)."""

from __future__ import annotations

import torch

from .base import LossTerm, Step, register

FLOOR = 1e-12  # the student's weights are clamped here before the log: a causal row is 0 past its query


@register
class Attention(LossTerm):
    """``distill.terms.attention`` times the mean over layers, heads and queries of KL(original's row || student's)."""

    key = "attention"
    logged = {"attention_loss": "attention KL"}
    attentions = True

    @classmethod
    def memory(cls, sizes, tokens: int, value_bytes: int, seq_len: int) -> dict[str, int]:
        # every layer's weights of both models, (batch, heads, seq, seq), kept for the step (the student's for the
        # backward too), where the default attention holds none
        return {"attention weights": 2 * sizes.layers * sizes.heads * tokens * seq_len * value_bytes}

    def value(self, step: Step) -> torch.Tensor:
        total, mask = step.zero, step.mask
        for ours, theirs in zip(step.outputs.attentions, step.reference.attentions):
            target = theirs.float()
            kl = (torch.xlogy(target, target) - target * ours.float().clamp_min(FLOOR).log()).sum(-1)  # b, h, q
            if mask is None:
                total = total + kl.mean()
            else:
                kept = mask[:, None, :].to(kl.dtype).expand_as(kl)
                total = total + (kl * kept).sum() / kept.sum().clamp_min(1)
        return total / max(1, len(step.outputs.attentions))

    def describe(self) -> str:
        return f"every layer's attention toward the original's, KL a query (weight {self.weight:.4g})"
