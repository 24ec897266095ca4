"""Text sources: files, Hub datasets (whole or streamed), the Python reference shipped offline, and the original
model's own samples, turned into texts, token blocks or model batches. Calibration, evaluation and the recipe
receive what they need from here, and nothing here calls back into them."""

from .batches import model_batches
from .sources import check_spec, hub_stream, load_texts, local_paths, same_sample, sample_length
from .texts import BUILTIN, DataError, fingerprint, generation_settings, token_blocks, token_stream

__all__ = ["BUILTIN", "DataError", "check_spec", "fingerprint", "generation_settings", "load_texts",
           "hub_stream", "local_paths", "model_batches", "same_sample", "sample_length", "token_blocks", "token_stream"]
