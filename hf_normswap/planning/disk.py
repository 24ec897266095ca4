"""How much of a model calibration may keep in host memory within a limit (``--max-host-memory``, or the memory
this machine has free): the rest of its weights stays on disk and calibration brings one block in at a time
(``hf_normswap/offload.py``)."""

from __future__ import annotations

from .recipe_memory import conversion_phases
from .recipe_plan import calibration_settings
from .plan_settings import PlanSettings
from .sizes import PlanError, model_sizes


def free_host_memory() -> int:
    """Bytes this machine can give without swapping (``MemAvailable``)."""
    import psutil  # lazy: no dependency of ours (accelerate's), needed only where free memory is read

    return psutil.virtual_memory().available


def beside_the_weights(sizes, settings: PlanSettings) -> int:
    """Host bytes calibration from disk needs beside the weights it keeps in memory: the block pass's runtime,
    hidden states between blocks and block being fitted (no end-to-end steps on disk)."""
    return max(phase.host_main for phase in conversion_phases(sizes, settings.replace(weights_on_disk=True)))


def weights_in_memory(model, calibration, limit: int) -> int | None:
    """Bytes of ``model``'s weights that a conversion calibrated by ``calibration`` (a ``CalibrationConfig``) may
    hold in host memory within ``limit``, or None when the whole model fits. On disk, calibration skips its
    end-to-end steps (a backward through every block would hold all their weights), so what it needs beside the
    weights is :func:`beside_the_weights`. Raises :class:`PlanError` when even that exceeds ``limit``."""
    sizes = model_sizes(model)
    settings = PlanSettings(**calibration_settings(calibration))
    if max(phase.host_main for phase in conversion_phases(sizes, settings)) <= limit:
        return None
    beside = beside_the_weights(sizes, settings)
    if beside >= limit:
        raise PlanError(f"a host memory of {limit / 2**20:,.1f} MiB is not above what calibration needs beside the "
                        f"weights ({beside / 2**20:,.1f} MiB): allow more, or calibrate on fewer or shorter sequences")
    return limit - beside
