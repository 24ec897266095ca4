"""Training precision: fp32, or bf16 autocast, chosen by timing a matmul and the model's own step on this machine.

bf16 autocast runs the matmuls in bf16 and keeps everything else as it was: master weights, gradients and the
optimizer state stay fp32, and the element-wise modules compute in fp32 whatever their input. Whether it pays depends
on the CPU: with AMX tiles a SmolLM2 step runs about 2.5x faster, with AVX512-BF16 alone the recipe's step ran
1.4-1.6x faster (BENCHMARKS.md, "Training throughput"), and a CPU with neither has no bf16 matrix instructions to
gain from: there a bf16 matmul ran about 45x slower than fp32 (AVX2 alone, BENCHMARKS.md "Training throughput"), and
one bf16 step of SmolLM2 took minutes. ``auto`` therefore measures instead of guessing, in two stages: a matmul of
a fraction of a second first, and where bf16 is not clearly slower there, a few interleaved fp32 / bf16
repetitions of the step itself; it takes bf16 only when the step is faster by a margin.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

PRECISIONS = ("auto", "fp32", "bf16")
MARGIN = 0.05  # bf16 must save at least this share of the fp32 step time, so that noise never picks a slower one
# A bf16 matmul below this share of fp32's speed means no bf16 matrix instructions: the step is not timed in bf16.
# Far below any CPU with them (small shapes blunt their gain), far above the 0.02 of a CPU without (AVX2 alone).
SLOW_MATMUL = 0.5
MATMUL_SHAPE = (128, 512, 512)  # rows x inner x columns: ~1 ms in fp32, ~50 ms in bf16 on AVX2 alone

logger = logging.getLogger(__name__)


@dataclass
class PrecisionChoice:
    """The precision to train in and, for ``auto``, the probes' results: the matmul's speed ratio, and the median
    seconds per step of each precision where the step was timed."""

    precision: str
    requested: str
    fp32_seconds: float | None = None
    bf16_seconds: float | None = None
    matmul_speedup: float | None = None  # fp32 seconds / bf16 seconds of :data:`MATMUL_SHAPE`

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def describe(self) -> str:
        if self.requested != "auto":
            return f"precision {self.precision} (set)"
        if self.fp32_seconds is None:
            return (f"precision {self.precision} (auto: a bf16 matmul ran at {self.matmul_speedup:.3g}x fp32's speed, "
                    f"no bf16 matrix instructions: the step was not timed in bf16)")
        return (f"precision {self.precision} (auto: probe step fp32 {self.fp32_seconds:.3g}s, bf16 autocast "
                f"{self.bf16_seconds:.3g}s, {self.fp32_seconds / self.bf16_seconds:.2f}x; matmul "
                f"{self.matmul_speedup:.3g}x)")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(bf16: bool, device: torch.device | str = "cpu"):
    """bf16 autocast on ``device``'s type when ``bf16``, else nothing."""
    device_type = torch.device(device).type
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


@contextlib.contextmanager
def weights_in(model: torch.nn.Module, dtype: torch.dtype):
    """The model's floating-point parameters in ``dtype`` for the duration: the originals are kept aside and put
    back afterwards, so nothing is rounded (memory: the originals plus the cast copies)."""
    kept = [(p, p.data) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    try:
        for parameter, data in kept:
            parameter.data = data.to(dtype)
        yield model
    finally:
        for parameter, data in kept:
            parameter.data = data


def _synchronized(device_type: str, timer: Callable[[], float]) -> Callable[[], float]:
    if device_type == "cuda":
        return lambda: (torch.cuda.synchronize(), timer())[1]
    return timer


def matmul_speedup(device: torch.device | str = "cpu", repetitions: int = 5) -> float:
    """fp32 seconds / bf16-autocast seconds of one matmul of :data:`MATMUL_SHAPE` (the casts included, as in a
    step), timed by :func:`probe` with the fastest of its rounds (a millisecond matmul is easily interrupted on a
    shared machine; the fastest is its own speed). Under a second where a bf16 step would take minutes."""
    rows, inner, columns = MATMUL_SHAPE
    inputs, weight = torch.full((rows, inner), 0.5, device=device), torch.full((inner, columns), 0.5, device=device)
    fp32, bf16 = probe(lambda: inputs @ weight, device=device, repetitions=repetitions, statistic=min)
    return fp32 / bf16


def interleaved_seconds(steps: dict[str, Callable[[], object]], *, repetitions: int = 3,
                        clock: Callable[[], float] = time.perf_counter,
                        statistic: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """``statistic`` of each step's seconds: one untimed warm-up of each, then ``repetitions`` timed rounds with the
    steps interleaved, so that a load change on a shared machine hits all of them."""
    times = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(repetitions):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    return {name: statistic(seconds) for name, seconds in times.items()}


def probe(step: Callable[[], object], *, device: torch.device | str = "cpu", repetitions: int = 3,
          timer: Callable[[], float] = time.perf_counter,
          statistic: Callable[[list[float]], float] = statistics.median) -> tuple[float, float]:
    """Seconds of ``step()`` in fp32 and under bf16 autocast (:func:`interleaved_seconds`, median by default). The
    random state is restored afterwards, so probing does not change what training draws."""
    device_type = torch.device(device).type

    def under(bf16: bool) -> Callable[[], object]:
        def run():
            with autocast(bf16, device):
                return step()
        return run

    with torch.random.fork_rng(devices=[] if device_type != "cuda" else None):
        seconds = interleaved_seconds({"fp32": under(False), "bf16": under(True)}, repetitions=repetitions,
                                      clock=_synchronized(device_type, timer), statistic=statistic)
    return seconds["fp32"], seconds["bf16"]


def choose_precision(precision: str, step: Callable[[], object] | None = None, *,
                     device: torch.device | str = "cpu", repetitions: int = 3,
                     timer: Callable[[], float] = time.perf_counter) -> PrecisionChoice:
    """``fp32`` / ``bf16`` as given; ``auto``: fp32 when a bf16 matmul runs below :data:`SLOW_MATMUL` of fp32's
    speed (:func:`matmul_speedup`), else bf16 when the probe of ``step`` finds it at least :data:`MARGIN` faster,
    else fp32. Logs the probes' numbers."""
    check_precision(precision)
    if precision != "auto":
        return PrecisionChoice(precision, precision)
    if step is None:
        raise ValueError("precision 'auto' needs a step to time")
    speedup = matmul_speedup(device)
    if speedup < SLOW_MATMUL:
        choice = PrecisionChoice("fp32", "auto", matmul_speedup=speedup)
    else:
        fp32, bf16 = probe(step, device=device, repetitions=repetitions, timer=timer)
        choice = PrecisionChoice("bf16" if bf16 < (1 - MARGIN) * fp32 else "fp32", "auto", fp32, bf16, speedup)
    logger.info(choice.describe())
    return choice


def forward_backward(run: Callable[[], object], params: list[torch.nn.Parameter]) -> None:
    """A probe step: ``run()`` (a forward) and a backward of its first output to ``params`` through
    ``torch.autograd.grad``, whose gradients are dropped, so that no ``.grad`` changes. Without ``params``: the
    forward alone."""
    with torch.enable_grad() if params else torch.no_grad():
        output = run()
        first = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
        if params:
            torch.autograd.grad(first.float().square().mean(), params, allow_unused=True)
