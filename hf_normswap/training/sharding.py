"""Sharded recovery with FSDP2: the student through accelerate's FSDP2 plugin, the frozen teacher with ``fully_shard``.

A model's training state (weights, gradients, AdamW moments) plus its frozen teacher is ~20 bytes a parameter in
fp32: 160 GB for an 8B model, more than one GPU holds. FSDP2 keeps 1/N of each on each of N processes and gathers
one shard unit (a decoder block, from the model's ``_no_split_modules``) at a time for its forward and backward.

accelerate 1.15 turns its FSDP plugin on for GPU-class distributed types only (``AcceleratorState.__init__``, the
``elif self.distributed_type in [MULTI_GPU, ...]`` branch that sets ``DistributedType.FSDP``: MULTI_CPU is not in
it), so ``accelerate launch`` with an FSDP config on CPU silently trains with DDP. :func:`adopt_fsdp2_on_cpu` gives
the state the plugin it dropped, so the CPU run takes the same path as a GPU run: accelerate's ``fsdp2_prepare_model``
(``fully_shard`` over gloo), its optimizer swap, its sharded checkpoints. Nothing after the sharding knows the device.

With ``fsdp_cpu_ram_efficient_loading: true`` (recipes/accelerate_configs/fsdp2.yaml) only the main process reads
weights; the others build both models on the meta device (``recipe_models``). The student's shards reach them
through accelerate's own loading (``fsdp2_prepare_model`` broadcasts the main process's state dict), the teacher's
through torch's (:func:`shard_from_main`: ``set_model_state_dict`` with ``broadcast_from_rank0``).

The final evaluation runs on the sharded models, every process alike. The save needs the whole student on one
process: :func:`gathered` fills a parameterless copy made before sharding (:func:`empty_copy`) with the full state
dict of ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` on the main process.
"""

from __future__ import annotations

import copy
import os

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import TrainerCallback


