"""Save a converted model as an ordinary Hugging Face checkpoint that loads anywhere, and load it back.

``save_pretrained(model, DIR)`` writes, atomically (a temporary directory next to DIR, renamed into place):
safetensors weights, ``config.json`` with the ``normswap`` block, generation config, tokenizer, the generated
``modeling_normswap.py`` (see ``remote_code.py``) named in ``config.auto_map``, and a model card. The saved
``model_type`` is ``normswap_<original>``, so a stock ``from_pretrained`` without ``trust_remote_code`` stops with
an error instead of quietly building the original architecture and dropping alpha / beta.

``load(DIR)`` rebuilds the same model from the package's own modules, without running the checkpoint's code.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path

import transformers
from torch import nn
from transformers import CONFIG_MAPPING

from . import __version__, model_card, remote_code
from .modules import METHODS, ElementwiseNorm


class CheckpointError(Exception):
    """A user-facing problem saving or loading a checkpoint; the message says what to change."""


class OutputExistsError(CheckpointError):
    """The output directory exists and is not empty, and overwriting was not asked for."""


# ----------------------------------------------------------------------------------------------- atomic output


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before any work is done, an output that exists as a file or as a non-empty directory."""
    path = Path(path).expanduser()
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputExistsError(f"output {path} exists and is not a directory; choose another --output")
        if any(path.iterdir()) and not overwrite:
            raise OutputExistsError(f"output directory {path} is not empty; pass --overwrite (overwrite=True) to replace it")
    return path


@contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` by rename, on any error it is removed.

    An interrupted save (exception, Ctrl-C) leaves ``path`` as it was: absent, empty, or the previous checkpoint.
    """
    target = check_output_dir(path, overwrite).absolute()
    created = []
    for parent in reversed(target.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should look like any directory
    try:
        yield staging
        for written in staging.rglob("*"):  # some writers (safetensors) create files private (0600)
            if written.is_file():
                written.chmod(0o666 & ~umask)
        if target.exists():
            check_output_dir(target, overwrite)  # it may have been filled while we worked
            if any(target.iterdir()):
                previous = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.rename(target, previous / "old")
                os.rename(staging, target)
                shutil.rmtree(previous, ignore_errors=True)
                return
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in reversed(created):
            try:
                parent.rmdir()
            except OSError:
                break
        raise


# ---------------------------------------------------------------------------------------------------- saving


def _base(model: nn.Module, block: dict) -> dict:
    """The original architecture: recorded by an earlier save, else read from the (unconverted-class) model."""
    if block.get("base"):
        return dict(block["base"])
    config = model.config
    if type(model).__name__.startswith("NormSwap") or config.model_type.startswith(remote_code.MODEL_TYPE_PREFIX):
        raise CheckpointError("the model's normswap block does not record its original architecture")
    return {"architecture": type(model).__name__, "config_class": type(config).__name__,
            "model_type": config.model_type}


def _method_of(module: nn.Module) -> str:
    for key, cls in METHODS.items():
        if isinstance(module, cls):
            return key
    raise CheckpointError(f"{type(module).__name__} is not a DyT or ELN module")


def _saved_block(model: nn.Module, block: dict, base: dict, base_model: str | None, evaluation) -> dict:
    """The config's normswap block plus what a reload needs: shapes, per-module method, original architecture."""
    saved = json.loads(json.dumps(block))  # deep copy; also proves it is JSON-serializable
    for name, entry in saved["converted"].items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"converted norm {name} recorded in config.normswap is not in the model") from None
        if not isinstance(module, ElementwiseNorm):
            raise CheckpointError(f"{name} is recorded as converted but is a {type(module).__name__}")
        entry.update(normalized_shape=list(module.normalized_shape), per_channel=module.per_channel,
                     bias=module.bias is not None, amplitude=module.amplitude)
        if _method_of(module) != saved["method"]:
            entry["method"] = _method_of(module)
    saved["base"] = base
    saved["package"] = {"name": "hf-normswap", "version": __version__}
    if base_model is not None:
        saved["base_model"] = base_model
    if evaluation is not None:
        saved["evaluation"] = evaluation
    return saved


def gguf_quantizer(model: nn.Module, purpose: str):
    """The GGUF quantizer a model loaded from GGUF still carries, or None.

    transformers dequantizes GGUF weights into ordinary ``nn.Linear`` modules unless GGML kernels are available, but
    keeps the (inference-only, non-serializable) quantizer; only when weights stayed packed is the model unusable
    for ``purpose`` ("saved", "trained").
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or type(quantizer).__name__ != "GgufHfQuantizer":
        return None
    if getattr(quantizer, "packed_modules", None):
        raise CheckpointError(f"the model holds packed GGUF weights and cannot be {purpose}; load it with "
                              "quantization_config=GgufConfig(dequantize=True)")
    return quantizer


@contextmanager
def _dense(model: nn.Module):
    """Save a model loaded from GGUF as the dense tensors it holds: hide its GGUF quantizer while saving."""
    quantizer = gguf_quantizer(model, "saved")
    if quantizer is None:
        yield
        return
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer


def _rewrite_config(directory: Path, base: dict, block: dict) -> dict:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        del config["quantization_config"]  # the weights were saved dequantized (see _dense)
    config_name, model_name = remote_code.class_names(base["architecture"])
    config["model_type"] = remote_code.MODEL_TYPE_PREFIX + base["model_type"]
    config["architectures"] = [model_name]
    config["auto_map"] = {"AutoConfig": f"{remote_code.MODULE_NAME}.{config_name}"}
    for auto in remote_code.auto_classes(base["architecture"], base["model_type"]):
        config["auto_map"][auto] = f"{remote_code.MODULE_NAME}.{model_name}"
    config["normswap"] = block
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    tokenizer=None,
    overwrite: bool = False,
    base_model: str | None = None,
    evaluation: dict | None = None,
    **kwargs,
) -> Path:
    """Write a converted model as a checkpoint loadable with or without hf_normswap; returns the directory.

    ``tokenizer`` (or processor) is saved alongside. ``base_model`` is the Hub id of the original model for the
    card (defaults to the one the model was loaded from, when that is a Hub id). ``evaluation`` is an optional
    ``{"dataset": str, "metrics": {"perplexity": {"original": x, "converted": y}, ...}}`` shown in the card.
    Other keyword arguments go to transformers' ``save_pretrained`` (e.g. ``max_shard_size``).
    """
    block = getattr(getattr(model, "config", None), "normswap", None)
    if not block:
        raise CheckpointError("the model has no normswap block in its config: convert it with hf_normswap.convert first")
    check_output_dir(save_directory, overwrite)
    base = _base(model, block)
    if base_model is None:
        base_model = block.get("base_model") or model_card.hub_id(getattr(model.config, "_name_or_path", None))
    saved_block = _saved_block(model, block, base, base_model, evaluation)
    modeling = remote_code.render(base["architecture"], base["config_class"], base["model_type"])
    remote_code.check_remote_modules(modeling)
    kwargs.pop("push_to_hub", None)
    with atomic_directory(save_directory, overwrite) as staging:
        with _dense(model):
            transformers.PreTrainedModel.save_pretrained(model, staging, save_original_format=False, **kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config = _rewrite_config(staging, base, saved_block)
        (staging / remote_code.FILE_NAME).write_text(modeling)
        (staging / "README.md").write_text(model_card.render(config))
    return Path(save_directory)


def enable_save(model: nn.Module) -> None:
    """Make ``model.save_pretrained(DIR)`` (and so ``model.push_to_hub``) write the full checkpoint (instance only)."""
    if not isinstance(model, transformers.PreTrainedModel):
        return

    def save(self, save_directory, *args, **kwargs):
        kwargs.setdefault("overwrite", True)  # transformers' own save_pretrained writes into existing directories
        return save_pretrained(self, save_directory, **kwargs)

    model.save_pretrained = types.MethodType(save, model)


# --------------------------------------------------------------------------------------------------- loading


def read_config(path: str | os.PathLike) -> dict | None:
    """config.json of a checkpoint directory saved by hf_normswap, or None when it is not one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    block = config.get("normswap")
    return config if isinstance(block, dict) and block.get("base") else None


@functools.cache
def normswap_class(architecture: str) -> type:
    """Subclass of the transformers class ``architecture`` that rebuilds the recorded norms with the package's modules."""
    base = getattr(transformers, architecture, None)
    if base is None:
        raise CheckpointError(f"transformers {transformers.__version__} has no class {architecture}; upgrade it")

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        remote_code.rebuild_norms(self, config.normswap)

    return type(f"NormSwap{architecture}", (base,), {"__init__": __init__, "__module__": __name__})


def base_config(path: str | os.PathLike):
    """The checkpoint's config as the original architecture's config class (no remote code), normswap block kept.

    Pass it as ``config=`` to ``AutoTokenizer.from_pretrained`` / ``AutoProcessor.from_pretrained``: without it they
    look the config up themselves and stop at the remote-code question for the ``normswap_*`` model type.
    """
    config_dict = read_config(path)
    if config_dict is None:
        raise CheckpointError(f"{path} is not a checkpoint saved by hf_normswap (no config.json with a normswap block)")
    base = config_dict["normswap"]["base"]
    if base["model_type"] not in CONFIG_MAPPING:
        raise CheckpointError(f"transformers {transformers.__version__} does not know model type {base['model_type']}")
    config_dict = dict(config_dict, model_type=base["model_type"], architectures=[base["architecture"]])
    config_dict.pop("auto_map", None)
    return CONFIG_MAPPING[base["model_type"]].from_dict(config_dict)


def load(path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a checkpoint saved by :func:`save_pretrained` with the package's modules (no remote code), in eval mode.

    Keyword arguments go to ``from_pretrained`` (``dtype=``, ``device_map=`` ...).
    """
    config = base_config(path)
    model = normswap_class(config.normswap["base"]["architecture"]).from_pretrained(path, config=config, **kwargs)
    enable_save(model)
    return model.eval()
