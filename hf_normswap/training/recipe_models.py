"""The recipe's models: the original and its converted copy (calibrated, or an already converted checkpoint and the
original it names), placed where accelerate trains, and the trained student made whole again for the save."""

from __future__ import annotations

import copy
import dataclasses
import re
import time

import torch
from accelerate.utils import broadcast_object_list

import hf_normswap  # its convert, load and save_pretrained looked up at the call, as a user's code calls them
from ..checkpoint import loading
from ..checkpoint.record import converted_config
from ..data import DataError
from ..model_inputs import check_context, ends_in_hidden_states
from .recovery_run import RecoveryRun
from .hand_overs import check_hand_over, chosen
from .hand_overs.blend import HandOverError
from .recipe_settings import COMMAND, fail, stopped
from .sharding import empty_copy, fsdp2_requested, gathered, is_sharded, loads_once, release, storage_for_optimizer


def place_for_training(model, device, sharded: bool):
    """``model`` on the ``device`` accelerate trains on, so that calibration, the original's samples and the
    evaluations run there too (each runs where the model is). Under FSDP2 (``sharded``) the model stays in CPU
    memory for accelerate to shard, and calibration's blocks visit the device one at a time (the run's
    ``calibration.device``)."""
    if device.type == "cpu" or sharded:
        return model
    return model.to(device)


def check_context_settings(lengths: dict, models: dict, lora_targets=None) -> None:
    """``lora_targets`` (None: no LoRA) among the first model's modules, and every setting's tokens (``lengths``:
    ``RecoveryRun.context``) within the context of each model, once they are loaded and before calibration: peft
    refused the targets, and a longer setting failed (an IndexError, a DataError) or was cut silently, only after
    the calibration and the first evaluation."""
    if lora_targets is not None:
        check_lora_targets(lora_targets, *next(iter(models.items())))
    for name, model in models.items():
        try:
            check_context(lengths, model, name)
        except ValueError as error:
            fail(str(error))


def check_lora_targets(targets, name: str, model) -> None:
    """``lora.target_modules`` (``targets``) names modules of the model ``name`` (as peft matches them: a string is a
    regular expression over the whole name, a list's entries name a module or end its name)."""
    if targets == "all-linear":
        return
    names = [module for module, _ in model.named_modules()]
    try:
        found = (any(re.fullmatch(targets, module) for module in names) if isinstance(targets, str)
                 else any(module == t or module.endswith("." + t) for module in names for t in targets))
    except re.error as error:
        fail(f"lora.target_modules {targets!r} is not a regular expression ({error})")
    if not found:
        fail(f"lora.target_modules {targets!r} names no module of {name}: name its linear layers (e.g. "
             "q_proj, v_proj) or all-linear")


def load_models(run: RecoveryRun, state):
    """(student, original, tokenizer), on the training device (:func:`place_for_training`), the tokenizer able to
    pad (:func:`ensure_pad_token`): the model the settings name is the original to calibrate, or the converted
    student, whose original is read next. Every setting is checked against them before the calibration, slow. The
    main process calibrates and caches; the others load its result, or, loading once a node
    (``run.loaded_by_main``), build it on the meta device and receive their shards when it is sharded."""
    config, cache = run.settings, run.calibrated_cache
    lora_targets = config.lora.target_modules if config.trainable == "lora" else None
    empty = run.loaded_by_main
    empty_original = empty and run.teacher_sharded  # else every process holds the original whole
    named, tokenizer = loading.load_model(config.model, empty=empty_original if run.calibrates else empty)
    ensure_pad_token(tokenizer)
    original = (named if run.calibrates
                else loading.load_model(run.original, with_tokenizer=False, empty=empty_original)[0])
    check_context_settings(run.context, {config.model: named, run.original: original}, lora_targets)
    # the norms the conversion replaces (or replaced), found on the model the settings name; an encoder's
    # train_tokens count sentences, known once read
    sentences = config.train_tokens is not None and ends_in_hidden_states(named)
    hand_over = chosen(config.hand_over.kind, config.progressive, config.taper, config.hand_over.options, "norms")
    try:
        check_hand_over(hand_over, named, run.steps, sentences, config.roles_to_convert)
    except HandOverError as error:
        fail(str(error))
    original = place_for_training(original, state.device, run.sharded)
    student = named
    if run.calibrates:
        with state.main_process_first():
            # the main process reuses the cache on a resume (check_calibration_cache: it matches the config); the
            # others come after it and load what it has just written (its config alone when the main process loads
            # once)
            if converted_config(cache) is not None and (config.resume or not state.is_main_process):
                student = (loading.load_model(str(cache), with_tokenizer=False, empty=True)[0] if empty
                           else hf_normswap.load(cache))
                print(f"[{COMMAND.get()}] calibrated model from {cache}", flush=True)
            else:
                student = copy.deepcopy(original)
                start = time.time()
                try:
                    report = hf_normswap.convert(student, to=config.method, roles=config.roles_to_convert,
                                                 calibration=dataclasses.replace(run.calibration, tokenizer=tokenizer))
                except DataError as error:  # e.g. the original's samples cannot be cached
                    raise stopped(f"calibration.data: {error}") from None
                print(f"[{COMMAND.get()}] converted {len(report.converted)} norms to {config.method.upper()} with "
                      f"calibration in {time.time() - start:.0f}s", flush=True)
                if state.is_main_process:
                    hf_normswap.save_pretrained(student, cache, tokenizer=tokenizer, overwrite=True)
    student = fp32_master_weights(trainable_dense(student))
    match_main({"student": student, "original": original}, state)
    student = place_for_training(student, state.device, run.sharded)
    if empty:  # sharded, so left in place: its meta tensors get storage
        storage_for_optimizer(student)
    return student, original, tokenizer


