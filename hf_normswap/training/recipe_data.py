"""The recipe's text: every source read once before any model loads, then the training rows (packed causal-LM
blocks, a sentence encoder's sentences, or a Hub stream), a mix of sources in equal shares, and the eval blocks."""

from __future__ import annotations

import math

from .recipe_settings import converted_checkpoint, fail, stopped


def check_data(config) -> None:
    """Read every text source before any model loads, so a missing file or an unreachable Hub dataset stops the
    run at once with one line naming the key that overrides it."""
    from ..data import DataError, check_spec, is_generated, load_texts, packed_stream, same_sample

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
                check_spec(spec)  # sampled once the original is loaded; its prompt file must exist
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
                  max_blocks: int | None = None, *, original=None, state=None, from_main: bool = False):
    """Packed causal-LM blocks (``input_ids`` = ``labels``) of a text spec, as a ``datasets.Dataset``. The original's
    samples (``generated``) are drawn up to the budget, each process its share (``state``), or the main process all
    of them when the others hold the original on the meta device (``from_main``, ``recipe_models.original_read_once``),
    which then receive its texts."""
    import datasets
    from accelerate.utils import broadcast_object_list

    from ..data import DataError, is_generated, load_texts, token_blocks

    limits = [n for n in (max_blocks, None if max_tokens is None else max_tokens // block_len) if n is not None]
    share = {"rank": state.process_index, "world_size": state.num_processes} if state is not None else {}
    from_main = from_main and is_generated(spec)
    try:
        texts = None
        if not from_main or state.is_main_process:
            texts = load_texts(spec, split, model=original, tokenizer=tokenizer,
                               max_tokens=min(limits) * block_len if limits else None, **({} if from_main else share))
        if from_main:
            texts = broadcast_object_list([texts])[0]
        blocks = token_blocks(tokenizer, texts, min(limits) if limits else None, block_len).tolist()
    except DataError as error:
        raise stopped(f"{spec}: {error}") from None
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def mixed(parts: list):
    """The training rows of a mix: each source's rows in turn, a shorter source read again until the longest ends
    (``interleave_datasets``, all exhausted), so every source is an equal share of what the run trains on."""
    import datasets

    return parts[0] if len(parts) == 1 else datasets.interleave_datasets(parts, stopping_strategy="all_exhausted")


def training_blocks(config, tokenizer, original, state):
    """``train_data`` packed into blocks, each source of a mix up to its share (``training_budget``)."""
    from .recipe_models import original_read_once

    return mixed([block_dataset(tokenizer, spec, "calibration", config.block_len,
                                training_budget(config, spec, state.num_processes), original=original, state=state,
                                from_main=original_read_once(config, state))
                  for spec in config.train_sources])


def streamed_dataset(config, tokenizer):
    """``train_data`` streamed from the Hub, packed into blocks on the fly (``hf_normswap.data.streaming``)."""
    from ..data import DataError, packed_stream

    try:
        return packed_stream(config.train_data, tokenizer, config.block_len)
    except DataError as error:
        raise stopped(f"{config.train_data}: {error}") from None


def training_budget(config, spec: str, world_size: int) -> int | None:
    """Tokens to read of one training source: its share of ``max_train_tokens`` (None: all of it); for the
    original's samples, which have no end, its share of what the run trains on over every launch (``train_tokens``,
    else ``training.max_steps`` global batches) within that cap. A share is at least a block."""
    from ..data import is_generated

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

    from ..data import DataError, load_texts
    from ..evaluation.embeddings import sentences

    try:
        found = sentences(load_texts(spec, "calibration"), tokenizer, max_tokens, max_sentences=None)
    except DataError as error:
        raise stopped(f"{spec}: {error}") from None
    if not found:
        within = f" within {max_tokens} tokens (max_train_tokens)" if max_tokens else ""
        raise stopped(f"{spec}: no prose sentences to train a sentence encoder on{within}")
    return datasets.Dataset.from_dict(dict(tokenizer(found, truncation=True, max_length=max_len)))


def tokens_per_row(dataset) -> float:
    """Mean tokens of a training row (``block_len`` for packed blocks): what ``train_tokens`` steps are counted in."""
    rows = dataset["input_ids"]
    return sum(map(len, rows)) / len(rows)


def recipe_datasets(config, tokenizer, original, state, encoder: bool):
    """(training rows, eval blocks): a sentence encoder's sentences and no eval blocks (it is evaluated by embedding
    cosine after training), else packed or streamed blocks of ``train_data`` and the eval blocks of ``eval_data``."""
    if encoder:
        return mixed([sentence_dataset(tokenizer, spec, config.block_len,
                                       training_budget(config, spec, state.num_processes))
                      for spec in config.train_sources]), None
    from .recipe_models import original_read_once

    train_set = (streamed_dataset(config, tokenizer) if config.streaming
                 else training_blocks(config, tokenizer, original, state))
    return train_set, block_dataset(tokenizer, config.eval_data, "evaluation", config.block_len,
                                    max_blocks=config.eval_blocks, original=original, state=state,
                                    from_main=original_read_once(config, state))


def steps_for(config, train_set, world_size: int) -> int:
    """The ``max_steps`` that trains on ``train_tokens`` in all: tokens of a global batch counted in training rows
    (``block_len`` each when streamed, the mean row otherwise)."""
    training = config.training
    per_step = ((config.block_len if config.streaming else tokens_per_row(train_set))
                * training["per_device_train_batch_size"]
                * training.get("gradient_accumulation_steps", 1) * world_size)
    return max(1, math.ceil(int(config.train_tokens) / per_step))
