"""hf-normswap: replace LayerNorm / RMSNorm in Hugging Face models with element-wise normalizers (``modules.METHODS``).

The package follows the pipeline; each stage imports only the ones above it:

    modules, kernels                     the element-wise normalizers and their fused path
    model_inputs, placement, precision, validation, data      shared helpers
    discovery/      find the norms and label their roles
    checkpoint/     load originals; save, load and push converted checkpoints
    calibration/    fit the new parameters to the model's activations
    convert         the verb: plan, inspect, convert (and fold, for inference)
    evaluation/     perplexity, sentence embeddings, per-norm sensitivity
    training/       recovery against the original: distillation losses, progressive swap, the recipe's settings
    cli             the ``normswap`` command

Importing the package changes nothing outside it; ``convert`` and ``load`` install the fused element-wise path
(``hf_normswap.kernels``) the first time they run.
"""

from .version import __version__
from .calibration.calibrate import CalibrationConfig
from .checkpoint.loading import load
from .checkpoint.save_load import CheckpointError, save_pretrained
from .convert import ConversionError, ConversionReport, ConvertConfig, convert, inspect, plan
from .discovery.norms import NormInfo, find_norms
from .evaluation.perplexity import EvaluationError, evaluate
from .modules import ELN, Derf, DyISRU, DyT, ElementwiseNorm
from .validation import ValidationError

__all__ = [
    "__version__",
    "convert", "inspect", "plan", "load", "save_pretrained", "evaluate", "find_norms",
    "ConvertConfig", "CalibrationConfig", "ConversionReport", "NormInfo",
    "DyT", "ELN", "DyISRU", "Derf", "ElementwiseNorm",
    "ConversionError", "CheckpointError", "EvaluationError", "ValidationError",
]
