"""Capture the inputs of norm layers with forward hooks, in memory bounded by a cap, not by the data size.

Each hooked norm gets a :class:`Reservoir`: a uniform random sample (reservoir sampling, Vitter's algorithm R) of at
most ``max_tokens`` token vectors out of every token that streamed through it, plus a separate reservoir of at most
``max_first`` first-position tokens (the attention sink: on SmolLM2 its RMS is ~170x that of other tokens from
layer 12 on, so it is kept and flagged apart instead of being left to chance), plus running statistics over every
token (count, sum of squared RMS). Padding tokens (``attention_mask == 0``) are never stored. Vectors are stored
in fp32 on the CPU, whatever the model's dtype and device, so memory per norm is at most
``(max_tokens + max_first) * C * 4`` bytes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..model_inputs import StopForward

DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_FIRST = 256


class Reservoir:
    """Uniform sample of at most ``capacity`` rows out of all rows offered, in fixed memory."""

    def __init__(self, capacity: int, size: int, generator: torch.Generator):
        self.capacity = int(capacity)
        self.buffer = torch.empty(0, size)
        self.seen = 0
        self.generator = generator

    def add(self, rows: torch.Tensor) -> None:
        rows = rows.detach().to("cpu", torch.float32).reshape(-1, self.buffer.shape[1])
        n = rows.shape[0]
        if n == 0 or self.capacity == 0:
            self.seen += n
            return
        free = max(0, min(self.capacity - self.buffer.shape[0], n))
        if free:
            self.buffer = torch.cat([self.buffer, rows[:free]])
        rest = rows[free:]
        if rest.shape[0]:
            # algorithm R, vectorized: row t (0-based over everything seen) replaces slot j ~ U{0..t} when j < capacity
            t = torch.arange(self.seen + free, self.seen + n, dtype=torch.float64)
            j = (torch.rand(t.shape, generator=self.generator, dtype=torch.float64) * (t + 1)).long()
            keep = j < self.capacity
            # a later row that draws the same slot wins, as in the sequential algorithm
            self.buffer[j[keep]] = rest[keep]
        self.seen += n

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class NormSample:
    """What is kept for one norm: a reservoir of ordinary tokens and one of first-position tokens."""

    def __init__(self, size: int, max_tokens: int, max_first: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = Reservoir(max_tokens, size, generator)
        self.first = Reservoir(max_first, size, generator)

    @property
    def count(self) -> int:
        """Real (non-padding) tokens seen, kept or not."""
        return self.tokens.seen + self.first.seen

    def add(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """``x`` (..., C); ``mask`` (B, T) of 1 for real tokens, 0 for padding, when x is (B, T, ..., C)."""
        x = x.detach()
        size = x.shape[-1]
        first = None
        if mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(mask.shape):
            mask = mask.to(x.device).bool()
            position = mask.long().cumsum(1) - 1  # position among real tokens (left padding safe)
            first = x[mask & (position == 0)].reshape(-1, size)
            x = x[mask & (position > 0)].reshape(-1, size)
        else:
            x = x.reshape(-1, size)
        self.tokens.add(x)
        if first is not None:
            self.first.add(first)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, is_first flag): the sampled token vectors with the first-position ones appended and flagged."""
        rows = torch.cat([self.tokens.buffer, self.first.buffer])
        flags = torch.zeros(rows.shape[0], dtype=torch.bool)
        flags[self.tokens.buffer.shape[0]:] = True
        return rows, flags

    def nbytes(self) -> int:
        return self.tokens.nbytes() + self.first.nbytes()


class Capture:
    """Forward pre-hooks that feed the inputs of named modules into bounded samples.

    Set ``capture.mask`` to the current batch's attention mask before each forward pass. With ``stop_after`` a
    name, the forward is aborted (``StopForward``) as soon as that module's input is captured, so a pass costs only
    the work up to it.
    """

    def __init__(self, modules: dict[str, nn.Module], *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_first: int = DEFAULT_MAX_FIRST, seed: int = 0, stop_after: str | None = None):
        self.samples = {}
        self.mask: torch.Tensor | None = None
        self._handles = []
        for i, (name, module) in enumerate(modules.items()):
            size = _feature_size(module)
            self.samples[name] = NormSample(size, max_tokens, max_first, seed + i)
            self._handles.append(module.register_forward_pre_hook(self._hook(name, name == stop_after)))

    def _hook(self, name: str, stop: bool):
        def hook(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor):
                self.samples[name].add(x, self.mask)
            if stop:
                raise StopForward
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def first_call_inputs(module: nn.Module, run) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of ``module``'s first call while ``run()`` executes; the forward stops right there."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((args, dict(kwargs)))
        raise StopForward

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    except StopForward:
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


@contextmanager
def capturing(modules: dict[str, nn.Module], **kwargs):
    capture = Capture(modules, **kwargs)
    try:
        yield capture
    finally:
        capture.remove()


def _feature_size(module: nn.Module) -> int:
    for attr in ("normalized_shape",):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
        if value:
            return int(tuple(value)[-1])
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[-1])
    for attr in ("hidden_size", "dim"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    raise ValueError(f"cannot tell the feature size of {type(module).__name__}")
