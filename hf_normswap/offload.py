"""Weights on disk, for a model larger than the host memory allowed.

A model loaded within a limit (``normswap convert --max-host-memory``, ``load_model(weights_memory=)``) keeps in
memory what fits (accelerate's ``infer_auto_device_map``, a block never split) and leaves the rest on disk:
accelerate's disk offload, reading the checkpoint's own safetensors shards (transformers maps them without a copy).
Each forward pass then brings a module's weights in for its own call and drops them after, so any pass over the
whole model runs in the memory of one layer.

Calibration changes weights, which the hooks would drop: :func:`in_memory` loads a block for its calibration stage
(its hooks removed) and afterwards writes its new state to the model's own offload folder and hooks it again, reading
from there. The folder lives as long as the model (a ``TemporaryDirectory`` on it, removed with it or at exit); the
user's files are only read. transformers' ``save_pretrained`` writes an offloaded model shard by shard, reading each
weight back through these hooks.
"""

from __future__ import annotations

import copy
import itertools
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.hooks import attach_align_device_hook, remove_hook_from_module
from accelerate.utils import (OffloadedWeightsLoader, align_module_device, has_offloaded_params, named_module_tensors,
                              offload_state_dict, set_module_tensor_to_device)
from torch import nn

FOLDER_ATTRIBUTE = "_normswap_offload_folder"


def new_folder(model_name: str) -> tempfile.TemporaryDirectory:
    """The offload folder of a model about to load: transformers' ``offload_folder``, then :func:`in_memory`'s."""
    return tempfile.TemporaryDirectory(prefix=f"normswap-offload-{Path(model_name).name[:40]}-")


def is_offloaded(model: nn.Module) -> bool:
    """Whether any weight of ``model`` is on disk (accelerate's offload hook on a module of it); a model loaded with
    any ``device_map`` that puts weights on disk counts."""
    return any(has_offloaded_params(m) for m in model.modules())


def execution_device(module: nn.Module) -> torch.device | None:
    """Where an offloaded module computes (its hook's device); None for a module without one."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    return None if device is None else torch.device(device)


def _load(module: nn.Module, device: torch.device) -> bool:
    """The offloaded weights of ``module`` and its submodules into memory on ``device``, their hooks removed;
    whether anything was on disk."""
    loaded = False
    for sub in list(module.modules()):
        if not has_offloaded_params(sub):
            continue
        hook = sub._hf_hook
        values = {name: hook.weights_map[name] for name, _ in
                  named_module_tensors(sub, include_buffers=hook.offload_buffers, recurse=hook.place_submodules)}
        remove_hook_from_module(sub)
        for name, value in values.items():
            set_module_tensor_to_device(sub, name, device, value=value)
        loaded = True
    return loaded


def materialize(module: nn.Module) -> None:
    """The weights of ``module`` in memory for good (a norm about to be replaced: its weights seed the new module)."""
    device = execution_device(module) or torch.device("cpu")
    _load(module, device)


def weights_in(module: nn.Module):
    """A context in which ``module``'s own weights are in memory, read from disk when they are there (accelerate's
    ``align_module_device``); a no-op for a module in memory."""
    return align_module_device(module)


def cpu_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of ``module`` in CPU memory holding its weights (read from disk where they are), no hooks."""
    copied = copy.deepcopy(module)
    _load(copied, torch.device("cpu"))
    return copied.float().cpu()


@contextmanager
def in_memory(model: nn.Module, name: str, device: torch.device):
    """Submodule ``name`` wholly in memory on ``device`` for the duration; when it came from disk, its state after
    (changed by calibration, its norms replaced) goes back to disk, into the model's offload folder, and its
    weights leave memory again. Looked up again at the end: a replaced module is a new one at the same name."""
    home = first_weight_device(model.get_submodule(name))  # where its hooks computed: the rest of the model's device
    loaded = _load(model.get_submodule(name), device)
    try:
        yield
    finally:
        if loaded:
            module = model.get_submodule(name)
            if getattr(model, FOLDER_ATTRIBUTE, None) is None:  # loaded with a device map outside normswap
                setattr(model, FOLDER_ATTRIBUTE, new_folder(getattr(model, "name_or_path", "") or "model"))
            folder = Path(getattr(model, FOLDER_ATTRIBUTE).name) / "calibrated" / name
            offload_state_dict(folder, {key: value.detach() for key, value in module.named_parameters()})
            attach_align_device_hook(module, execution_device=home or device, offload=True,
                                     weights_map=OffloadedWeightsLoader(save_folder=str(folder)))


def first_weight_device(module: nn.Module) -> torch.device | None:
    """The device of ``module``'s first weight, or for an offloaded one where it computes."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    if first is None:
        return None
    if first.device.type == "meta":
        return next((execution_device(m) for m in module.modules() if execution_device(m) is not None), None)
    return first.device
