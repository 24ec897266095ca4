"""Each repeated block of the student and the original compiled, for a GPU step.

A GPU step at the recipe's CPU batch is bound by the host's Python, not the GPU (BENCHMARKS.md, "On a GPU"). Two
changes lift the bound: many more tokens a step (the largest batch the memory plan fits on the device, the rest by
gradient accumulation: ``recovery_run.step_batches``), and each repeated block compiled
(:func:`compile_blocks`: inductor fuses the block's element-wise work and launches far fewer kernels). A compile of
a model's first step can take minutes; inductor's caches are kept in the run directory (``OUTPUT/compile-cache``),
so a resumed run, or the next chunk of a ``max_minutes`` run, reads them instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

COMPILE_CACHE = "compile-cache"


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
