"""Block-wise reconstruction: during sequential calibration, fit a block's own weights beside its new norms.

Block tuning (``block_pass.tune_block``) moves only the DyT / ELN parameters so that the converted block, fed the
converted model's hidden states, reproduces the original block's output on the original's hidden states. An
element-wise function cannot divide a token by its own scale, so what the norm parameters alone leave is a
per-token scale error that the block's linear layers can absorb. With ``CalibrationConfig.block_weights_lr > 0``
the block's other parameters (attention and MLP weights) join the same Adam steps at that rate, as in BRECQ's and
EfficientQAT's block-wise stage: the whole model is never trained at once, only one block against cached targets.

Memory, for ``N`` calibration sequences of ``L`` tokens, hidden size ``d``, one block of ``P`` parameters,
``block_rows`` = ``r`` sequences a step and ``block_steps`` = ``s`` (fp32, bytes):

    cache    (N + min(N, max(s * r, 16))) * L * d * 4    converted hidden states of every sequence, original ones of
                                                           the sequences tuning reads (CPU memory)
    block    P * 4 * 4                  weights, Adam's two moments and their gradient
    step     r * L * (activations of one block)   the autograd graph of one block on r sequences

SmolLM2-135M (d = 576, P = 3.5M a block), N = 64, L = 512, r = 1, s = 60: 146 MB of cache, 57 MB for the block; only
one block at a time needs the compute device, so the stage scales to models larger than it.
"""

from __future__ import annotations

from torch import nn


def block_weights(block: nn.Module, norms: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``block`` that do not belong to its new norm modules (``norms``, tuned on their own
    groups): the linear weights block-wise reconstruction fits."""
    own = {id(p) for module in norms for p in module.parameters()}
    return [p for p in block.parameters() if id(p) not in own]
