"""The phases of a conversion and of a recovery run (``normswap convert`` with calibration; the recipe: load,
calibration, training step, final evaluation and save), each as the bytes it holds where.

On a CPU run (no ``device_memory``) everything is host memory. On accelerators: under DDP each model is moved to
the device as soon as it is loaded and calibrates there; under FSDP2 both stay in host memory until sharded, and
the block pass computes one block at a time on the device (``recipes/finetune.py``, ``place_for_training``).
"""

from __future__ import annotations

from .phases import (COMPILER_BYTES, DEVICE_CONTEXT_BYTES, RUNTIME_BYTES, Phase, calibration_terms, evaluation_activations,
                     others_models, trainable_parameters, training_activations, value_bytes)
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


def _phase(name: str, gpu: bool, *, others_compiled: bool) -> Phase:
    """A phase seeded with what every process holds anyway, so each phase need not repeat it."""
    # the runtime (compiled kernels once the student has run), and the device context when there is a device
    compiled = {"runtime": RUNTIME_BYTES, "compiled kernels": COMPILER_BYTES}
    other = dict(compiled) if others_compiled else {"runtime": RUNTIME_BYTES}
    return Phase(name, main=compiled, other=other, device={"context": DEVICE_CONTEXT_BYTES} if gpu else {})


