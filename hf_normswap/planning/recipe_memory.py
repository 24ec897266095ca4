"""The phases of a conversion and of a recovery run (``normswap convert`` with calibration; the recipe: load,
calibration, training step, final evaluation and save), each as the bytes it holds where.

On a CPU run (no ``device_memory``) everything is host memory. On accelerators: under DDP each model is moved to
the device as soon as it is loaded and calibrates there; under FSDP2 both stay in host memory until sharded, and
the block pass computes one block at a time on the device (``recipes/finetune.py``, ``place_for_training``).
"""

from __future__ import annotations

from .phases import (COMPILER_BYTES, DEVICE_CONTEXT_BYTES, RUNTIME_BYTES, Phase, calibration_terms, evaluation_activations,
                     others_models, trainable_parameters, training_activations)
from .plan_settings import PlanSettings
from .sizes import ModelSizes


def _place(phase: Phase, on_device: bool, terms: dict[str, int], *, main: bool = True, other: bool = False):
    """Add ``terms`` to the device when the run has one and ``on_device``, else to the host of the main process
    (and of the others with ``other``)."""
    if on_device:
        phase.device.update(terms)
        return
    if main:
        phase.main.update(terms)
    if other:
        phase.other.update(terms)


def conversion_phases(sizes: ModelSizes, settings: PlanSettings) -> list[Phase]:
    """``normswap convert`` (``hf_normswap.convert`` with calibration): one model in host memory, its blocks
    computed on the device when there is one; with ``weights_on_disk``, no weight held but the block being fitted,
    and no end-to-end steps."""
    if settings.weights_on_disk:
        settings = settings.replace(tune_rows=0)
    weights = 0 if settings.weights_on_disk else sizes.parameter_bytes(4)
    gpu = settings.device_memory is not None
    phases = [Phase("load", main={"runtime": RUNTIME_BYTES, "model": weights})]
    for stage, terms in calibration_terms(sizes, settings, block_brought=gpu or settings.weights_on_disk).items():
        phase = Phase(f"calibration: {stage}", main={"runtime": RUNTIME_BYTES, "compiled kernels": COMPILER_BYTES,
                                                      "model": weights, **terms["host"]})
        _place(phase, gpu and stage == "block pass", terms["compute"])
        if gpu:
            phase.device["context"] = DEVICE_CONTEXT_BYTES
        phases.append(phase)
    return phases


