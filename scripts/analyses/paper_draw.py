"""The simulation of "Elementwise Layer Normalization": C values from N(0, SIGMA^2), the largest raised by STEP * S
for S = 1..STEPS, and LayerNorm of each (reproduce_paper.py draws it, module_fit.py fits every method to it)."""

from __future__ import annotations

import torch

C, SIGMA, STEP, STEPS = 100, 2.0, 5.0, 9


def simulate(seed: int = 0, channels: int = C, sigma: float = SIGMA, step: float = STEP, steps: int = STEPS):
    """(inputs, outputs) of shape (steps, C): the base draw with its largest value raised by step*S, S = 1..steps,
    and LayerNorm of each, plus the index of the outlier channel."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(channels, generator=generator, dtype=torch.float64) * sigma
    index = int(base.argmax())
    x = base.repeat(steps, 1)
    x[:, index] += step * torch.arange(1, steps + 1, dtype=torch.float64)
    y = torch.nn.functional.layer_norm(x, (channels,), eps=0.0)
    return x, y, index


def outlier_points(x: torch.Tensor, y: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The outliers' points and their mirror images (-x, -y): the data the paper fits."""
    xo, yo = x[:, index], y[:, index]
    return torch.cat([xo, -xo]), torch.cat([yo, -yo])
