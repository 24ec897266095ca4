"""Fine-tune a DyT / ELN model against its original: convert with calibration, train, evaluate, save.

    accelerate launch recipes/finetune.py --config recipes/configs/smollm2-eln.yaml
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/finetune.py --config ...
    accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml recipes/finetune.py --config ...  (sharded)
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml training.max_steps=50 max_minutes=10
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml train_tokens=500000 output_dir=DIR

Settings come from the YAML config, then from ``key=value`` overrides (dotted keys reach into sections; values are
read as YAML). Steps, top to bottom:

1. load the original (Hub id, directory, ``.gguf``, ``offline:smollm2``) and convert a copy with calibration, or
   load an already converted checkpoint (its original from ``original:``); the calibrated model is cached in
   ``OUTPUT/calibrated`` so a resumed run does not calibrate again (it refuses a cache calibrated otherwise;
   ``resume=false`` calibrates anew);
2. evaluate perplexity of the calibrated model against the original (main process);
3. train with ``hf_normswap.training.distill.NormSwapTrainer``: cross-entropy plus optional distillation from the frozen
   original (its logits and / or every block's output, ``hf_normswap.training.layerwise``; a sentence encoder trains on the
   blocks' outputs alone), norm-only / full / LoRA training, optional progressive conversion, ``train_tokens`` in
   total over every launch (it sets ``max_steps``); resumes from the last checkpoint, so a long run can be done in
   chunks;
4. evaluate again (a sentence encoder: mean cosine of sentence embeddings to the original's), save the checkpoint with remote code and a model card that records the training, check that it
   reloads with identical logits, draw the loss / perplexity curve, optionally push to the Hub.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch

# ------------------------------------------------------------------------------------------------ configuration


def fail(message: str):
    """A mistake in the settings: one line on stderr, exit code 2, before anything is loaded."""
    print(f"finetune: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_config(argv=None):
    """The settings (``hf_normswap.training.config.RecipeConfig``) of the YAML file and the overrides, every key,
    type and range checked, then what they name on disk, before anything is loaded."""
    from hf_normswap.checkpoint.hub import PushError, preflight
    from hf_normswap.checkpoint.loading import ModelLoadError
    from hf_normswap.checkpoint.packaged import PackagedModelMissing
    from hf_normswap.checkpoint.save_load import CheckpointError, check_output_dir
    from hf_normswap.training.config import read_recipe_config
    from hf_normswap.training.run_dir import check_run_dir
    from hf_normswap.validation import ValidationError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file (recipes/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. training.max_steps=20 method=dyt")
    args = parser.parse_args(argv)
    try:
        check_sharding()  # first: a DeepSpeed environment fails the TrainingArguments check with another reason
        config = read_recipe_config(args.config, args.overrides)
        check_run_dir(config)
        check_output_dir(config.save_path, overwrite=True)
        check_calibration_cache(config)
        if config.push_to_hub:
            preflight(config.push_to_hub)
    except (ValidationError, CheckpointError, PushError, ModelLoadError, PackagedModelMissing) as error:
        fail(str(error))
    return config


def check_sharding() -> None:
    """FSDP2 is the sharded engine (``hf_normswap.training.sharding``); FSDP1 and DeepSpeed ZeRO-3 are refused
    before anything loads: the gather for the final evaluation and save is FSDP2's, and ZeRO-3 is untested here."""
    from hf_normswap.training.sharding import fsdp2_requested
    from hf_normswap.validation import ValidationError

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not fsdp2_requested():
        raise ValidationError("FSDP1 is not supported: launch with recipes/accelerate_configs/fsdp2.yaml "
                              "(fsdp_version: 2)")
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        raise ValidationError("DeepSpeed ZeRO-3 is not supported: shard with FSDP2 "
                              "(recipes/accelerate_configs/fsdp2.yaml)")


