"""The recovery's loss on one batch: causal-LM cross-entropy plus, optionally, KL divergence to the frozen original
(knowledge distillation, Hinton et al. 2015: soft targets at temperature ``T``, scaled by ``T^2``), every block's
output toward the original's (``layerwise``) and the pooled embedding's cosine; through the output head in chunks
of tokens where asked (``head_loss``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .head_loss import fused_head_available, head_bypassed, head_is_plain, head_loss
from .layerwise import embedding_cosine_error, relative_hidden_error


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


def _forwards(model: nn.Module, teacher: nn.Module, inputs: dict, *, head_chunk: int, hidden_states: bool):
    """``(student outputs, teacher outputs, heads)`` of one batch, the teacher's under no_grad. ``head_chunk`` > 0:
    both output heads bypassed (:func:`hf_normswap.head_loss.head_bypassed`): ``.logits`` hold the hidden states
    that enter them and ``heads`` is ``(student head, teacher head)``; 0: full logits, ``heads`` None."""
    extra = {"output_hidden_states": True} if hidden_states else {}
    teacher_inputs = dict(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), **extra)
    if not head_chunk:
        outputs = model(**inputs, **extra)
        with torch.no_grad():
            return outputs, teacher(**teacher_inputs), None
    with head_bypassed(_unwrapped(model)) as head:
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, **extra)
    with torch.no_grad(), head_bypassed(teacher) as teacher_head:
        return outputs, teacher(**teacher_inputs), (head, teacher_head)


def _logit_terms(outputs, reference, heads, inputs: dict, *, distill_weight: float, temperature: float,
                 logits: bool, head_chunk: int):
    """``((1 - w) * CE + w * KD, CE, KD)`` of :func:`_forwards`' outputs (KD left out when ``logits`` is false)."""
    mask = inputs.get("attention_mask")
    zero = torch.zeros((), device=inputs["input_ids"].device)
    kd_weight = distill_weight if logits else 0.0
    if heads is not None:
        if not (1.0 - distill_weight or kd_weight):  # hidden states alone: nothing goes through the heads
            return zero, zero, zero
        return head_loss(outputs.logits, heads[0].weight, inputs["labels"], teacher_hidden=reference.logits,
                         teacher_weight=heads[1].weight, kd_mask=mask, ce_weight=1.0 - distill_weight,
                         kd_weight=kd_weight, temperature=temperature, chunk=head_chunk)
    ce = getattr(outputs, "loss", None)
    if ce is None and distill_weight < 1:
        raise ValueError("the model computes no loss of its own (a sentence encoder): set distill weight 1")
    ce = zero if ce is None else ce
    kd = distillation_loss(outputs.logits, reference.logits, temperature, mask) if logits else zero
    return (1.0 - distill_weight) * ce + distill_weight * kd, ce, kd


def distillation_step(model: nn.Module, teacher: nn.Module | None, inputs: dict, *, distill_weight: float,
                      temperature: float = 1.0, head_chunk: int = 0):
    """``(loss, ce, kd)`` of one batch: ``(1 - w) * CE + w * KD`` with the teacher's forward under no_grad.
    ``head_chunk`` > 0: from hidden states, chunked over tokens (no B x T x V logits); 0: from full logits."""
    outputs, reference, heads = _forwards(model, teacher, inputs, head_chunk=head_chunk, hidden_states=False)
    return _logit_terms(outputs, reference, heads, inputs, distill_weight=distill_weight, temperature=temperature,
                        logits=True, head_chunk=head_chunk)


def layerwise_step(model: nn.Module, teacher: nn.Module, inputs: dict, *, distill_weight: float,
                   temperature: float = 1.0, logits: bool = True, hidden_weight: float = 1.0,
                   sink_weight: float = 0.0, embedding_weight: float = 0.0, head_chunk: int = 0):
    """``(loss, ce, kd, hidden, embedding)``: ``(1 - w) * CE + w * (KD + h * H + e * E)`` with H the layer-wise loss
    (:func:`hf_normswap.layerwise.relative_hidden_error`) and E the pooled-embedding cosine error
    (:func:`hf_normswap.layerwise.embedding_cosine_error`); KD is left out when ``logits`` is false. A model without a
    loss of its own (a sentence encoder) needs ``w = 1``. ``head_chunk`` as :func:`distillation_step`."""
    outputs, reference, heads = _forwards(model, teacher, inputs, head_chunk=head_chunk, hidden_states=True)
    head_part, ce, kd = _logit_terms(outputs, reference, heads, inputs, distill_weight=distill_weight,
                                     temperature=temperature, logits=logits, head_chunk=head_chunk)
    mask = inputs.get("attention_mask")
    zero = torch.zeros((), device=inputs["input_ids"].device)
    hidden = relative_hidden_error(outputs.hidden_states, reference.hidden_states, mask, sink_weight) \
        if hidden_weight > 0 else zero
    embedding = embedding_cosine_error(outputs.hidden_states[-1], reference.hidden_states[-1], mask) \
        if embedding_weight > 0 else zero
    return head_part + distill_weight * (hidden_weight * hidden + embedding_weight * embedding), ce, kd, hidden, \
        embedding


def training_loss(model: nn.Module, teacher: nn.Module, inputs: dict, *, distill_weight: float,
                  temperature: float = 1.0, logits: bool = True, hidden_weight: float = 0.0, sink_weight: float = 0.0,
                  embedding_weight: float = 0.0, head_chunk: int = 0):
    """``(loss, ce, kd, hidden, embedding)`` of one batch as :class:`NormSwapTrainer` trains (``distill_weight`` > 0):
    the layer-wise step when there is a hidden-state term (the models' hidden states are needed), else the
    distillation step; ``head_chunk`` > 0: CE and KD through the chunked head loss."""
    if hidden_weight > 0 or embedding_weight > 0:
        return layerwise_step(model, teacher, inputs, distill_weight=distill_weight, temperature=temperature,
                              logits=logits, hidden_weight=hidden_weight, sink_weight=sink_weight,
                              embedding_weight=embedding_weight, head_chunk=head_chunk)
    loss, ce, kd = distillation_step(model, teacher, inputs, distill_weight=distill_weight, temperature=temperature,
                                     head_chunk=head_chunk)
    return loss, ce, kd, torch.zeros(()), torch.zeros(())


def head_chunk_for(model: nn.Module, teacher: nn.Module, requested: int) -> int:
    """``requested`` when both output heads are plain linear maps (:func:`head_is_plain`) and the fused loss is
    installed (:func:`fused_head_available`), else 0 (full logits)."""
    plain = requested and fused_head_available() and head_is_plain(model) and head_is_plain(teacher)
    return int(requested) if plain else 0


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose output head is the one to bypass)."""
    return getattr(model, "module", model)
