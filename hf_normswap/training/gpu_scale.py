"""The training step at a GPU's scale: tokens a step from the memory plan, and each block compiled.

On one H200 the recipe's step at 8 x 512 tokens ran at 22,253 tok/s, bound by the host's Python, not the GPU
(BENCHMARKS.md, "On a GPU"). Two changes lift the bound: many more tokens a step (the largest batch the memory plan
fits on the device, the rest by gradient accumulation, :func:`step_batches`), and each repeated block of the student
and of the original compiled (:func:`compile_blocks`: inductor fuses the block's element-wise work and launches far
fewer kernels). A compile of a model's first step can take minutes; inductor's caches are kept in the run directory
(``OUTPUT/compile-cache``), so a resumed run, or the next chunk of a ``max_minutes`` run, reads them instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from torch import nn

COMPILE_CACHE = "compile-cache"
STEP_TOKENS_ON_CUDA = 65536  # llm.c trains GPT-2 124M at 2^19 tokens a step; 2^16 keeps 30M tokens at 450+ steps
BATCHES = (64, 32, 16, 8, 4, 2, 1)  # sequences a process a micro-batch, tried largest first


def step_batches(plan, step_tokens: int, seq_len: int, processes: int) -> tuple[int, int]:
    """``(per-device batch, accumulation)`` for at least ``step_tokens`` tokens a step over ``processes``: the
    largest of :data:`BATCHES` whose memory plan (``plan``, a :class:`~hf_normswap.planning.MemoryPlan` with the
    device's memory) fits, then as many accumulated micro-batches as the rest needs."""
    from ..planning.plan import replan

    whole = max(1, step_tokens // (seq_len * processes))
    fitting = [b for b in BATCHES if b <= whole and replan(plan, batch_size=b).fits] or [1]
    batch = fitting[0]
    return batch, math.ceil(step_tokens / (batch * seq_len * processes))


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the instances of the classes its ``_no_split_modules`` names (decoder / encoder layers),
    the units the FSDP2 recipe shards too."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def keep_compile_cache(run_dir: str | Path) -> None:
    """Inductor's caches (compiled graphs, autotuning, Triton's kernels) in ``run_dir/compile-cache`` unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another: called before anything compiles (inductor fixes the folder at its
    first compile)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(run_dir).resolve() / COMPILE_CACHE))


def scaled_step(run, device_memory: int | None, log):
    """``run`` at ``step_tokens`` tokens a step (on CUDA by default :data:`STEP_TOKENS_ON_CUDA`; elsewhere, unset,
    the training section's own batch), the micro-batch the largest the memory plan fits on the device."""
    from ..planning import PlanError, plan, recipe_settings

    config = run.settings
    step_tokens = config.step_tokens or (STEP_TOKENS_ON_CUDA if run.device.startswith("cuda") else None)
    if not step_tokens:
        return run
    seq = config.block_len
    try:
        memory = plan(run.original, recipe_settings(run, device_memory))
    except (PlanError, OSError, ValueError) as error:  # a model the plan cannot read: the batch as configured
        log(f"step of {step_tokens:,} tokens: no memory plan ({error}), the configured batch")
        batch = run.batch_size
        accumulation = math.ceil(step_tokens / (batch * seq * run.processes))
    else:
        batch, accumulation = step_batches(memory, step_tokens, seq, run.processes)
    log(f"step: {batch} x {seq} tokens x {accumulation} accumulated x {run.processes} processes = "
        f"{batch * seq * accumulation * run.processes:,} tokens (step_tokens {step_tokens:,})")
    return run.with_step(batch, accumulation)


def compile_blocks(models: list[nn.Module]) -> int:
    """Compile each block of ``models`` in place (``nn.Module.compile``: the module keeps its name, hooks and
    parameters, so checkpoints, autocast and the layer-wise hooks see it as before). Blocks of one class share
    their compiled code (parameters are inputs to the graph, not constants). Returns the number compiled."""
    count = 0
    for model in models:
        for block in repeated_blocks(model):
            block.compile(dynamic=False)
            count += 1
    return count
