"""Save a converted model as an ordinary Hugging Face checkpoint that loads anywhere.

``save_pretrained(model, DIR)`` writes, atomically (``directory.atomic_directory``: a temporary directory next to
DIR, put in place when complete): safetensors weights, ``config.json`` with the ``normswap`` block, generation
config, tokenizer, the generated ``modeling_normswap.py`` (see ``remote_code.py``) named in ``config.auto_map``,
and a model card. The saved ``model_type`` is ``normswap_<original>``, so a stock ``from_pretrained`` without
``trust_remote_code`` stops with an error instead of quietly building the original architecture and dropping
alpha / beta. ``loading.load(DIR)`` rebuilds the same model from the package's own modules, without running the
checkpoint's code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from contextlib import contextmanager
from pathlib import Path

import transformers
from safetensors import SafetensorError
from torch import nn

from .. import offload
from ..modules import METHODS, ElementwiseNorm
from ..validation import ValidationError, first_line
from ..version import __version__
from . import config_checks, model_card, remote_code
from .directory import CheckpointError, atomic_directory, check_output_dir
from .record import ConversionRecord, OriginalArchitecture


def _base(model: nn.Module, record: ConversionRecord) -> OriginalArchitecture:
    """The original architecture: recorded by an earlier save, else read from the (unconverted-class) model."""
    if record.base:
        return config_checks.check_base(record.base)
    config = model.config
    if type(model).__name__.startswith("NormSwap") or config.model_type.startswith(remote_code.MODEL_TYPE_PREFIX):
        raise CheckpointError("the model's normswap block does not record its original architecture")
    return OriginalArchitecture(type(model).__name__, type(config).__name__, config.model_type)


def _method_of(module: nn.Module) -> str:
    for key, cls in METHODS.items():
        if isinstance(module, cls):
            return key
    raise CheckpointError(f"{type(module).__name__} is not an element-wise norm of hf_normswap.modules.METHODS "
                          f"({', '.join(METHODS)})")


def _saved_record(model: nn.Module, record: ConversionRecord, base: OriginalArchitecture, base_model: str | None,
                  evaluation) -> ConversionRecord:
    """The model's record plus what a reload needs: shapes, per-module method, original architecture."""
    converted = {}
    for name, entry in record.converted.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"converted norm {name} recorded in config.normswap is not in the model") from None
        if not isinstance(module, ElementwiseNorm):
            raise CheckpointError(f"{name} is recorded as converted but is a {type(module).__name__}")
        method = _method_of(module)
        converted[name] = dataclasses.replace(
            entry, normalized_shape=list(module.normalized_shape), per_channel=module.per_channel,
            bias=module.bias is not None, amplitude=module.amplitude,
            method=method if method != record.method else entry.method)
    return dataclasses.replace(record, converted=converted, base=base,
                               package={"name": "hf-normswap", "version": __version__},
                               base_model=base_model if base_model is not None else record.base_model,
                               evaluation=evaluation if evaluation is not None else record.evaluation)


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


def _rewrite_config(directory: Path, base: OriginalArchitecture, record: ConversionRecord) -> dict:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        del config["quantization_config"]  # the weights were saved dequantized (see _dense)
    config_name, model_name = remote_code.class_names(base.architecture)
    config["model_type"] = remote_code.MODEL_TYPE_PREFIX + base.model_type
    config["architectures"] = [model_name]
    config["auto_map"] = {"AutoConfig": f"{remote_code.MODULE_NAME}.{config_name}"}
    for auto in remote_code.auto_classes(base.architecture, base.model_type):
        config["auto_map"][auto] = f"{remote_code.MODULE_NAME}.{model_name}"
    record.store(config)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


OFFLOADED_SHARD = "1GB"


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    tokenizer=None,
    overwrite: bool = False,
    into_existing: bool = False,
    base_model: str | None = None,
    evaluation: dict | None = None,
    **kwargs,
) -> Path:
    """Write a converted model as a checkpoint loadable with or without hf_normswap; returns the directory.

    ``tokenizer`` (or processor) is saved alongside. ``base_model`` is the Hub id of the original model for the
    card (defaults to the one the model was loaded from, when that is a Hub id). ``evaluation`` is an optional
    ``{"dataset": str, "metrics": {"perplexity": {"original": x, "converted": y}, ...}}`` shown in the card.
    ``overwrite`` replaces a checkpoint already at ``save_directory`` (never a directory holding anything else);
    ``into_existing`` writes the files into a directory that holds other things, as transformers does.
    Other keyword arguments go to transformers' ``save_pretrained`` (e.g. ``max_shard_size``).
    """
    try:
        record = ConversionRecord.of(model)
    except ValidationError as error:
        raise CheckpointError(str(error)) from None
    if record is None:
        raise CheckpointError("the model has no normswap block in its config: convert it with hf_normswap.convert first")
    check_output_dir(save_directory, overwrite, into_existing)
    base = _base(model, record)
    if base_model is None:
        base_model = record.base_model or model_card.hub_id(getattr(model.config, "_name_or_path", None))
    saved = _saved_record(model, record, base, base_model, evaluation)
    modeling = remote_code.render(base.architecture, base.config_class, base.model_type)
    remote_code.check_remote_modules(modeling)
    kwargs.pop("push_to_hub", None)
    if offload.is_offloaded(model):  # weights on disk come back one shard at a time: a shard is what memory holds
        kwargs.setdefault("max_shard_size", OFFLOADED_SHARD)
        # transformers finds tied weights by tensor identity, which the offload hooks' placeholders lack
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        kwargs.setdefault("state_dict", {k: v for k, v in model.state_dict().items() if k not in tied})
    with atomic_directory(save_directory, overwrite, into_existing) as staging:
        with _dense(model):
            try:
                transformers.PreTrainedModel.save_pretrained(model, staging, save_original_format=False, **kwargs)
            except SafetensorError as error:  # a full disk fails inside safetensors' writer, not as an OSError
                raise CheckpointError(f"cannot write the weights ({first_line(error)})") from None
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config = _rewrite_config(staging, base, saved)
        (staging / remote_code.FILE_NAME).write_text(modeling)
        (staging / "README.md").write_text(model_card.render(config))
    return Path(save_directory)


def enable_save(model: nn.Module) -> None:
    """Make ``model.save_pretrained(DIR)`` (and so ``model.push_to_hub``) write the full checkpoint (instance only)."""
    if not isinstance(model, transformers.PreTrainedModel):
        return

    def save(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        if not is_main_process:  # the Trainer calls every rank; one writes
            return Path(save_directory)
        # transformers' own save_pretrained writes into existing directories (a Trainer's output_dir): so does this,
        # replacing a checkpoint already there and leaving everything else (checkpoint-N folders) alone
        kwargs.setdefault("overwrite", True)
        kwargs.setdefault("into_existing", True)
        return save_pretrained(self, save_directory, **kwargs)

    model.save_pretrained = types.MethodType(save, model)
