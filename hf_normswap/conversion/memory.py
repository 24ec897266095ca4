"""How much of a model a conversion keeps in host memory: the weights beyond what fits (``max_host_memory``, else
the memory free) stay on disk, and calibration brings one block in at a time (``planning.disk``)."""

from __future__ import annotations

from ..calibration.defaults import DEFAULTS, NONE
from ..checkpoint.loading import resolve
from ..planning.disk import free_host_memory, weights_in_memory
from ..planning.plan_settings import parse_bytes
from ..planning.sizes import PlanError
from ..surgery import ConversionError
from ..validation import first_line


def weights_memory(job) -> int | None:
    """The bytes of weights the conversion keeps in host memory, the rest left on disk; None: the whole model fits,
    or there is no calibration to bound. Said in one line."""
    given = job.max_host_memory is not None
    try:
        limit = parse_bytes(job.max_host_memory, "--max-host-memory") if given else free_host_memory()
    except PlanError as error:
        raise ConversionError(str(error)) from None
    calibration = job.calibration
    if calibration.data == NONE or (not given and "gguf_file" in resolve(job.model)[1]):  # a GGUF file loads whole
        return None
    config = calibration.calibration_config()
    if not calibration.data:  # the default's sequences
        default = DEFAULTS["samples"]
        config.num_blocks = calibration.num_blocks or default.num_blocks
        config.block_len = calibration.block_len or default.block_len
    try:
        weights = weights_in_memory(job.model, config, limit)
    except (PlanError, OSError, ValueError) as error:
        if given:
            raise ConversionError(f"--max-host-memory: {first_line(error)}") from None
        return None  # a model the plan cannot read loads as always
    if weights is None:
        return None
    within = "--max-host-memory" if given else "the free memory"
    for flag, value in (("--fold", job.fold), ("--budget-ppl-ratio", job.budget.limit())):
        if value:
            raise ConversionError(f"{flag} needs the whole model in memory, and {job.model} keeps weights on disk "
                                  f"within {within}: allow more memory or drop {flag}")
    print(f"weights beyond {weights / 2**30:.1f} GiB stay on disk: calibrating block by block "
          f"({within}: {limit / 2**30:.1f} GiB)")
    return weights
