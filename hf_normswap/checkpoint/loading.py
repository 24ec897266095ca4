"""Load a model (and its tokenizer when there is one) from a Hub id, a local directory, a .gguf file or a packaged name.

A checkpoint converted by hf_normswap (``saving.save_pretrained``) is rebuilt from the package's own modules by
:func:`load`, without running the checkpoint's code: its record (``record.ConversionRecord.read``) is checked
against the weights and the architecture first.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
import warnings
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from huggingface_hub import constants
from huggingface_hub.errors import StrictDataclassError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .. import kernels, offload
from ..data import texts as data
from ..validation import ValidationError, check_path_length, first_line
from . import config_checks, model_card, remote_code, stock_export
from .packaged import PREFIX, packaged_path
from .record import ConversionRecord, converted_config
from .directory import CheckpointError
from .saving import enable_save


class HandOverWarning(UserWarning):
    """The checkpoint was saved while training still blended its converted modules with the original's norms."""


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
    try:
        check_path_length(spec, "model")  # a Hub id is far shorter: such a name is neither
    except ValidationError as error:
        raise ModelLoadError(str(error)) from None
    if spec.startswith(PREFIX):
        spec = str(packaged_path(spec))
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model not found: no GGUF file at {spec}")
        return str(path.parent), {"gguf_file": path.name}
    return spec, {}


# sizes a config must give as positive integers; a negative one would only fail deep inside torch
SIZE_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head", "d_model", "max_position_embeddings")


# above these a config describes no model that could be built: 2**40 wide, or 10**7 blocks to instantiate (a hang)
MAX_SIZE, MAX_LAYERS, LAYER_KEYS = 1 << 24, 10_000, ("num_hidden_layers", "n_layer")
EPS_SUFFIXES = ("_eps", "epsilon")  # rms_norm_eps, layer_norm_eps, layer_norm_epsilon


def check_config_file(path: Path, spec: str) -> None:
    """A local config.json must be a JSON object whose sizes are positive and buildable: one line instead of a
    traceback or a hang (``load``, ``inspect``, ``plan``)."""
    if not path.is_file():
        return
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{spec}: config.json is not readable JSON ({first_line(error)})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{spec}: config.json holds a JSON {type(config).__name__}, not an object")
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ModelLoadError(f"{spec}: config.json {key} is {value!r}; it must be a positive integer")
        limit = MAX_LAYERS if key in LAYER_KEYS else MAX_SIZE
        if value is not None and key != "max_position_embeddings" and value > limit:
            raise ModelLoadError(f"{spec}: config.json {key} is {value:,}; no model has more than {limit:,}")
    for key, value in config.items():  # 1e309 reads as inf: the norm then outputs 0 and passes for a LayerNorm
        if key.endswith(EPS_SUFFIXES) and isinstance(value, float) and not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{spec}: config.json {key} is {value!r}; it must be a small positive number")


def _looks_local(spec: str, location: str) -> bool:
    """A path rather than a Hub id: it exists, starts like a path, or is no valid ``NAME`` / ``OWNER/NAME``."""
    if spec.startswith((".", "/", "~")) or Path(location).exists():
        return True
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return True
    return False


