"""A job's two ``linear`` paths: linearising a model converted already (``to: linear`` on a DyT / ELN checkpoint,
``linearise.py``) and saving as the original architecture (``output.stock``, ``stock_export.py``)."""

from __future__ import annotations

from ..calibration.defaults import NONE
from ..checkpoint.stock_export import export_stock
from ..data import model_batches
from ..linearise import linearise
from ..modules import ElementwiseNorm

LINEARISE_BLOCKS, LINEARISE_LEN = 8, 256  # the text the saturation is measured on, without --calib-blocks / -len


def is_converted(model) -> bool:
    return any(isinstance(module, ElementwiseNorm) for module in model.modules())


def linearise_converted(model, tokenizer, calibration, max_saturation: float) -> None:
    """Linearise a converted model on the saturation measured over the ``calibration`` section's text (default
    builtin)."""
    spec = calibration.data if calibration.data and calibration.data != NONE else "builtin"
    batches, _ = model_batches(model, spec, tokenizer, num_blocks=calibration.num_blocks or LINEARISE_BLOCKS,
                               block_len=calibration.block_len or LINEARISE_LEN, batch_size=4)
    print(linearise(model, batches, max_saturation))


def save_stock(model, tokenizer, output) -> None:
    directory, eps, difference = export_stock(model, output.directory, tokenizer=tokenizer,
                                              overwrite=output.overwrite)
    print(f"saved to {directory} as its original architecture: epsilon {eps:.0e}, logits within {difference:.1e} "
          "of the linear model's")
