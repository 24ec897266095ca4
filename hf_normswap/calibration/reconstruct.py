"""Block-wise reconstruction: during sequential calibration, fit a block's own weights beside its new norms.

Block tuning (``block_pass.tune_block``) moves only the new modules' parameters so that the converted block, fed the
converted model's hidden states, reproduces the original block's output on the original's hidden states. An
element-wise function cannot divide a token by its own scale, so what the norm parameters alone leave is a
per-token scale error that the block's linear layers can absorb. With ``CalibrationConfig.block_weights_lr > 0``
the block's other parameters (attention and MLP weights) join the same Adam steps at that rate, as in BRECQ's and
EfficientQAT's block-wise stage: the whole model is never trained at once, only one block against cached targets.

Memory, for ``N`` calibration sequences of ``L`` tokens in batches of ``B``, hidden size ``d`` in ``b`` bytes (4 for
fp32), one block of ``P`` parameters, ``block_rows`` = ``r`` sequences a step and ``block_steps`` = ``s``; ``R`` =
min(N, max(s * r, 16)) sequences of the original trajectory that tuning reads (block_pass.tuned_rows):

    cache    at most 2 * (N + R) * L * d * b    a block's converted inputs and outputs, the original's inputs
                                                and outputs (activation_cache.py): CPU memory up to
                                                ``cache_memory_mb``, files in TMPDIR past it, with one batch per
                                                list (4 * B * L * d * b) kept from the last file read
    device   P * 4 * 4                          the block's weights, Adam's two moments and their gradient
             + r * L * (one block's activations)   the autograd graph of one step
             + the block's other inputs         masks and position embeddings of every batch (Llama's RoPE:
                                                2 * L * head_dim * 4 bytes a batch, shared by its rows)

SmolLM2-135M (d = 576, P = 3.5M a block, head_dim 64), N = 64, L = 512, s = 240, r = 1 (the recipe configs): a cache of
at most 2 * 128 * 512 * 576 * 4 = 302 MB; on the device 57 MB for the block and its optimizer, 2 MB of position
embeddings for 8 batches. Only the block in its stage is on the compute device (``CalibrationConfig.device``): the
rest of the model stays where it was loaded, so the stage scales to models larger than that device.
"""

from __future__ import annotations

import torch
from torch import nn


def block_weights(block: nn.Module, norms: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``block`` that do not belong to its new norm modules (``norms``, tuned on their own
    groups): the linear weights block-wise reconstruction fits."""
    own = {id(p) for module in norms for p in module.parameters()}
    return [p for p in block.parameters() if id(p) not in own]


def per_token_relative_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``||out - target||^2 / ||target||^2`` of each token (over the last dimension), in fp32: the error block
    tuning (``block_pass``) and layer-wise distillation both minimize."""
    target = target.float()
    return (out.float() - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)
