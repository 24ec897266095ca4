"""Text sources: files, Hub datasets (whole or streamed), the Python reference shipped offline, and the original
model's own samples, turned into texts, token blocks or model batches. Calibration, evaluation and the recipe
receive what they need from here, and nothing here calls back into them."""

from .batches import model_batches
from .generated import is_generated
from .streaming import packed_stream
from .texts import (BUILTIN, DataError, check_spec, fingerprint, generation_settings, load_texts, local_paths,
                    same_sample, token_blocks, token_stream)

__all__ = ["BUILTIN", "DataError", "check_spec", "fingerprint", "generation_settings", "is_generated", "load_texts",
           "local_paths", "model_batches", "packed_stream", "same_sample", "token_blocks", "token_stream"]
