"""A model's sizes from its config alone: the model is built on the meta device, so no weight is read or allocated
and an 8B or 70B config is measured in seconds.

What the memory plan needs: the parameters (tied ones counted once), the buffers, the largest shard unit (a
decoder block, from ``_no_split_modules``: what FSDP2 gathers at a time and what the block pass holds on the
compute device), the norms' parameters (what ``trainable: norms`` trains), the linear layers LoRA adapts, and the
shapes that set activation sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ..checkpoint.loading import ModelLoadError, check_config_file, resolve
from ..checkpoint.packaged import PackagedModelMissing
from ..checkpoint.record import KEY, ConversionRecord
from ..validation import ValidationError


class PlanError(ValueError):
    """A model or a setting the plan cannot use; the message names the fix."""


@dataclass(frozen=True)
class ModelSizes:
    """Counts of one model (elements, not bytes: the plan's precision sets the bytes)."""

    name: str
    parameters: int  # tied parameters once
    buffers: int  # elements of the persistent and non-persistent buffers (rotary tables, position ids)
    buffer_bytes: int  # at their own dtypes
    largest_unit: int  # parameters of the largest block in ``_no_split_modules``
    units: int  # how many such blocks
    root: int  # parameters outside the blocks: embeddings, final norm, head
    norm_parameters: int  # of every LayerNorm / RMSNorm: the scale of what ``trainable: norms`` trains
    norms: int
    lora_pairs: int  # sum of (in + out) over the linear layers inside the blocks: LoRA rank r adds r x this
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_head: bool

    def parameter_bytes(self, bytes_per_value: int = 4) -> int:
        return self.parameters * bytes_per_value + self.buffer_bytes


def read_config(model) -> "transformers.PretrainedConfig":  # noqa: F821
    """The config of ``model``: a ``PreTrainedConfig``, a config.json file, a directory holding one, a GGUF file or
    ``offline:NAME``, or a Hub id (its config.json alone is fetched). Remote code is never run."""
    if isinstance(model, PretrainedConfig):
        return model
    spec = str(model)
    try:
        location, extra = resolve(spec)
    except (ModelLoadError, PackagedModelMissing) as error:
        raise PlanError(str(error)) from None
    path = Path(location)
    file = path if path.is_file() and path.suffix == ".json" else path / "config.json"
    try:
        if file.is_file():  # a converted checkpoint's config names its remote code: build its architecture's own
            check_config_file(file, spec)  # sizes positive and buildable: one line, not a traceback or a hang
            values = json.loads(file.read_text())
            values.pop("auto_map", None)
            if "model_type" not in values:
                raise PlanError(f"{file} has no model_type: give the original model's config")
            if values["model_type"] not in CONFIG_MAPPING:  # transformers' message lists every model type it knows
                raise PlanError(_unknown_model_type(spec, values))
            return AutoConfig.for_model(**values)
        return AutoConfig.from_pretrained(location, trust_remote_code=False, **extra)
    except PlanError:
        raise
    except ModelLoadError as error:
        raise PlanError(str(error)) from None
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PlanError(f"cannot read a config for {spec} ({first}): give a Hub id, a model directory or its "
                        "config.json") from None


def _unknown_model_type(spec: str, values: dict) -> str:
    """Why a config.json's model type does not plan, and what to plan instead: a converted checkpoint's original
    (its architecture with norms; a recovery from it plans with ``--config``)."""
    if KEY in values:
        try:
            original = ConversionRecord.in_config(values).base_model or "the original model"
        except (TypeError, ValueError, ValidationError):  # a record that does not read still names a checkpoint
            original = "the original model"
        return (f"{spec} is a converted checkpoint (model_type {values['model_type']!r}): plan {original} instead, "
                f"or its recovery with normswap plan --config RECIPE.yaml model={spec}")
    return (f"{spec}: model_type {values['model_type']!r} is not one transformers knows: give a Hub id, a model "
            "directory or a config.json of a model transformers builds")


def empty_model(config) -> nn.Module:
    """The model of ``config`` with every parameter and buffer on the meta device (transformers' ``from_config``
    under ``torch.device("meta")``): shapes without memory."""
    with torch.device("meta"):
        for auto in (AutoModelForCausalLM, AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:  # not a causal LM (an encoder): its bare model
                continue
    raise PlanError(f"transformers builds no model for model_type {config.model_type!r}")


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_norm(module: nn.Module) -> bool:
    """A LayerNorm / RMSNorm by its class (torch's or a model's own ``*RMSNorm`` / ``*LayerNorm``)."""
    name = type(module).__name__.lower()
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("rmsnorm", "layernorm"))


def measure(model: nn.Module, name: str = "") -> ModelSizes:
    """The sizes of an instantiated model (meta or real)."""
    config = _text(model.config)
    unique = {id(p): p for p in model.parameters()}
    buffers = list(model.buffers())
    unit_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in unit_names]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    norms = [m for m in model.modules() if is_norm(m)]
    norm_params = {id(p): p for m in norms for p in m.parameters(recurse=False)}
    linears = [m for b in blocks for m in b.modules() if isinstance(m, nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    heads = getattr(config, "num_attention_heads", 1)
    hidden = getattr(config, "hidden_size", 0)
    return ModelSizes(
        name=name or getattr(config, "_name_or_path", "") or type(model).__name__,
        parameters=sum(p.numel() for p in unique.values()),
        buffers=sum(b.numel() for b in buffers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        largest_unit=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        units=len(blocks),
        root=sum(p.numel() for i, p in unique.items() if i not in in_blocks),
        norm_parameters=sum(p.numel() for p in norm_params.values()),
        norms=len(norms),
        lora_pairs=sum(m.in_features + m.out_features for m in linears),
        hidden=hidden,
        intermediate=getattr(config, "intermediate_size", 4 * hidden),
        layers=getattr(config, "num_hidden_layers", len(blocks)),
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // max(heads, 1),
        vocab=getattr(config, "vocab_size", 0),
        tied_head=head is not None and embed is not None and head.weight is embed.weight,
    )


def model_sizes(model) -> ModelSizes:
    """:class:`ModelSizes` of ``model`` (anything :func:`read_config` reads, or an ``nn.Module``), without
    reading its weights."""
    if isinstance(model, nn.Module):
        return measure(model)
    config = read_config(model)
    return measure(empty_model(config), name=str(model) if not hasattr(model, "to_dict") else "")
