"""The recipe's models: the original and its converted copy (calibrated, or an already converted checkpoint and the
original it names), placed where accelerate trains, and the trained student made whole again for the save."""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

from .recipe_settings import converted_checkpoint, fail


def original_spec(config) -> str:
    """The original the converted model is trained toward (teacher and reference)."""
    converted = converted_checkpoint(config)
    if converted is None:
        return config.model
    spec = config.original or converted["normswap"].get("base_model")
    if not spec:
        raise SystemExit("finetune: the checkpoint does not name its original; set original: in the config")
    return spec


def place_for_training(model, config, state):
    """``model`` on the device accelerate trains on, so that calibration, the original's samples and the evaluations
    run there too (each runs where the model is). Under FSDP2 the model stays in CPU memory for accelerate to shard,
    and calibration's blocks visit the device one at a time (``calibration.device``)."""
    from .sharding import fsdp2_requested

    if state.device.type == "cpu":
        return model
    if fsdp2_requested():
        config.calibration.device = config.calibration.device or str(state.device)
        return model
    return model.to(state.device)


# The settings that must fit in the model's context: token lengths, and each generated source's sequence length.
CONTEXT_SETTINGS = ("block_len", "calibration.block_len", "final_eval.max_length", "calibration.data", "train_data",
                    "eval_data")


def context_settings(config) -> dict[str, int | None]:
    """Each of :data:`CONTEXT_SETTINGS` with the tokens it asks of the model's context (None: unset or unused)."""
    from ..data.texts import sample_length

    calibrating = converted_checkpoint(config) is None
    lengths = {"block_len": config.block_len, "final_eval.max_length": config.final_eval.max_length,
               "calibration.block_len": config.calibration.block_len if calibrating else None,
               "calibration.data": sample_length(config.calibration.data) if calibrating else None,
               "train_data": max(filter(None, map(sample_length, config.train_sources)), default=None),
               "eval_data": sample_length(config.eval_data)}
    return {key if key.endswith(("len", "length")) else f"{key} generated: length": lengths[key]
            for key in CONTEXT_SETTINGS}


def check_context_settings(config, models: dict) -> None:
    """Every setting of :data:`CONTEXT_SETTINGS` within the context of each model, once it is loaded and before
    calibration: a longer one failed (an IndexError, a DataError) or was cut silently after the calibration and the
    first evaluation."""
    from ..model_inputs import check_context

    for name, model in models.items():
        try:
            check_context(context_settings(config), model, name)
        except ValueError as error:
            fail(str(error))
    check_lora_targets(config, next(iter(models.values())))


def check_lora_targets(config, model) -> None:
    """``lora.target_modules`` names modules of the model (as peft matches them: a string is a regular expression
    over the whole name, a list's entries name a module or end its name): peft refused them only after the
    calibration and the first evaluation."""
    import re

    targets = config.lora.target_modules
    if config.trainable != "lora" or targets == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    try:
        found = (any(re.fullmatch(targets, name) for name in names) if isinstance(targets, str)
                 else any(name == t or name.endswith("." + t) for name in names for t in targets))
    except re.error as error:
        fail(f"lora.target_modules {targets!r} is not a regular expression ({error})")
    if not found:
        fail(f"lora.target_modules {targets!r} names no module of {config.model}: name its linear layers (e.g. "
             "q_proj, v_proj) or all-linear")


def load_models(config, state):
    """(student, original, tokenizer), on the training device (:func:`place_for_training`). The main process
    calibrates and caches; the others load its result."""
    import hf_normswap
    from ..checkpoint.record import read_config
    from ..checkpoint.loading import load_model
    from ..data import DataError

    cache = Path(config.output_dir) / "calibrated"
    if converted_checkpoint(config) is not None:
        student, tokenizer = load_model(config.model)
        original, _ = load_model(original_spec(config), with_tokenizer=False)
        check_context_settings(config, {config.model: student, original_spec(config): original})
        return place_for_training(student, config, state), place_for_training(original, config, state), tokenizer
    original, tokenizer = load_model(config.model)
    check_context_settings(config, {config.model: original})  # before calibration, the first slow step
    original = place_for_training(original, config, state)
    with state.main_process_first():
        # the main process reuses the cache on a resume (check_calibration_cache: it matches the config); the others
        # come after it and load what it has just written
        if read_config(cache) is not None and (config.resume or not state.is_main_process):
            student = place_for_training(hf_normswap.load(cache), config, state)
            print(f"[finetune] calibrated model from {cache}", flush=True)
        else:
            student = copy.deepcopy(original)
            start = time.time()
            try:
                report = hf_normswap.convert(student, to=config.method,
                                             calibration=dataclasses.replace(config.calibration, tokenizer=tokenizer))
            except DataError as error:  # e.g. the original's samples cannot be cached
                raise SystemExit(f"finetune: calibration.data: {error}") from None
            print(f"[finetune] converted {len(report.converted)} norms to {config.method.upper()} with "
                  f"calibration in {time.time() - start:.0f}s", flush=True)
            if state.is_main_process:
                hf_normswap.save_pretrained(student, cache, tokenizer=tokenizer, overwrite=True)
    return trainable_dense(student), original, tokenizer


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
            raise SystemExit("finetune: the GGUF model holds packed weights; it cannot be trained")
        model.hf_quantizer = None
        model.is_quantized = False  # set as an instance attribute at load time
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return model


def skeleton_to_gather(student):
    """Under FSDP2, a parameterless copy of the student made before it is sharded, into which the whole model is
    gathered for the save (``whole_student``); None otherwise."""
    from .sharding import empty_copy, fsdp2_requested

    return empty_copy(student) if fsdp2_requested() else None


def whole_student(trainer, model, skeleton, original, state):
    """The trained ``model`` whole on the main process, for the save and the reload check: as it is under DDP or
    one process (no ``skeleton``); sharded, gathered into ``skeleton`` (every process takes part, the others get
    None), after which the sharded student and teacher are freed: their evaluation is done, and the main process
    holds one whole model at a time."""
    from .sharding import gathered, is_sharded, release

    if skeleton is None:
        return model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optimizer.state.clear()  # training is over: its AdamW moments make room for the whole copy
    if is_sharded(original):
        release(original)
    whole = gathered(model, skeleton, state.is_main_process)
    release(model)
    return whole

