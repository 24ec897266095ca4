"""Cross-entropy and distillation KL over the vocabulary, from final hidden states and the output head, in chunks.

A language model's logits are the largest tensors of a training step: for SmolLM2 (vocabulary 49,152) a batch of
2 x 512 tokens makes 201 MB of fp32 logits, and distillation holds the student's, the teacher's, and softmax copies
of both for the backward pass. Here the logits of ``chunk`` tokens at a time are made from the hidden states and
the head weight, turned into the loss and its gradient with respect to those logits, and dropped; the gradients of
the hidden states and the head weight are accumulated in the same pass (as Liger-Kernel's fused linear
cross-entropy / JSD do on GPUs), so the backward pass has nothing to recompute and no B x T x V tensor ever exists.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
DEFAULT_CHUNK = 256


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one position (the last position gets no target), as the causal-LM loss uses."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


class _ChunkedHeadLoss(torch.autograd.Function):
    """``ce_weight * CE + kd_weight * T^2 KL(teacher || student)``; gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, kd_mask, ce_weight, kd_weight,
                temperature, chunk):
        n_ce = (targets != IGNORE).sum().clamp_min(1)
        n_kd = kd_mask.sum().clamp_min(1)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        exact = torch.promote_types(hidden.dtype, torch.float32)  # softmax arithmetic and accumulation: fp32 or more
        grad_hidden = torch.zeros_like(hidden, dtype=exact) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=exact) if need_weight else None
        ce_sum = hidden.new_zeros((), dtype=exact)
        kd_sum = hidden.new_zeros((), dtype=exact)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            logits = (h @ weight.T).to(exact)  # the matmul in bf16 under autocast
            grad_logits = torch.zeros_like(logits)
            if ce_weight:
                target = targets[rows]
                valid = target != IGNORE
                log_p = torch.log_softmax(logits, dim=-1)
                safe = target.clamp_min(0)
                picked = log_p.gather(1, safe[:, None]).squeeze(1)
                ce_sum -= (picked * valid).sum()
                grad = log_p.exp_()
                grad[torch.arange(len(safe), device=grad.device), safe] -= 1.0
                grad_logits.add_(grad * valid[:, None], alpha=float(ce_weight / n_ce))
                del log_p, grad
            if kd_weight:
                mask = kd_mask[rows].to(exact)
                student = torch.log_softmax(logits / temperature, dim=-1)
                teacher = torch.log_softmax((teacher_hidden[rows] @ teacher_weight.T).to(exact) / temperature, dim=-1)
                kd_sum += ((teacher.exp() * (teacher - student)).sum(-1) * mask).sum()
                grad = student.exp_().sub_(teacher.exp_())  # d KL / d (logits / T)
                grad_logits.add_(grad * mask[:, None], alpha=float(kd_weight * temperature / n_kd))
                del student, teacher, grad
            if need_hidden:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
            if need_weight:
                grad_weight += grad_logits.T.to(h.dtype) @ h
            del logits, grad_logits
        ce = ce_sum / n_ce
        kd = kd_sum / n_kd * temperature ** 2
        ctx.grads = (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                     None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(ce, kd)
        return ce_weight * ce + kd_weight * kd, ce, kd

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kd):
        grad_hidden, grad_weight = (None if g is None else g * grad_loss for g in ctx.grads)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
              teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
              kd_mask: torch.Tensor | None = None, ce_weight: float = 1.0, kd_weight: float = 0.0,
              temperature: float = 1.0, chunk: int = DEFAULT_CHUNK):
    """``(loss, ce, kd)``: ``loss = ce_weight * CE + kd_weight * KD`` from ``hidden`` (B, T, C) through the head
    ``weight`` (V, C), never holding more than ``chunk`` tokens' logits.

    CE is the mean next-token cross-entropy over ``labels`` (B, T; ``-100`` ignored), as a causal LM's own loss.
    KD is ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` averaged over the positions ``kd_mask``
    selects (all when None), the teacher's logits made from ``teacher_hidden`` and ``teacher_weight``.
    """
    if kd_weight and teacher_hidden is None:
        raise ValueError("kd_weight > 0 needs teacher_hidden and teacher_weight")
    size = hidden.shape[-1]
    flat = hidden.reshape(-1, size)
    targets = next_token_targets(labels).reshape(-1)
    mask = (torch.ones_like(targets, dtype=torch.bool) if kd_mask is None else kd_mask.reshape(-1).bool())
    teacher_flat = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach() if kd_weight else None
    teacher_w = teacher_weight.detach() if kd_weight else None
    return _ChunkedHeadLoss.apply(flat, weight, teacher_flat, teacher_w, targets, mask, float(ce_weight),
                                  float(kd_weight), float(temperature), int(chunk))


@contextmanager
def head_bypassed(model: nn.Module):
    """Within: ``model(...).logits`` holds the hidden states that enter the output head, and the head is yielded,
    so that :func:`head_loss` makes the logits chunk by chunk. The model's own forward still runs (DDP, autocast
    and peft wrappers keep working); only the head's matmul is skipped."""
    head = model.get_output_embeddings()
    head.forward = _identity
    try:
        yield head
    finally:
        del head.forward


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@torch.no_grad()
def head_is_plain(model: nn.Module) -> bool:
    """Whether the logits are exactly ``hidden @ head.weight.T`` (a bias-free linear head, no soft-capping or
    logit scaling after it): checked on a few tokens, since some architectures transform the logits further."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    ids = torch.arange(4, device=head.weight.device)[None]
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids).logits
        with head_bypassed(model):
            hidden = model(input_ids=ids).logits
    finally:
        model.train(was_training)
    return torch.allclose(hidden @ head.weight.T, logits, rtol=1e-4, atol=1e-4)