def load_model(spec: str, dtype=None, with_tokenizer: bool = True, device=None, empty: bool = False,
               weights_memory: int | None = None):
    """(model in eval mode, tokenizer or None). Raises ``ModelLoadError`` with a one-line reason.

    ``device`` (e.g. ``cuda``) and ``dtype`` go to transformers' own placement (``device_map``, ``dtype``), so the
    weights load straight onto the device; a GGUF file is dequantized in CPU memory first, then moved. ``empty``:
    the model built from its config alone, parameters on the meta device and no weight read (buffers real, e.g.
    rotary ``inv_freq``, computed as at load), for a sharded run's processes that receive their shards.
    ``weights_memory``: at most that many bytes of weights in host memory, the rest left on disk (``offload.py``)."""
    location, extra = resolve(spec)
    if weights_memory is not None and "gguf_file" in extra:
        raise ModelLoadError(f"{spec}: a GGUF file loads whole (it is dequantized in memory); weights stay on disk "
                             "only from safetensors: drop --max-host-memory or convert the file to safetensors")
    cache_only = {}
    if _looks_local(spec, location):
        if not Path(location).exists():
            raise ModelLoadError(f"model not found: no directory or file at {spec} (a Hub id is NAME or OWNER/NAME)")
    elif not constants.HF_HUB_OFFLINE and not data.hub_reachable():
        cache_only = {"local_files_only": True}  # cached models load at once; others fail at once, without retries
    kwargs = dict(extra, **cache_only, dtype=dtype) if dtype is not None else dict(extra, **cache_only)
    if device is not None and "gguf_file" not in extra:
        kwargs["device_map"] = str(device)
    check_config_file(Path(location) / "config.json", spec)
    folder = None
    if weights_memory is not None:
        folder = offload.new_folder(spec)
        kwargs.update(device_map="auto", max_memory={"cpu": max(int(weights_memory), 1)},
                      offload_folder=folder.name)
    try:
        if empty:
            model = _empty_model(location, extra, cache_only, dtype)
        elif "gguf_file" in extra:
            model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
            if device is not None:  # after dequantizing: the GGUF loader's own placement is not relied on
                model.to(device)
        elif converted_config(location) is not None:  # converted checkpoint: the package's own modules
            model = load(location, **kwargs)
        else:
            config = AutoConfig.from_pretrained(location, **cache_only, trust_remote_code=False)  # refuse, never prompt
            model = _model_class(config).from_pretrained(location, **kwargs)
    except ValidationError as error:
        raise ModelLoadError(f"{spec}: {error}") from None
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"cannot load {spec}: out of memory on {device}; use bfloat16 or the cpu") from None
    except StrictDataclassError as error:  # transformers' own config checks, their reason on a later line
        raise ModelLoadError(f"{spec}: config.json fails transformers' checks: {' '.join(str(error).split())}") from None
    except (SafetensorError, RuntimeError, struct.error) as error:  # truncated weights or GGUF, sizes that make no tensor
        raise ModelLoadError(f"cannot load {spec}: {first_line(error)}; the files are damaged") from None
    except (OSError, ValueError) as error:
        if cache_only:
            raise ModelLoadError(f"model not found: {spec} is not in the local cache and the Hub ({constants.ENDPOINT}) "
                                 "cannot be reached; working offline, set HF_HUB_OFFLINE=1 to skip the Hub") from None
        if constants.HF_HUB_OFFLINE and not _looks_local(spec, location):
            raise ModelLoadError(f"model not found: {spec} is not in the local cache (HF_HUB_OFFLINE is set)") from None
        raise ModelLoadError(f"model not found or unreadable: {spec} ({first_line(error)})") from None
    if folder is not None:
        setattr(model, offload.FOLDER_ATTRIBUTE, folder)  # kept for calibration's blocks, removed with the model
    tokenizer = None
    if with_tokenizer:
        logging.getLogger("transformers").disabled = True
        try:
            converted = {"config": base_config(location)} if converted_config(location) else {}
            tokenizer = AutoTokenizer.from_pretrained(location, **extra, **cache_only, **converted,
                                                      trust_remote_code=False)
            # the code an auto_map names was not run: a save would name code its checkpoint does not hold
            getattr(tokenizer, "init_kwargs", {}).pop("auto_map", None)
        except (OSError, ValueError, TypeError):
            tokenizer = None  # vision and audio models have processors instead
        finally:
            logging.getLogger("transformers").disabled = False
    return model.eval(), tokenizer


