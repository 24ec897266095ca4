"""Cross-entropy and distillation KL over the vocabulary, from final hidden states and the output head, in chunks.

A language model's logits are the largest tensors of a training step: for SmolLM2 (vocabulary 49,152) a batch of
2 x 512 tokens makes 201 MB of fp32 logits, and distillation holds the student's, the teacher's, and softmax copies
of both for the backward pass. Liger-Kernel's fused linear JSD loss (``liger_kernel.chunked_loss``, the ``[gpu]``
extra; at ``beta=0`` the forward KL) makes the logits of a chunk of tokens from the hidden states and the head
weight, turns them into the loss and its gradients in one compiled function, and drops them: no B x T x V tensor
ever exists. On SmolLM2's head it ran 1.40x faster than the hand-written chunked loss it replaced, in 0.85x its
memory (BENCHMARKS.md, "The distillation loss alone"). Without it the recipe takes full logits
(:func:`fused_head_available`).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
DEFAULT_CHUNK = 256


@functools.cache
def fused_head_available() -> bool:
    """Whether Liger-Kernel's chunked losses import (``pip install hf-normswap[gpu]``; they need Triton)."""
    try:
        # lazy: Liger-Kernel is optional (hf-normswap[gpu]); this is the check whether it is there
        from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction  # noqa: F401
    except ImportError:
        return False
    return True


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one position (the last position gets no target), as the causal-LM loss uses."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
              teacher: tuple[torch.Tensor, torch.Tensor] | None = None, kd_mask: torch.Tensor | None = None,
              weights: tuple[float, float] = (1.0, 0.0), temperature: float = 1.0, chunk: int = DEFAULT_CHUNK):
    """``(loss, ce, kd)``: ``loss = ce_weight * CE + kd_weight * KD`` (``weights``) from ``hidden`` (B, T, C)
    through the head ``weight`` (V, C), about ``chunk`` tokens' logits at a time (Liger-Kernel's fused linear JSD
    at ``beta=0``).

    CE is the mean next-token cross-entropy over ``labels`` (B, T; ``-100`` ignored), as a causal LM's own loss.
    KD is ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` averaged over the positions ``kd_mask``
    selects (all when None), the teacher's logits made from ``teacher``, its ``(hidden states, head weight)``;
    with CE beside it, over those of them that have a next-token target (one mask serves both terms in Liger's
    loss).
    """
    from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction  # optional: fused_head_available

    ce_weight, kd_weight = weights
    if kd_weight and teacher is None:
        raise ValueError("kd_weight > 0 needs the teacher's hidden states and head weight")
    size = hidden.shape[-1]
    flat = hidden.reshape(-1, size)
    targets = next_token_targets(labels).reshape(-1)
    mask = torch.ones_like(targets, dtype=torch.bool) if kd_mask is None else kd_mask.reshape(-1).bool()
    zero = flat.new_zeros((), dtype=torch.float32)
    if not kd_weight:  # CE alone: the student stands in for the teacher, at weight 0
        teacher_flat, teacher_w = flat.detach(), weight.detach()
    else:
        teacher_flat = teacher[0].reshape(-1, teacher[0].shape[-1]).detach()
        teacher_w = teacher[1].detach()
        # KD alone: every position of the mask is a target (any token: CE is not computed)
        targets = torch.where(mask, targets if ce_weight else 0, IGNORE)
    soft = float(kd_weight) * temperature ** 2
    both = bool(ce_weight and kd_weight)  # the parts apart: CE then costs a log-softmax more a chunk
    out = LigerFusedLinearJSDFunction.apply(flat, weight, teacher_flat, teacher_w, targets, None, None,
                                            float(ce_weight), soft, 0.0, IGNORE, float(temperature), True,
                                            int(chunk), both)
    if both:
        loss, kd, ce = out
        return loss, ce.detach(), kd.detach() * temperature ** 2
    part = out.detach() / (soft or ce_weight)
    return out, (zero if kd_weight else part), (part * temperature ** 2 if kd_weight else zero)


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