def check_calibration_cache(config) -> None:
    """A resumed run reuses ``OUTPUT/calibrated`` only if it was converted as the config asks: another method or
    other calibration settings in the same output_dir would otherwise train a start the config does not describe.
    The cached model's own record (``ConvertConfig.from_pretrained``) is compared with the config."""
    from hf_normswap.checkpoint.save_load import read_config
    from hf_normswap.convert import ConvertConfig
    from hf_normswap.validation import ValidationError

    cache = Path(config.output_dir) / "calibrated"
    if not (config.resume and converted_checkpoint(config) is None and read_config(cache)):
        return
    made = ConvertConfig.from_pretrained(cache)
    how_it_ran = ("progress", "plots", "device", "cache_memory_mb", "tokenizer")  # not what it made
    names = [f.name for f in dataclasses.fields(config.calibration) if f.name not in how_it_ran]
    asked = {"method": config.method, **{name: getattr(config.calibration, name) for name in names}}
    recorded = {"method": made.method, **{name: getattr(made.calibration, name) for name in names}}
    filled_in = (None, "auto")  # left to the strategy: recorded as the strategy resolved them
    differ = [f"{key} {recorded[key]!r} (the config: {value!r})" for key, value in asked.items()
              if value not in filled_in and recorded[key] != value]
    if differ:
        raise ValidationError(f"{cache} was calibrated with {', '.join(differ)}: name another output_dir, or set "
                              "resume=false to calibrate again")


# --------------------------------------------------------------------------------------------------------- data


def check_data(config) -> None:
    """Read every text source before any model loads, so a missing file or an unreachable Hub dataset stops the
    run at once with one line naming the key that overrides it."""
    from hf_normswap.data import DataError, generation_settings, load_texts, same_sample
    from hf_normswap.data import is_generated
    from hf_normswap.data import packed_stream

    training = [("train_data", spec, "calibration") for spec in config.train_sources]
    sources = [*training, ("eval_data", config.eval_data, "evaluation")]
    if converted_checkpoint(config) is None:  # a converted checkpoint is calibrated already
        sources.insert(0, ("calibration.data", config.calibration.data, "calibration"))
    if config.streaming:  # one row read: the stream is opened, not downloaded
        sources = [s for s in sources if s[0] != "train_data"]
        try:
            packed_stream(config.train_data, None, config.block_len)
        except DataError as error:
            fail(f"train_data: {error}")
    for key, spec, split in sources:
        try:
            if is_generated(spec):
                generation_settings(spec)  # sampled once the original is loaded
            else:  # a token budget of 1: a large local file is opened, not read whole (data.LAZY_BYTES)
                load_texts(spec, split, max_tokens=1)
        except DataError as error:
            fail(f"{key}: {error} ({key}=PATH)")
    if any(same_sample(spec, config.eval_data) for spec in (*config.train_sources, config.calibration.data)):
        fail(f"eval_data {config.eval_data} samples the same text as the training or calibration data: give it "
             "another seed, e.g. eval_data=generated:seed=1")
    mixed = config.train_sources
    if any(a == b or same_sample(a, b) for i, a in enumerate(mixed) for b in mixed[i + 1:]):
        fail(f"train_data {mixed} names the same text twice: mix different sources (generated samples with another "
             "seed, e.g. generated:seed=1)")