def fsdp2_requested() -> bool:
    """Whether the launch asks for FSDP2 (``accelerate launch`` with ``distributed_type: FSDP``, ``fsdp_version: 2``
    sets these variables; ``fsdp_version: 1`` is not supported)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("FSDP_VERSION") == "2"


def loads_once() -> bool:
    """Whether only the main process reads the weights (FSDP2 with ``fsdp_cpu_ram_efficient_loading``, which
    ``accelerate launch`` passes on as ``FSDP_CPU_RAM_EFFICIENT_LOADING``)."""
    return fsdp2_requested() and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("true", "1")


def adopt_fsdp2_on_cpu(accelerator) -> bool:
    """Make accelerate's state FSDP2 where it has fallen back to MULTI_CPU (DDP) although FSDP2 was asked for:
    the plugin is built from the launch's variables as accelerate builds it (``cpu_ram_efficient_loading`` too).
    Returns whether it changed anything."""
    state = accelerator.state
    if not fsdp2_requested() or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    return True


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def shard_unit_classes(model: nn.Module) -> set[type]:
    """The classes named by the model's ``_no_split_modules`` (its decoder / encoder blocks) that it contains."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def vectors_for_scalars(model: nn.Module) -> None:
    """Make every 0-d parameter (an element-wise module's single alpha / beta or shift) a 1-element vector, in place:
    ``fully_shard`` refuses scalars, and the vector broadcasts over the channels as the scalar does.
    :func:`gathered` gives the whole model its scalars back."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def shard(model: nn.Module) -> nn.Module:
    """``fully_shard`` every block (:func:`shard_unit_classes`, freed after its forward), then the root (embeddings,
    final norm, head), in place, over the default process group. For the frozen teacher, which has no gradients
    or optimizer state: the root keeps its gathered weights after the forward, since the chunked head loss
    (:mod:`hf_normswap.training.head_loss`) multiplies by the head's weight after it; the trainer reshards it after
    the loss."""
    units = shard_unit_classes(model)
    if not units:
        raise ValueError(f"{type(model).__name__} names no blocks in _no_split_modules to shard by")
    for module in [m for m in model.modules() if type(m) in units][::-1]:  # inner before outer
        fully_shard(module, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=False)
    return model


def shard_from_main(model: nn.Module, main: bool, device: torch.device | str) -> nn.Module:
    """:func:`shard` a model whose weights only the main process holds (the others built it on the meta device),
    then give every process its shards from the main process's full state dict with torch's own
    ``set_model_state_dict(..., broadcast_from_rank0=True)``, one shard unit at a time: the main process lets go of
    each unit's whole weights once they are sent, so it never holds the whole model and all its shards at once.
    Non-persistent buffers (rotary ``inv_freq``) are in no state dict: each process keeps its own, as accelerate's
    ``fsdp2_prepare_model`` does. The shards and buffers end on ``device`` (torch places what it receives on its
    process group's default device). Every process must call it."""
    full = model.state_dict() if main else {}
    groups = unit_groups(model)
    persistent = {key for keys in groups for key in keys}
    buffers = {name: buffer for name, buffer in model.named_buffers() if name not in persistent}
    model.to("meta")  # the main process's weights stay alive in ``full`` until they are sent
    retie(model)  # moved to meta, tied parameters become one each: every process must shard the same units
    shard(model)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for keys in groups:  # the same groups, in the same order, on every process
        set_model_state_dict(model, {key: full.pop(key) for key in keys if key in full}, options=options)
    for name, buffer in buffers.items():
        parent, _, local = name.rpartition(".")
        (model.get_submodule(parent) if parent else model).register_buffer(local, buffer.to(device), persistent=False)
    device = torch.device(device)  # moved only if needed: FSDP2's _apply copies shards again (reset_sharded_param)
    elsewhere = any(t.device != device for t in (*model.parameters(), *model.buffers()))
    return retie(model.to(device) if elsewhere else model)


def unit_groups(model: nn.Module) -> list[list[str]]:
    """The model's state dict keys grouped by shard unit (:func:`shard_unit_classes`; keys outside every unit, the
    root's, form one group), the groups in the order of their first key."""
    units = shard_unit_classes(model)
    prefixes = [name + "." for name, module in model.named_modules() if type(module) in units]
    groups: dict[str, list[str]] = {}
    for key in model.state_dict():
        unit = max((p for p in prefixes if key.startswith(p)), key=len, default="")
        groups.setdefault(unit, []).append(key)
    return list(groups.values())


def storage_for_optimizer(model: nn.Module) -> nn.Module:
    """The meta parameters of a student that only the main process loaded given uninitialized CPU storage
    (``to_empty``; buffers kept). Under FSDP2 the Trainer makes the optimizer before accelerate shards, and
    accelerate finds each optimizer parameter's shard by its storage address (``data_ptr``), which every meta tensor
    shares. Nothing is written into that storage, so its pages are not resident, and accelerate moves the model to
    the meta device again before it shards and broadcasts (``cpu_ram_efficient_loading``)."""
    buffers = [(module, name, buffer) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None]
    model.to_empty(device="cpu")
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    return retie(model)


def retie(model: nn.Module) -> nn.Module:
    """Tie the model's tied parameters again (transformers' ``tie_weights``), as accelerate does around its load."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def describe(model: nn.Module) -> str:
    """The shard units of ``model``, e.g. ``32 units over 2 processes: 30 x LlamaDecoderLayer, [embed_tokens,
    lm_head], [root]``: what the log shows so that a sharded run cannot be taken for DDP."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units: dict[int, list[tuple[str, nn.Module]]] = {}  # modules sharded together share one state
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append((name, module))
    if not units:
        return "not sharded"
    counts: dict[str, int] = {}
    others = []
    for members in units.values():
        kinds = {type(m).__name__.removeprefix("FSDP") for _, m in members}
        if len(members) == 1 and kinds <= blocks and members[0][0]:
            kind = kinds.pop()
            counts[kind] = counts.get(kind, 0) + 1
        else:
            others.append("[" + ", ".join(n.rsplit(".", 1)[-1] if n else "root" for n, _ in members) + "]")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return (f"{len(units)} units over {world} processes: "
            + ", ".join([f"{n} x {kind}" for kind, n in counts.items()] + others))


def empty_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory), buffers copied: made before
    sharding, filled by :func:`gathered` afterwards. Tied parameters stay tied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded ``model``, gathered on the main process in CPU memory (other processes
    get an empty dict). Every process must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gathered(model: nn.Module, skeleton: nn.Module, main: bool) -> nn.Module | None:
    """The whole ``model`` on the main process: ``skeleton`` (:func:`empty_copy` of it before sharding) holding
    the gathered weights, on CPU; None elsewhere. Every process must call it."""
    state = full_state_dict(model)
    if not main:
        return None
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    state = {name: tensor.reshape(shapes[name]) if name in shapes and tensor.numel() == 1 else tensor
             for name, tensor in state.items()}  # the scalars of vectors_for_scalars
    buffers = {name for name, _ in skeleton.named_buffers()}
    missing, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
    missing = [n for n in missing if n not in buffers]
    if missing or unexpected:
        raise RuntimeError(f"the gathered state dict does not fit the model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    if hasattr(skeleton, "tie_weights"):
        skeleton.tie_weights()
    return skeleton


class ShardingLog(TrainerCallback):
    """Prints, once the student is sharded (training begins), how both models are sharded: a sharded run states
    it, and a DDP run cannot pass for one."""

    def __init__(self, teacher: nn.Module | None):
        self.teacher = teacher

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            teacher = "none" if self.teacher is None else (
                describe(self.teacher) if is_sharded(self.teacher) else "whole on every process")
            print(f"[sharding] FSDP2: student {describe(model)}; teacher {teacher}", flush=True)


def release(model: nn.Module) -> None:
    """Free a sharded model's memory on every process once it is no longer needed (training and the final
    evaluation are over, its whole copy gathered where one is needed): FSDP2's
    ``_apply`` re-points its shards at the moved parameters, so moving them to the meta device drops them."""
    model.to("meta")
