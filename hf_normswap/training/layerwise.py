"""Layer-wise distillation: every block's output of the converted model pulled toward the original's.

The logit KL gives training one scalar of supervision per token, at the end of the network; an element-wise norm
changes every block's input at once, so each block's output carries its own error signal. The loss here is, per
block and per token, the squared error of the converted hidden state relative to the original's squared norm

    ||h_student - h_original||^2 / ||h_original||^2

(scale-free: SmolLM2's residual stream grows by two orders of magnitude with depth, and an unnormalized MSE would
be all last blocks), averaged over tokens and blocks. The first position (the attention sink, RMS ~1000 against
~5-25 for other tokens) gets the weight ``sink_weight`` relative to an ordinary token: 0 masks it.
"""

from __future__ import annotations

import torch

from ..calibration.reconstruct import per_token_relative_error
from ..model_inputs import mean_pool


def token_weights(hidden: torch.Tensor, mask: torch.Tensor | None, sink_weight: float = 0.0):
    """``(weights, their sum)`` of the tokens of ``hidden`` ``(batch, seq, dim)`` in a per-token mean: 1, the first
    position ``sink_weight``, padding (``mask`` 0) 0."""
    weights = torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.float32)
    weights[:, 0] = sink_weight
    if mask is not None:
        weights = weights * mask.to(weights)
    return weights, weights.sum().clamp_min(1e-12)


def relative_hidden_error(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...],
                          mask: torch.Tensor | None = None, sink_weight: float = 0.0) -> torch.Tensor:
    """Mean over layers of the per-token relative squared error of ``student`` hidden states to ``teacher``'s.

    ``student`` / ``teacher``: the models' ``hidden_states``, each ``(batch, seq, dim)``; the first (the
    embeddings) is skipped: a decoder's does not depend on the norms, and an encoder's embedding norm shows in the
    first block's output. ``mask``: ``(batch, seq)`` of tokens that count.
    """
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student hidden states against {len(teacher)} of the teacher")
    weights, total = token_weights(teacher[0], mask, sink_weight)
    errors = []
    for s, t in zip(student[1:], teacher[1:]):
        errors.append((per_token_relative_error(s, t) * weights).sum() / total)
    return torch.stack(errors).mean()


def embedding_cosine_error(student_last: torch.Tensor, teacher_last: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over rows of ``1 - cosine`` between the mean-pooled last hidden states (a sentence encoder's embedding,
    :func:`hf_normswap.model_inputs.mean_pool`): the direction its users compare, free of the per-token scale an
    element-wise norm cannot set."""
    return 1.0 - torch.nn.functional.cosine_similarity(mean_pool(student_last, mask), mean_pool(teacher_last, mask),
                                                       dim=-1).mean()