def recipe_phases(sizes: ModelSizes, settings: PlanSettings) -> list[Phase]:
    """The recipe's phases for N processes (``processes``), every byte a process holds at each one's peak."""
    n = settings.processes
    weights = sizes.parameter_bytes(4)
    gpu = settings.device_memory is not None
    ddp_gpu = gpu and not settings.sharded
    runtime = {"runtime": RUNTIME_BYTES}
    compiled = {"runtime": RUNTIME_BYTES, "compiled kernels": COMPILER_BYTES}  # once the student has run
    context = {"context": DEVICE_CONTEXT_BYTES} if gpu else {}
    phases = []

    # 1. load: the original on every process, the calibrated student (the main one's copy, the others' reload of
    # its cache), or under FSDP2 loading once a node on the main process alone (others_models); under DDP on
    # accelerators each goes to the device as it loads. The main process evaluates the calibrated model against the
    # original before training.
    evaluation = {"evaluation window": evaluation_activations(sizes, settings)}
    others = others_models(weights, settings)
    load = Phase("load", main=dict(compiled), other=dict(runtime), device=dict(context))
    _place(load, ddp_gpu, {"original": weights, "student": weights})
    _place(load, ddp_gpu, others, main=False, other=True)
    _place(load, gpu, evaluation)
    if ddp_gpu:
        load.main["model being loaded"] = load.other["model being loaded"] = weights
    if settings.sharded and settings.shard_teacher and n > 1:  # the teacher is sharded as the trainer is made
        if others:  # every process holds its shard beside its whole copy
            _place(load, gpu, {"teacher's shard": weights // n}, other=True)
        else:  # loading once a node (sharding.shard_from_main): the main process sends a shard unit at a time and
            # frees each unit's whole weights once sent; the others receive each tensor whole, then keep their part
            _place(load, gpu, {"shard unit being sent": max(sizes.largest_unit, sizes.root) * 4 // n})
            _place(load, gpu, {"teacher's shard": weights // n,
                               "tensor being received": sizes.vocab * sizes.hidden * 4}, main=False, other=True)
    phases.append(load)

    # 2. calibration on the main process, the others holding the original meanwhile
    if settings.calibrate:
        for stage, terms in calibration_terms(sizes, settings, block_brought=gpu and not ddp_gpu).items():
            phase = Phase(f"calibration: {stage}", main=dict(compiled), other=dict(runtime), device=dict(context))
            _place(phase, ddp_gpu, {"original": weights, "student": weights})
            _place(phase, ddp_gpu, {k: v for k, v in others.items() if k == "original"}, main=False, other=True)
            phase.main.update(terms["host"])
            if ddp_gpu:  # the logits are kept where the model computes them
                logits = {k: phase.main.pop(k) for k in list(phase.main) if k.startswith("original's logits")}
                phase.device.update(logits)
            block_on_device = gpu and (ddp_gpu or stage == "block pass")
            _place(phase, block_on_device, terms["compute"])
            phases.append(phase)

    # 3. a training step
    trainable = trainable_parameters(sizes, settings)
    shards = n if settings.sharded else 1
    unit, root = sizes.largest_unit * 4, sizes.root * 4
    student = {"student": weights // shards}
    if settings.trainable == "lora":
        student["LoRA adapters"] = settings.lora_rank * sizes.lora_pairs * 4
    state = {"gradients": trainable * 4 // shards, "AdamW moments": 2 * trainable * 4 // shards}
    if n > 1 and not settings.sharded:
        state["DDP gradient buckets"] = trainable * 4
    if settings.precision == "bf16":
        state["bf16 copies of trained weights"] = trainable * 2 // shards
    gathered = {"gathered blocks (this and the next)": 2 * unit + root} if settings.sharded else {}
    if settings.sharded and settings.shard_teacher:
        teacher = {"teacher": weights // shards, "teacher's gathered root and block": root + unit}
    else:
        teacher = {"teacher": weights}
    step = Phase("training step", main=dict(compiled), other=dict(compiled), device=dict(context))
    if settings.optimizer_offload:  # FSDP2 keeps shards, gradients and AdamW on the host, computes on the device
        _place(step, False, {**student, **state}, other=True)
        _place(step, gpu, {**gathered, **teacher, **training_activations(sizes, settings)}, other=True)
    else:
        _place(step, gpu, {**student, **state, **gathered, **teacher, **training_activations(sizes, settings)},
               other=True)
    phases.append(step)

    # 4. final evaluation and save: sharded, every process evaluates the sharded models, then the main one gathers
    # the student alone into host memory, saves it and reloads it; otherwise the main process evaluates, saves and
    # reloads beside the trained model, its teacher and AdamW's moments
    final = Phase("final evaluation and save", main=dict(compiled), other=dict(compiled), device=dict(context))
    if settings.sharded:
        offloaded = {**student, "AdamW moments": state["AdamW moments"]}
        _place(final, gpu and not settings.optimizer_offload, offloaded, other=True)
        _place(final, gpu, {**teacher, **gathered, **evaluation}, other=True)
        final.main["gathered student (save, then reload)"] = weights
    else:
        kept = {**student, "teacher": weights, "AdamW moments": state["AdamW moments"]}
        if "DDP gradient buckets" in state:
            kept["DDP gradient buckets"] = state["DDP gradient buckets"]
        _place(final, gpu, kept, other=True)
        _place(final, gpu, {"reload check": max(weights, evaluation["evaluation window"])})
        if gpu:
            final.main["reload check (before the device)"] = weights
    phases.append(final)
    return phases

