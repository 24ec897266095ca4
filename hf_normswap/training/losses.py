"""What the recovery's loss terms (``loss_terms``) share: the two models' forwards on one batch, through the output
head in chunks of tokens where asked (``head_loss``), and the KL divergence of full logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .head_loss import fused_head_available, head_bypassed, head_is_plain


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                      mask: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over positions (``mask`` selects them).

    Computed in fp32 over chunks of positions, so a 50k-token vocabulary does not need three full-size copies.
    """
    vocab = student_logits.shape[-1]
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    if mask is not None:
        keep = mask.reshape(-1).bool()
        student, teacher = student[keep], teacher[keep]
    if student.shape[0] == 0:
        return student_logits.sum() * 0.0
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, student.shape[0], chunk):
        s = F.log_softmax(student[start:start + chunk].float() / temperature, dim=-1)
        t = F.log_softmax(teacher[start:start + chunk].float() / temperature, dim=-1)
        total = total + F.kl_div(s, t, log_target=True, reduction="sum")
    return total / student.shape[0] * temperature ** 2


def forwards(model: nn.Module, teacher: nn.Module, inputs: dict, *, head_chunk: int, hidden_states: bool,
             attentions: bool = False):
    """``(student outputs, teacher outputs, heads)`` of one batch, the teacher's under no_grad. ``head_chunk`` > 0:
    both output heads bypassed (:func:`hf_normswap.head_loss.head_bypassed`): ``.logits`` hold the hidden states
    that enter them and ``heads`` is ``(student head, teacher head)``; 0: full logits, ``heads`` None.
    ``attentions``: both models' attention weights too (the models run eager attention: ``EagerAttention``)."""
    extra = {"output_hidden_states": True} if hidden_states else {}
    if attentions:
        extra["output_attentions"] = True
    teacher_inputs = dict(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), **extra)
    if not head_chunk:
        outputs = model(**inputs, **extra)
        with torch.no_grad():
            return outputs, teacher(**teacher_inputs), None
    with head_bypassed(unwrapped(model)) as head:
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, **extra)
    with torch.no_grad(), head_bypassed(teacher) as teacher_head:
        return outputs, teacher(**teacher_inputs), (head, teacher_head)


def head_chunk_for(model: nn.Module, teacher: nn.Module, requested: int) -> int:
    """``requested`` when both output heads are plain linear maps (:func:`head_is_plain`) and the fused loss is
    installed (:func:`fused_head_available`), else 0 (full logits)."""
    plain = requested and fused_head_available() and head_is_plain(model) and head_is_plain(teacher)
    return int(requested) if plain else 0


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose output head is the one to bypass)."""
    return getattr(model, "module", model)