def _empty_model(location: str, extra: dict, cache_only: dict, dtype) -> nn.Module:
    """:func:`load_model`'s model on the meta device: the class it would load, built from the config alone."""
    if converted_config(location) is not None:
        config = base_config(location)
        build = normswap_class(ConversionRecord.of(config).base.architecture)._from_config
        kernels.install()  # as load() does: the element-wise modules compute as the main process's
    else:
        config = AutoConfig.from_pretrained(location, **extra, **cache_only, trust_remote_code=False)
        model_class = AutoModelForCausalLM if "gguf_file" in extra else _model_class(config)
        build = getattr(model_class, "_from_config", None) or model_class.from_config
    with init_empty_weights(include_buffers=False):
        model = build(config, **({"dtype": dtype} if dtype is not None else {}))
    model.tie_weights()  # from_pretrained ties them once the weights are in; a model built from a config is not tied
    return model


# ------------------------------------------------------------------------------------- converted checkpoints


@functools.cache
def normswap_class(architecture: str) -> type:
    """Subclass of the transformers class ``architecture`` that rebuilds the recorded norms with the package's modules."""
    base = config_checks.transformers_class(architecture, transformers.PreTrainedModel, "normswap.base.architecture")

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        config_checks.check_block_against_model(self, ConversionRecord.of(config))
        remote_code.rebuild_norms(self, config.normswap)

    return type(f"NormSwap{architecture}", (base,), {"__init__": __init__, "__module__": __name__})


def base_config(path: str | os.PathLike):
    """The checkpoint's config as the original architecture's config class (no remote code), normswap block kept.

    Pass it as ``config=`` to ``AutoTokenizer.from_pretrained`` / ``AutoProcessor.from_pretrained``: without it they
    look the config up themselves and stop at the remote-code question for the ``normswap_*`` model type.
    """
    config_dict = converted_config(path)
    if config_dict is None:
        raise CheckpointError(f"{path} is not a checkpoint saved by hf_normswap (no config.json with a normswap block)")
    record = config_checks.check_block(ConversionRecord.read(path))
    base = record.base
    config_dict = dict(record.store(config_dict), model_type=base.model_type, architectures=[base.architecture])
    config_dict.pop("auto_map", None)
    return CONFIG_MAPPING[base.model_type].from_dict(config_dict)


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint's safetensors files, read from their headers only."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file() and (directory / "model.safetensors").is_file():  # the check must read what will load
        raise CheckpointError(f"{directory} holds both model.safetensors and {index.name}: transformers loads "
                              "model.safetensors, the index names other files; remove the one that is not the "
                              "checkpoint's")
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index}: not a readable weight index ({first_line(error)})") from None
    shapes = {}
    for name in files:
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{directory} has no weights file {name}: the checkpoint is incomplete")
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({first_line(error)}); it is truncated "
                                  "or corrupt: save or download it again") from None
    return shapes


def load(path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a checkpoint saved by :func:`save_pretrained` with the package's modules (no remote code), in eval mode.

    The normswap block is checked against the weights and the architecture first, so a damaged or tampered block
    is one error instead of a model with uninitialized or ignored parameters.
    Keyword arguments go to ``from_pretrained`` (``dtype=``, ``device_map=`` ...).
    """
    config = base_config(path)
    record = ConversionRecord.of(config)
    if record.stock:  # the original architecture with linear norms as huge-epsilon norms
        model = stock_export.load_stock(path, record, **kwargs)
        enable_save(model)
        return model.eval()
    config_checks.check_block_against_weights(record, weight_shapes(path))
    model = normswap_class(record.base.architecture).from_pretrained(path, config=config, **kwargs)
    enable_save(model)
    kernels.install()
    mid_hand_over = model_card.hand_over_warning(record.hand_over)
    if mid_hand_over:  # loaded all the same: a run's checkpoints are worth evaluating while it trains
        warnings.warn(f"{path} was {mid_hand_over}", HandOverWarning, stacklevel=2)
    return model.eval()

