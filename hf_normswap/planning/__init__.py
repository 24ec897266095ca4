"""The memory plan: what a conversion and a recovery need, host and device, phase by phase, from the config alone.

- ``sizes.py``: the model's sizes, built on the meta device (no weights read).
- ``plan_settings.py``: the settings that change memory (:class:`PlanSettings`).
- ``phases.py``: what one phase holds and the size of each term (activations, calibration's caches).
- ``recipe_memory.py``: the phases of ``normswap convert`` and of the recipe, under DDP or FSDP2.
- ``plan.py``: :func:`plan`, the peak, whether it fits, the smallest change that does.
- ``recipe_plan.py``: the plan settings of a resolved recovery run (``training.recovery_run``; what the recipe logs
  at start).
- ``disk.py``: how much of a model calibration keeps in memory within a limit; the rest stays on disk.
- ``normswap plan MODEL`` is ``hf_normswap/cli/plan.py``.
"""

from .memory_plan import MemoryPlan, plan
from .plan_settings import PlanSettings
from .recipe_plan import run_plan_settings
from .sizes import ModelSizes, PlanError, model_sizes

__all__ = ["MemoryPlan", "ModelSizes", "PlanError", "PlanSettings", "model_sizes", "plan", "run_plan_settings"]
