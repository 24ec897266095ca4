"""Load a model (and its tokenizer when there is one) from a Hub id, a local directory, a .gguf file or a packaged name."""

from __future__ import annotations

import logging
from pathlib import Path

import transformers
from huggingface_hub import constants, get_session
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from . import checkpoint
from .data import first_line
from .packaged import PREFIX, packaged_path


HUB_PROBE_TIMEOUT = 3.0  # seconds


class ModelLoadError(OSError):
    """The model could not be found or read; the message names the spec and what to pass instead."""


def _model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return AutoModel


def resolve(spec: str) -> tuple[str, dict]:
    """(path or Hub id, extra ``from_pretrained`` kwargs) for a model spec."""
    if spec.startswith(PREFIX):
        spec = str(packaged_path(spec))
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model not found: no GGUF file at {spec}")
        return str(path.parent), {"gguf_file": path.name}
    return spec, {}


def _looks_local(spec: str, location: str) -> bool:
    """A path rather than a Hub id: it exists, starts like a path, or is no valid ``NAME`` / ``OWNER/NAME``."""
    if spec.startswith((".", "/", "~")) or Path(location).exists():
        return True
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return True
    return False


def hub_reachable() -> bool:
    """One quick request to the Hub endpoint, so an offline machine fails in seconds, not after a minute of retries."""
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except Exception:  # any network failure: DNS, refused, timeout, proxy
        return False
    return True


def load_model(spec: str, dtype=None, with_tokenizer: bool = True):
    """(model in eval mode, tokenizer or None). Raises ``ModelLoadError`` with a one-line reason."""
    location, extra = resolve(spec)
    cache_only = {}
    if _looks_local(spec, location):
        if not Path(location).exists():
            raise ModelLoadError(f"model not found: no directory or file at {spec} (a Hub id is NAME or OWNER/NAME)")
    elif not constants.HF_HUB_OFFLINE and not hub_reachable():
        cache_only = {"local_files_only": True}  # cached models load at once; others fail at once, without retries
    kwargs = dict(extra, **cache_only, dtype=dtype) if dtype is not None else dict(extra, **cache_only)
    try:
        if "gguf_file" in extra:
            model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
        elif checkpoint.read_config(location) is not None:  # converted checkpoint: the package's own modules
            model = checkpoint.load(location, **kwargs)
        else:
            config = AutoConfig.from_pretrained(location, **cache_only)
            model = _model_class(config).from_pretrained(location, **kwargs)
    except (OSError, ValueError) as error:
        if cache_only:
            raise ModelLoadError(f"model not found: {spec} is not in the local cache and the Hub ({constants.ENDPOINT}) "
                                 "cannot be reached; working offline, set HF_HUB_OFFLINE=1 to skip the Hub") from None
        if constants.HF_HUB_OFFLINE and not _looks_local(spec, location):
            raise ModelLoadError(f"model not found: {spec} is not in the local cache (HF_HUB_OFFLINE is set)") from None
        raise ModelLoadError(f"model not found or unreadable: {spec} ({first_line(error)})") from None
    tokenizer = None
    if with_tokenizer:
        logging.getLogger("transformers").disabled = True
        try:
            converted = {"config": checkpoint.base_config(location)} if checkpoint.read_config(location) else {}
            tokenizer = AutoTokenizer.from_pretrained(location, **extra, **cache_only, **converted)
        except (OSError, ValueError, TypeError):
            tokenizer = None  # vision and audio models have processors instead
        finally:
            logging.getLogger("transformers").disabled = False
    return model.eval(), tokenizer
