"""Linear layers run on weights packed once for oneDNN: inference with frozen weights on the CPU, as in sampling.

On the CPU a bf16 ``F.linear`` reorders its weight into oneDNN's blocked layout at every call. For the few rows
of a decoding step (one token a sequence) that reorder costs about as much as the product itself, and sampling
multiplies by the same weights hundreds of times. :func:`packed_linears` reorders each ``nn.Linear``'s weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the op that inductor's freezing pass uses, without compiling the
model) and runs the layers on the packed copies for the duration. Whether that is faster depends on the CPU, the
dtype and the shapes, so it is timed on the model's own layers first and used only where it wins.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable

import torch
from torch import nn

from ..precision import interleaved_seconds

MARGIN = 0.05  # packing must save at least this share of the layers' time, so that noise never picks a slower one
REPETITIONS = 3

logger = logging.getLogger(__name__)


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _packable(model: nn.Module) -> list[nn.Linear]:
    """The model's plain ``nn.Linear`` layers (no subclasses: LoRA and quantized layers run their own forward)
    with CPU weights in fp32 or bf16; none where this torch has no oneDNN linear ops."""
    if not _ops_available():
        return []
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
            and m.weight.dtype in (torch.float32, torch.bfloat16)
            and (m.bias is None or m.bias.dtype == m.weight.dtype)]


def _packed_forward(inputs: torch.Tensor, *, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")


def packing_speedup(layers: list[nn.Linear], packed: list[torch.Tensor], rows: int, *,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one pass over ``layers`` on ``rows`` rows with their own weights over seconds with ``packed``:
    the fastest of :data:`REPETITIONS` interleaved rounds (:func:`precision.interleaved_seconds`; a short timing is
    easily interrupted on a shared machine, the fastest is its own speed)."""
    shared = {(layer.in_features, layer.weight.dtype): torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
              for layer in layers}  # one input a shape
    inputs = [shared[layer.in_features, layer.weight.dtype] for layer in layers]
    fast = [functools.partial(_packed_forward, packed=weight, bias=layer.bias) for layer, weight in zip(layers, packed)]

    def one_pass(forwards) -> Callable[[], None]:
        return lambda: [forward(x) for forward, x in zip(forwards, inputs)]

    steps = {"plain": one_pass([layer.forward for layer in layers]), "packed": one_pass(fast)}
    with torch.no_grad():
        seconds = interleaved_seconds(steps, repetitions=REPETITIONS, clock=clock, statistic=min)
    return seconds["plain"] / seconds["packed"]


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int):
    """Inside: the model's ``nn.Linear`` layers run on packed copies of their weights, where a timing on ``rows``
    rows (the rows a call will multiply, e.g. the sequences of a batch) finds that at least :data:`MARGIN` faster;
    else as they are. Yields whether they were packed. The weights must not change inside (the copies would not
    follow them). Memory: one more copy of the layers' weights for the duration."""
    layers = _packable(model)
    packed = []
    if layers:
        try:
            with torch.no_grad():
                packed = [torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows) for layer in layers]
            speedup = packing_speedup(layers, packed, rows)
        except RuntimeError as error:  # a oneDNN build without this dtype's kernels
            logger.info("linear layers stay unpacked: %s", error)
            speedup = 0.0
        else:
            logger.info("linear layers on packed weights ran at %.2fx their own speed at %d rows", speedup, rows)
        if speedup < 1 / (1 - MARGIN):
            layers, packed = [], []
    try:
        for layer, weight in zip(layers, packed):
            layer.forward = functools.partial(_packed_forward, packed=weight, bias=layer.bias)
        yield bool(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
