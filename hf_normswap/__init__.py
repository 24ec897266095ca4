"""hf-normswap: replace LayerNorm / RMSNorm in Hugging Face models with DyT or ELN (DyISRU)."""

__version__ = "0.1.0"

from .convert import ConversionError, ConversionReport, convert, inspect, plan  # noqa: E402
from .discovery import NormInfo, find_norms  # noqa: E402
from .modules import ELN, DyISRU, DyT, ElementwiseNorm  # noqa: E402
from .checkpoint import CheckpointError, load, save_pretrained  # noqa: E402
from . import kernels  # noqa: E402,F401  (installs the fused DyT / ELN path)

__all__ = [
    "ConversionError", "ConversionReport", "DyISRU", "DyT", "ELN", "ElementwiseNorm", "NormInfo",
    "convert", "find_norms", "inspect", "plan",
    "CheckpointError", "load", "save_pretrained",
]
