"""The finiteness gate: a training that diverged (a learning rate far too large, no gradient clipping) leaves weights
that are NaN or infinite, and such a model is never evaluated, saved as the final checkpoint or pushed. The run
stops, non-zero, naming the step where its loss first was not finite."""

from __future__ import annotations

import math

import torch
from accelerate.utils import gather_object

from .recipe_settings import stopped


def non_finite_tensors(model) -> int:
    """How many weight tensors of ``model`` hold a NaN or an infinity: this process's shards of a sharded one."""
    bad = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # an FSDP2 DTensor: its own shard
        bad += local.numel() > 0 and not local.is_meta and not bool(torch.isfinite(local).all())
    return bad


def first_non_finite_loss(history: list[dict]) -> int | None:
    """The step of the first logged training loss that is not a finite number, or None."""
    for row in history:
        loss = row.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return row.get("step")
    return None


def check_finite(model, trainer, processes: int) -> None:
    """Stop the run, on every process (of ``processes``), when a weight of the trained ``model`` is not finite."""
    bad = non_finite_tensors(model)
    if processes > 1:  # shards differ: the gate is every process's
        bad = sum(gather_object([bad]))
    if not bad:
        return
    steps = [s for s in (trainer.diverged_at, first_non_finite_loss(trainer.state.log_history)) if s is not None]
    where = (f"its loss is not finite from step {min(steps)} on" if steps else
             f"its weights are not finite after step {trainer.state.global_step}")
    raise stopped(f"the training diverged: {where}, and its weights hold NaN or infinity; nothing "
                  "is saved as final or pushed: lower lr.base / lr.shape / lr.gamma or keep training.max_grad_norm "
                  "above 0, and start over with resume=false or a new output_dir (its checkpoints from then on hold "
                  "the diverged weights)")