def _load_phase(sizes: ModelSizes, weights: int, n: int, gpu: bool, ddp_gpu: bool, teacher_sharded: bool,
                others: dict[str, int], evaluation: dict[str, int]) -> Phase:
    """The load, apart because where each copy lands depends on DDP or FSDP2 and on how the teacher is sharded."""
    # The original on every process, the calibrated student (the main one's copy, the others' reload of its cache),
    # or under FSDP2 loading once a node on the main process alone (others_models); under DDP on accelerators each
    # goes to the device as it loads. The main process evaluates the calibrated model against the original before
    # training.
    load = _phase("load", gpu, others_compiled=False)
    _place(load, ddp_gpu, {"original": weights, "student": weights})
    _place(load, ddp_gpu, others, main=False, other=True)
    _place(load, gpu, evaluation)
    if ddp_gpu:
        load.main["model being loaded"] = load.other["model being loaded"] = weights
    if teacher_sharded and n > 1:  # the teacher is sharded as the trainer is made
        if others:  # every process holds its shard beside its whole copy
            _place(load, gpu, {"teacher's shard": weights // n}, other=True)
        else:  # loading once a node (sharding.shard_from_main): the main process sends a shard unit at a time and
            # frees each unit's whole weights once sent; the others receive each tensor whole, then keep their part
            _place(load, gpu, {"shard unit being sent": max(sizes.largest_unit, sizes.root) * 4 // n})
            _place(load, gpu, {"teacher's shard": weights // n,
                               "tensor being received": sizes.vocab * sizes.hidden * 4}, main=False, other=True)
    return load


def _calibration_phases(stages: dict[str, dict[str, dict[str, int]]], weights: int, gpu: bool, ddp_gpu: bool,
                        others: dict[str, int]) -> list[Phase]:
    """Calibration on the main process, the others holding the original meanwhile, one phase per stage."""
    phases = []
    for stage, terms in stages.items():
        phase = _phase(f"calibration: {stage}", gpu, others_compiled=False)
        _place(phase, ddp_gpu, {"original": weights, "student": weights})
        _place(phase, ddp_gpu, {k: v for k, v in others.items() if k == "original"}, main=False, other=True)
        phase.main.update(terms["host"])
        if ddp_gpu:  # the logits are kept where the model computes them
            logits = {k: phase.main.pop(k) for k in list(phase.main) if k.startswith("original's logits")}
            phase.device.update(logits)
        block_on_device = gpu and (ddp_gpu or stage == "block pass")
        _place(phase, block_on_device, terms["compute"])
        phases.append(phase)
    return phases


def _training_state(sizes: ModelSizes, weights: int, trainable: int, n: int, sharded: bool, lora_rank: int | None,
                    bf16: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The student and its optimiser state per process, which both the training step and the final phase hold."""
    shards = n if sharded else 1
    student = {"student": weights // shards}
    if lora_rank is not None:
        student["LoRA adapters"] = lora_rank * sizes.lora_pairs * 4
    state = {"gradients": trainable * 4 // shards, "AdamW moments": 2 * trainable * 4 // shards}
    if n > 1 and not sharded:
        state["DDP gradient buckets"] = trainable * 4
    if bf16:
        state["bf16 copies of trained weights"] = trainable * 2 // shards
    return student, state


def _teacher_and_gathered(sizes: ModelSizes, weights: int, n: int, sharded: bool,
                          shard_teacher: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The teacher and FSDP2's gathered blocks per process, which both the training step and the final phase hold."""
    unit, root = sizes.largest_unit * 4, sizes.root * 4
    gathered = {"gathered blocks (this and the next)": 2 * unit + root} if sharded else {}
    if sharded and shard_teacher:
        teacher = {"teacher": weights // n, "teacher's gathered root and block": root + unit}
    else:
        teacher = {"teacher": weights}
    return teacher, gathered


def _training_step(gpu: bool, offload: bool, student: dict[str, int], state: dict[str, int],
                   gathered: dict[str, int], teacher: dict[str, int], activations: dict[str, int]) -> Phase:
    """A training step, apart because optimizer offload splits its terms between the host and the device."""
    step = _phase("training step", gpu, others_compiled=True)
    if offload:  # FSDP2 keeps shards, gradients and AdamW on the host, computes on the device
        _place(step, False, {**student, **state}, other=True)
        _place(step, gpu, {**gathered, **teacher, **activations}, other=True)
    else:
        _place(step, gpu, {**student, **state, **gathered, **teacher, **activations}, other=True)
    return step


def _final_sharded(gpu: bool, offload: bool, weights: int, student: dict[str, int], state: dict[str, int],
                   teacher: dict[str, int], gathered: dict[str, int], evaluation: dict[str, int]) -> Phase:
    """The final phase under FSDP2, apart because only the student is gathered whole, on the main host, to save."""
    # every process evaluates the sharded models, then the main one gathers the student alone into host memory,
    # saves it and reloads it
    final = _phase("final evaluation and save", gpu, others_compiled=True)
    offloaded = {**student, "AdamW moments": state["AdamW moments"]}
    _place(final, gpu and not offload, offloaded, other=True)
    _place(final, gpu, {**teacher, **gathered, **evaluation}, other=True)
    final.main["gathered student (save, then reload)"] = weights
    return final


def _final_replicated(gpu: bool, weights: int, student: dict[str, int], state: dict[str, int],
                      evaluation: dict[str, int]) -> Phase:
    """The final phase unsharded, apart because the main process reloads beside everything training still holds."""
    # the main process evaluates, saves and reloads beside the trained model, its teacher and AdamW's moments
    final = _phase("final evaluation and save", gpu, others_compiled=True)
    kept = {**student, "teacher": weights, "AdamW moments": state["AdamW moments"]}
    if "DDP gradient buckets" in state:
        kept["DDP gradient buckets"] = state["DDP gradient buckets"]
    _place(final, gpu, kept, other=True)
    _place(final, gpu, {"reload check": max(weights, evaluation["evaluation window"])})
    if gpu:
        final.main["reload check (before the device)"] = weights
    return final


def _step_activations(sizes: ModelSizes, settings: PlanSettings) -> dict[str, int]:
    """A training step's activations, with what each of the recipe's loss terms holds for itself (a term's own
    ``memory``, the layer-wise term's the teacher's every block output)."""
    activations = training_activations(sizes, settings)
    tokens = settings.batch_size * settings.seq_len
    for term in settings.loss_terms:
        activations.update(term.memory(sizes, tokens, value_bytes(settings), settings.seq_len))
    return activations


def recipe_phases(sizes: ModelSizes, settings: PlanSettings) -> list[Phase]:
    """The recipe's phases for N processes (``processes``), every byte a process holds at each one's peak."""
    n = settings.processes
    weights = sizes.parameter_bytes(4)
    gpu = settings.device_memory is not None
    ddp_gpu = gpu and not settings.sharded

    # 1. load, with the evaluation of the calibrated model against the original before training
    evaluation = {"evaluation window": evaluation_activations(sizes, settings)}
    others = others_models(weights, settings)
    phases = [_load_phase(sizes, weights, n, gpu, ddp_gpu, settings.sharded and settings.shard_teacher, others,
                          evaluation)]

    # 2. calibration on the main process
    if settings.calibrate:
        stages = calibration_terms(sizes, settings, block_brought=gpu and not ddp_gpu)
        phases.extend(_calibration_phases(stages, weights, gpu, ddp_gpu, others))

    # 3. a training step
    trainable = trainable_parameters(sizes, settings)
    lora_rank = settings.lora_rank if settings.trainable == "lora" else None
    student, state = _training_state(sizes, weights, trainable, n, settings.sharded, lora_rank,
                                     settings.precision == "bf16")
    teacher, gathered = _teacher_and_gathered(sizes, weights, n, settings.sharded, settings.shard_teacher)
    phases.append(_training_step(gpu, settings.optimizer_offload, student, state, gathered, teacher,
                                 _step_activations(sizes, settings)))

    # 4. final evaluation and save
    if settings.sharded:
        phases.append(_final_sharded(gpu, settings.optimizer_offload, weights, student, state, teacher, gathered,
                                     evaluation))
    else:
        phases.append(_final_replicated(gpu, weights, student, state, evaluation))
    return phases