def block_dataset(tokenizer, spec: str, split: str, block_len: int, max_tokens: int | None = None,
                  max_blocks: int | None = None, *, original=None, state=None):
    """Packed causal-LM blocks (``input_ids`` = ``labels``) of a text spec, as a ``datasets.Dataset``. The original's
    samples (``generated``) are drawn up to the budget, each process its share (``state``)."""
    import datasets

    from hf_normswap.data import DataError, load_texts, token_blocks

    limits = [n for n in (max_blocks, None if max_tokens is None else max_tokens // block_len) if n is not None]
    share = {"rank": state.process_index, "world_size": state.num_processes} if state is not None else {}
    try:
        texts = load_texts(spec, split, model=original, tokenizer=tokenizer,
                           max_tokens=min(limits) * block_len if limits else None, **share)
        blocks = token_blocks(tokenizer, texts, min(limits) if limits else None, block_len).tolist()
    except DataError as error:
        raise SystemExit(f"finetune: {spec}: {error}") from None
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def mixed(parts: list):
    """The training rows of a mix: each source's rows in turn, a shorter source read again until the longest ends
    (``interleave_datasets``, all exhausted), so every source is an equal share of what the run trains on."""
    import datasets

    return parts[0] if len(parts) == 1 else datasets.interleave_datasets(parts, stopping_strategy="all_exhausted")


def training_blocks(config, tokenizer, original, state):
    """``train_data`` packed into blocks, each source of a mix up to its share (``training_budget``)."""
    return mixed([block_dataset(tokenizer, spec, "calibration", config.block_len,
                                training_budget(config, spec, state.num_processes), original=original, state=state)
                  for spec in config.train_sources])


def streamed_dataset(config, tokenizer):
    """``train_data`` streamed from the Hub, packed into blocks on the fly (``hf_normswap.data.streaming``)."""
    from hf_normswap.data import DataError
    from hf_normswap.data import packed_stream

    try:
        return packed_stream(config.train_data, tokenizer, config.block_len)
    except DataError as error:
        raise SystemExit(f"finetune: {config.train_data}: {error}") from None


def training_budget(config, spec: str, world_size: int) -> int | None:
    """Tokens to read of one training source: its share of ``max_train_tokens`` (None: all of it); for the
    original's samples, which have no end, its share of what the run trains on over every launch (``train_tokens``,
    else ``training.max_steps`` global batches) within that cap. A share is at least a block."""
    from hf_normswap.data import is_generated

    def share(tokens):
        return None if tokens is None else max(tokens // len(config.train_sources), config.block_len)

    training = config.training
    steps = training.get("max_steps", -1)
    run = config.train_tokens or (steps * training["per_device_train_batch_size"] * world_size * config.block_len
                                  * training.get("gradient_accumulation_steps", 1) if steps > 0 else None)
    cap = share(config.max_train_tokens)
    if not is_generated(spec) or run is None:
        return cap
    return min(share(run), cap or share(run))


def sentence_dataset(tokenizer, spec: str, max_len: int, max_tokens: int | None = None):
    """A sentence encoder's training rows: prose sentences with the tokenizer's special tokens, as the encoder is
    used and evaluated (``hf_normswap.evaluation.embeddings``), padded per batch by the Trainer's collator. Packed blocks would
    train it on inputs it never sees: no [CLS] / [SEP], no padding."""
    import datasets

    from hf_normswap.data import DataError, load_texts
    from hf_normswap.evaluation.embeddings import sentences

    try:
        found = sentences(load_texts(spec, "calibration"), tokenizer, max_tokens, max_sentences=None)
    except DataError as error:
        raise SystemExit(f"finetune: {spec}: {error}") from None
    if not found:
        within = f" within {max_tokens} tokens (max_train_tokens)" if max_tokens else ""
        raise SystemExit(f"finetune: {spec}: no prose sentences to train a sentence encoder on{within}")
    return datasets.Dataset.from_dict(dict(tokenizer(found, truncation=True, max_length=max_len)))


def tokens_per_row(dataset) -> float:
    """Mean tokens of a training row (``block_len`` for packed blocks): what ``train_tokens`` steps are counted in."""
    rows = dataset["input_ids"]
    return sum(map(len, rows)) / len(rows)


@torch.no_grad()
def block_perplexity(model, dataset, batch_size: int = 4) -> float:
    """exp(mean next-token loss) over the eval blocks: the same number the Trainer logs as eval_perplexity."""
    model.eval()
    losses = []
    for start in range(0, len(dataset), batch_size):
        ids = torch.tensor(dataset[start:start + batch_size]["input_ids"], device=next(model.parameters()).device)
        losses.append(float(model(input_ids=ids, labels=ids).loss) * len(ids))
    return math.exp(sum(losses) / len(dataset))


# -------------------------------------------------------------------------------------------------------- models


def converted_checkpoint(config) -> dict | None:
    """config.json of ``model`` when it is a checkpoint converted by hf_normswap (no calibration then), else None."""
    from hf_normswap.checkpoint.save_load import read_config

    return read_config(config.model) if Path(config.model).is_dir() else None


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
    from hf_normswap.training.sharding import fsdp2_requested

    if state.device.type == "cpu":
        return model
    if fsdp2_requested():
        config.calibration.device = config.calibration.device or str(state.device)
        return model
    return model.to(state.device)


def load_models(config, state):
    """(student, original, tokenizer), on the training device (:func:`place_for_training`). The main process
    calibrates and caches; the others load its result."""
    import hf_normswap
    from hf_normswap.checkpoint.save_load import read_config
    from hf_normswap.checkpoint.loading import load_model

    cache = Path(config.output_dir) / "calibrated"
    if converted_checkpoint(config) is not None:
        student, tokenizer = load_model(config.model)
        original, _ = load_model(original_spec(config), with_tokenizer=False)
        return place_for_training(student, config, state), place_for_training(original, config, state), tokenizer
    original, tokenizer = load_model(config.model)
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
            report = hf_normswap.convert(student, to=config.method,
                                         calibration=dataclasses.replace(config.calibration, tokenizer=tokenizer))
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
    from hf_normswap.training.sharding import empty_copy, fsdp2_requested

    return empty_copy(student) if fsdp2_requested() else None


def whole_student(trainer, model, skeleton, original, state):
    """The trained ``model`` whole on the main process, for the save and the reload check: as it is under DDP or
    one process (no ``skeleton``); sharded, gathered into ``skeleton`` (every process takes part, the others get
    None), after which the sharded student and teacher are freed: their evaluation is done, and the main process
    holds one whole model at a time."""
    from hf_normswap.training.sharding import gathered, is_sharded, release

    if skeleton is None:
        return model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optimizer.state.clear()  # training is over: its AdamW moments make room for the whole copy
    if is_sharded(original):
        release(original)
    whole = gathered(model, skeleton, state.is_main_process)
    release(model)
    return whole


def evaluation_texts(config, original, tokenizer) -> list[str]:
    from hf_normswap.data import load_texts

    return load_texts(config.eval_data, "evaluation", model=original, tokenizer=tokenizer,
                      max_tokens=config.final_eval.max_tokens)


def final_evaluation(model, original, tokenizer, texts: list[str], config, name: str):
    """The converted model against the original on ``texts``. Sharded models are evaluated on every process
    alike (each forward gathers its units from all of them)."""
    from hf_normswap.evaluation.perplexity import evaluate
    from hf_normswap.evaluation.embeddings import evaluate_embeddings
    from hf_normswap.model_inputs import ends_in_hidden_states

    if ends_in_hidden_states(original):  # the embedding its users consume: cosine, neighbours and rank correlation
        return evaluate_embeddings(model, original, tokenizer, texts, data=config.eval_data, **config.final_eval.arguments())
    return evaluate({name: model}, tokenizer, texts, against=original, data=config.eval_data, progress=False,
                    **config.final_eval.arguments())


def training_precision(config, student, original, train_set, tokenizer, state):
    """fp32 or bf16 autocast (``precision``); ``auto`` times the recipe's own step (forward, loss, backward; one
    batch of training rows) in both on the main process, and every process takes its answer."""
    from accelerate.utils import broadcast_object_list

    from hf_normswap.training.distill import training_step_precision

    choice = [None]
    if state.is_main_process or config.precision != "auto":
        distill = config.distill
        count = config.training["per_device_train_batch_size"]
        rows = ([row["input_ids"] for row in train_set.take(count)] if config.streaming
                else train_set[:count]["input_ids"])
        batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # sentences differ in length
        choice = [training_step_precision(config.precision, student, original, dict(batch), device=state.device,
                                          head_chunk=config.head_chunk, distill_weight=distill.weight,
                                          temperature=distill.temperature, logits=distill.logits,
                                          hidden_weight=distill.hidden, sink_weight=distill.sink_weight,
                                          embedding_weight=distill.embedding)]
    if state.num_processes > 1 and config.precision == "auto":
        choice = broadcast_object_list(choice)
    return choice[0]


# ---------------------------------------------------------------------------------------------------- reporting


def plot_history(history: list[dict], path: Path, original_ppl: float | None, title: str) -> Path:
    """Training loss, each parameter group's learning rate, and eval perplexity, over training tokens (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tokens(rows):
        return [h.get("num_input_tokens_seen", 0) for h in rows]

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_perplexity" in h]
    fig, (ax_loss, ax_lr, ax_ppl) = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        ax_loss.plot(tokens(train), [h["loss"] for h in train], label="training loss")
        for key, label in (("ce_loss", "cross-entropy"), ("kd_loss", "distillation KL"),
                           ("hidden_loss", "layer-wise"), ("embedding_loss", "1 - embedding cosine")):
            rows = [h for h in train if h.get(key)]  # a term that is off logs 0
            if rows:
                ax_loss.plot(tokens(rows), [h[key] for h in rows], lw=0.8, label=label)
        ax_loss.legend(fontsize=8)
    for key in sorted({k for h in train for k in h if k.startswith("learning_rate/")}):
        rows = [h for h in train if key in h]
        ax_lr.plot(tokens(rows), [h[key] for h in rows], label=key.split("/", 1)[1])
    if ax_lr.lines:
        ax_lr.legend(fontsize=8, title="parameter group", title_fontsize=8)
    ax_loss.set(xlabel="training tokens", ylabel="loss", title="training")
    ax_lr.set(xlabel="training tokens", ylabel="learning rate", title="learning rate per parameter group",
              yscale="log")
    if evals:
        ax_ppl.plot(tokens(evals), [h["eval_perplexity"] for h in evals], "o-", label="converted")
    if original_ppl is not None:
        ax_ppl.axhline(original_ppl, c="k", ls="--", label=f"original ({original_ppl:.4g})")
        ax_ppl.axhline(1.3 * original_ppl, c="grey", ls=":", label="1.3 x original")
    ax_ppl.set(xlabel="training tokens", ylabel="perplexity", title="eval perplexity", yscale="log")
    if ax_ppl.lines:  # an encoder has no perplexity (it is evaluated by embedding cosine after training)
        ax_ppl.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def probe_logits(model, tokenizer) -> torch.Tensor:
    """The model's output on a fixed input, for the reload check."""
    from hf_normswap.model_inputs import first_tensor

    ids = tokenizer("Normalization layers can be replaced by element-wise functions.", return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return first_tensor(model(input_ids=ids["input_ids"].to(next(model.parameters()).device)))


def reloads_identically(expected: torch.Tensor, directory: Path, tokenizer) -> bool:
    """Load the saved checkpoint back (hf_normswap.load) and compare its logits with the saved model's
    (``probe_logits`` before the save) bit for bit."""
    import hf_normswap

    reloaded = hf_normswap.load(directory).to(expected.device)
    return torch.equal(expected, probe_logits(reloaded, tokenizer))


# ----------------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    config = load_config(argv)
    check_data(config)
    if config.threads:
        torch.set_num_threads(int(config.threads))
    from accelerate import PartialState
    from transformers import TrainingArguments, set_seed

    import hf_normswap
    from hf_normswap.training.distill import (NormSwapTrainer, WallClockStop, apply_lora, disable_dropout, freeze_embeddings,
                                     merge_lora, set_trainable, without_autocast_wrapper)
    from hf_normswap.model_inputs import ends_in_hidden_states
    from hf_normswap.training.progressive import ProgressiveSwap, ProgressiveSwapCallback, schedule
    from hf_normswap.training.run_dir import claim_run_dir, last_checkpoint, read_json, write_json
    from hf_normswap.training.sharding import fsdp2_requested, is_sharded

    # On a machine without GPU, `accelerate launch --multi_gpu --num_processes N` starts N CPU processes; they
    # join with gloo only when the state is created with cpu=True (accelerate's --cpu starts a single process).
    cpu = bool(config.training.get("use_cpu")) or not torch.cuda.is_available()
    config.training["use_cpu"] = cpu
    state = PartialState(cpu=cpu)
    set_seed(config.seed)
    out = Path(config.output_dir)
    save_dir = config.save_path
    summary_path = out / "summary.json"
    if state.is_main_process:
        claim_run_dir(config)
    summary = (read_json(summary_path) or {}) if config.resume else {}
    summary["config"] = config.to_dict()
    log = (lambda *a: print("[finetune]", *a, flush=True)) if state.is_main_process else (lambda *a: None)

    # 1. models
    student, original, tokenizer = load_models(config, state)
    ensure_pad_token(tokenizer)
    original.eval().requires_grad_(False)
    converted = dict(student.config.normswap["converted"])
    log(f"{len(converted)} {student.config.normswap['method'].upper()} norms; original {original_spec(config)}")

    # 2. evaluate the calibrated model (once: a resumed run keeps the first measurement)
    eval_texts = evaluation_texts(config, original, tokenizer) if state.is_main_process else None
    if state.is_main_process and "calibrated" not in summary:
        start = time.time()
        before = final_evaluation(student, original, tokenizer, eval_texts, config, "calibrated")
        summary["calibrated"] = before.to_dict()
        write_json(summary_path, summary)
        log(f"after calibration ({time.time() - start:.0f}s):\n{before.table()}")
    state.wait_for_everyone()
    if fsdp2_requested() and not state.is_main_process:  # under FSDP2 every process takes part in the final one
        eval_texts = evaluation_texts(config, original, tokenizer)

    # 3. train
    encoder = ends_in_hidden_states(original)
    distill = config.distill
    hidden_terms = distill.hidden or distill.embedding
    if encoder and not (distill.weight == 1 and not distill.logits and hidden_terms):
        fail("a sentence encoder has no logits: train it on hidden states alone, distill.weight=1 "
             "distill.logits=false and distill.hidden or distill.embedding > 0 (recipes/configs/minilm-eln.yaml)")
    if encoder:  # trained on hidden states alone; evaluated by embedding cosine after training
        train_set = mixed([sentence_dataset(tokenizer, spec, config.block_len,
                                            training_budget(config, spec, state.num_processes))
                           for spec in config.train_sources])
        eval_set = None
    else:
        train_set = (streamed_dataset(config, tokenizer) if config.streaming
                     else training_blocks(config, tokenizer, original, state))
        eval_set = block_dataset(tokenizer, config.eval_data, "evaluation", config.block_len,
                                 max_blocks=config.eval_blocks, original=original, state=state)
    if config.train_tokens is not None:  # takes precedence over max_steps
        training = config.training
        per_step = ((config.block_len if config.streaming else tokens_per_row(train_set))
                    * training["per_device_train_batch_size"]
                    * training.get("gradient_accumulation_steps", 1) * state.num_processes)
        training["max_steps"] = max(1, math.ceil(int(config.train_tokens) / per_step))
    progressive = config.progressive
    swap = None
    if progressive.enabled:
        stages = schedule({name: entry["role"] for name, entry in converted.items()}, start=progressive.start,
                          every=progressive.every, ramp=progressive.ramp, order=progressive.order,
                          role_order=progressive.role_order, group=progressive.group)
        swap = ProgressiveSwap(student, {n: original.get_submodule(n) for n in converted}, stages)
        log(f"progressive: {len(stages)} stages by {progressive.order}, every {progressive.every} steps")
    dropout = disable_dropout(student)  # before LoRA, whose own dropout is the lora config's
    if dropout:
        log(f"dropout off in {dropout} places of the student: it is fitted to the original's exact outputs")
    if config.trainable == "lora":
        student = apply_lora(student, **dataclasses.asdict(config.lora))
        trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    else:
        trainable = set_trainable(student, config.trainable)
    if config.freeze_embeddings:
        trainable = freeze_embeddings(student)
    rows = f"sentences (at most {config.block_len} tokens)" if encoder else f"blocks of {config.block_len} tokens"
    log(f"training {trainable:,} parameters ({config.trainable}) on "
        + (f"{config.train_data} streamed in {rows}" if config.streaming else
           f"{len(train_set)} {rows}" + (f", a mix of {' + '.join(config.train_sources)}"
                                          if len(config.train_sources) > 1 else "")))

    precision = training_precision(config, student, original, train_set, tokenizer, state)
    config.training["bf16"] = precision.bf16
    log(precision.describe())
    args = TrainingArguments(output_dir=str(out), seed=config.seed, learning_rate=config.lr.base,
                             prediction_loss_only=True, eval_on_start=not encoder,
                             **{"include_num_input_tokens_seen": "non_padding" if encoder else "all",
                                **config.training})
    callbacks = [WallClockStop(config.max_minutes)] if config.max_minutes else []
    if swap is not None:
        callbacks.append(ProgressiveSwapCallback(swap))
    skeleton = skeleton_to_gather(student)  # after LoRA and the trainable choice: the model as it is sharded
    trainer = NormSwapTrainer(model=student, args=args, train_dataset=train_set, eval_dataset=eval_set,
                              processing_class=tokenizer, callbacks=callbacks,
                              teacher=original if distill.weight > 0 else None, distill_weight=distill.weight,
                              temperature=distill.temperature, logits=distill.logits,
                              hidden_weight=distill.hidden, sink_weight=distill.sink_weight,
                              embedding_weight=distill.embedding,
                              shape_lr=config.lr.shape, gamma_lr=config.lr.gamma,
                              head_chunk=config.head_chunk, shard_teacher=config.shard_teacher)
    last = last_checkpoint(out) if config.resume else None
    log(f"resuming from {last}" if last else "training from the calibrated model")
    resumed = read_json(last / "trainer_state.json") if last else {}
    last = str(last) if last else None
    start = time.time()
    result = trainer.train(resume_from_checkpoint=last)
    wall = time.time() - start

    # 4. evaluate (every process when sharded), then save, check, plot, push (main process)
    model = without_autocast_wrapper(trainer.accelerator.unwrap_model(trainer.model))
    sharded = skeleton is not None and is_sharded(model)
    if state.is_main_process or sharded:
        after = final_evaluation(model, original, tokenizer, eval_texts, config, "finetuned")
        original_block_ppl = None if encoder else block_perplexity(original, eval_set)
    model = whole_student(trainer, model, skeleton if sharded else None, original, state)
    if state.is_main_process:
        model = merge_lora(model).eval()
        log(f"after training:\n{after.table()}")
        history = trainer.state.log_history
        tokens = trainer.state.num_input_tokens_seen
        launches = summary.get("launches", []) + [{"resumed_from": last, "wall_seconds": round(wall, 1),
                                                   "start_step": resumed.get("global_step", 0),
                                                   "start_tokens": resumed.get("num_input_tokens_seen", 0),
                                                   "global_step": trainer.state.global_step, "tokens": tokens}]
        training = {"steps": trainer.state.global_step, "tokens_seen": tokens, "trainable": config.trainable,
                    "distill": dataclasses.asdict(distill), "lr": dataclasses.asdict(config.lr),
                    "progressive": dataclasses.asdict(progressive) if swap else None,
                    "train_data": config.train_data, "block_len": config.block_len,
                    "precision": vars(precision), "freeze_embeddings": config.freeze_embeddings,
                    "wall_seconds": round(sum(s["wall_seconds"] for s in launches), 1),
                    "world_size": state.num_processes, "train_loss": result.training_loss}
        model.config.normswap["training"] = training
        expected = probe_logits(model, tokenizer)
        hf_normswap.save_pretrained(model, save_dir, tokenizer=tokenizer, overwrite=True,
                                    evaluation=None if encoder else after.card("finetuned"))
        if sharded:
            del model, skeleton  # the gathered copy (the skeleton filled): the reloaded one takes its place
        identical = reloads_identically(expected, save_dir, tokenizer)
        curve = plot_history(history, out / "curve.png", original_block_ppl,
                             f"{config.model} -> {config.method.upper()}, {config.trainable}, "
                             f"{tokens:,} tokens")
        summary.update(finetuned=after.to_dict(), training=training, launches=launches, history=history,
                       reload_identical=identical, curve=str(curve), checkpoint=str(save_dir),
                       original_eval_block_perplexity=original_block_ppl)
        write_json(summary_path, summary)
        ratio = {k: summary[k]["results"]["converted"]["cosine"] if encoder else summary[k]["ratio"].get(k)
                 for k in ("calibrated", "finetuned")}
        log(f"{'embedding cosine to' if encoder else 'perplexity /'} original: {ratio['calibrated']:.4g} after "
            f"calibration -> {ratio['finetuned']:.4g} after "
            f"{trainer.state.global_step} steps ({tokens:,} tokens, {wall / 60:.1f} min); saved {save_dir} "
            f"(reloads identically: {identical}); curve {curve}")
        if config.push_to_hub:
            from hf_normswap.checkpoint.hub import push

            log(f"pushed to {push(save_dir, config.push_to_hub)}")
    state.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
