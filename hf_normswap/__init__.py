"""hf-normswap: replace LayerNorm / RMSNorm in Hugging Face models with element-wise normalizers or a fixed linear
scale (``modules.METHODS``).

The package follows the pipeline, bottom layer first; a layer imports only the layers listed before it (siblings
on one line not each other). pyproject.toml's import-linter contract holds the same list, top first:

    version | modules | atomic_write                the element-wise normalizers; whole-or-absent file writes
    triton_kernels                                  their CUDA kernels
    offload                                         weights kept on disk
    kernels | placement | precision | validation    the fused path, --device / --dtype, fp32 / bf16, value checks
    model_inputs                                    what a model takes and returns
    settings                                        the settings reader (YAML and dotted overrides)
    data                                            text sources, the original's samples, token blocks
    discovery                                       find the norms and label their roles
    checkpoint                                      load originals; save, load and push converted checkpoints
    calibration                                     fit the new parameters to the model's activations
    planning                                        the memory plan
    surgery | fold | linearise                      the verb: plan, inspect, convert; folding; linearising
    evaluation                                      perplexity, sentence embeddings, per-norm sensitivity
    conversion                                      a conversion as one job (``run_job``), as ``normswap convert``
    training                                        recovery against the original (the recipe)
    cli                                             the ``normswap`` command

Importing the package changes nothing outside it; ``convert`` and ``load`` install the fused element-wise path
(``hf_normswap.kernels``) the first time they run.
"""

from .version import __version__
from .calibration.calibrate import CalibrationConfig
from .checkpoint.loading import load, load_model
from .checkpoint.directory import CheckpointError
from .checkpoint.saving import save_pretrained
from .surgery import ConversionError, ConversionReport, ConvertConfig, convert, inspect, plan
from .discovery.norms import NormInfo, find_norms
from .fold import fold
from .linearise import linearise
from .checkpoint.stock_export import export_stock
from .conversion import ConversionJob, run_job
from .evaluation.perplexity import EvaluationError, PerplexitySettings, evaluate
from .modules import ELN, METHODS, Derf, DyISRU, DyT, ElementwiseNorm, Linear
from .validation import ValidationError

__all__ = [
    "__version__",
    "convert", "inspect", "plan", "fold", "linearise", "export_stock", "load", "load_model", "save_pretrained", "evaluate", "find_norms",
    "run_job", "ConversionJob", "ConvertConfig", "CalibrationConfig", "PerplexitySettings", "ConversionReport",
    "NormInfo",
    "METHODS", "DyT", "ELN", "DyISRU", "Derf", "Linear", "ElementwiseNorm",
    "ConversionError", "CheckpointError", "EvaluationError", "ValidationError",
]