def fp32_master_weights(student):
    """The student in float32 whatever its checkpoint's dtype: the optimizer updates the weights it is given, and a
    bfloat16 weight rounds most updates of a small learning rate away (bf16 compute is the autocast of
    ``precision``). It is saved in float32 too: the model that was trained. A model read from a GGUF file is float32
    already and transformers refuses its ``.float()``, so a float32 model is left as it is and any other is cast by
    torch's own cast."""
    if all(p.dtype == torch.float32 for p in student.parameters() if p.is_floating_point()):
        return student
    return torch.nn.Module.float(student)


def match_main(models: dict, state) -> None:
    """Loading once a node, the models built on the meta device take the main process's dtypes (a GGUF file is
    dequantized, a checkpoint loads in its own dtype: what accelerate's and torch's broadcasts send), and a model
    whose tensors differ from the main process's is one error here rather than a broadcast that never matches."""
    if not (loads_once() and state.num_processes > 1):
        return
    layout = [{name: {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict().items()}
               for name, model in models.items()}] if state.is_main_process else [None]
    layout = broadcast_object_list(layout)[0]
    for name, model in models.items():
        if not any(p.is_meta for p in model.parameters()):
            continue
        for key, param in model.named_parameters():
            shape, dtype = layout[name].get(key, (None, None))
            if shape != tuple(param.shape):
                fail(f"the {name} built on the meta device does not match the main process's: {key} is "
                     f"{tuple(param.shape)} here, {shape} there")
            param.data = param.data.to(dtype)


def ensure_pad_token(tokenizer) -> None:
    """GPT-2's and Llama's tokenizers have no pad token, and the Trainer's collator pads with it: use EOS (or UNK).
    The blocks are packed to one length, so padding never changes what the model sees."""
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None:
            fail("the tokenizer has no pad, end-of-sequence or unknown token to pad with")


def trainable_dense(model):
    """A GGUF model is loaded dequantized into ordinary tensors but keeps its (inference-only) quantizer, and the
    Trainer refuses quantized models: drop the quantizer when no weight is still packed."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and type(quantizer).__name__ == "GgufHfQuantizer":
        if getattr(quantizer, "packed_modules", None):
            raise stopped("the GGUF model holds packed weights; it cannot be trained")
        model.hf_quantizer = None
        model.is_quantized = False  # set as an instance attribute at load time
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return model


def skeleton_to_gather(student):
    """Under FSDP2, a parameterless copy of the student made before it is sharded, into which the whole model is
    gathered for the save (``whole_student``); None otherwise."""
    return empty_copy(student) if fsdp2_requested() else None


def whole_student(trainer, model, skeleton, original, is_main: bool):
    """The trained ``model`` whole on the main process (``is_main``), for the save and the reload check: as it is
    under DDP or one process (no ``skeleton``); sharded, gathered into ``skeleton`` (every process takes part, the
    others get None), after which the sharded student and teacher are freed: their evaluation is done, and the main
    process holds one whole model at a time."""
    if skeleton is None:
        return model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optimizer.state.clear()  # training is over: its AdamW moments make room for the whole copy
    if is_sharded(original):
        release(original)
    whole = gathered(model, skeleton, is_main)
    release(model)
    return whole

