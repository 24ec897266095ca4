"""The recipe's text: every source read once before any model loads, then the training rows (packed causal-LM
blocks, a sentence encoder's sentences, or a Hub stream), a mix of sources in equal shares, and the eval blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import datasets
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from torch import nn

from ..checkpoint.loading import resolve
from ..data import DataError, hub_stream, load_texts, token_blocks
from ..data.sources import NoWholeBlock, source
from ..data.streaming import block_features
from ..evaluation.embeddings import sentences
from ..evaluation.perplexity import EvaluationError
from ..evaluation.tasks import check_tasks
from .recovery_run import TrainingText
from ..planning.sizes import PlanError, read_config
from .recipe_settings import fail, stopped


def packs_blocks(original: str) -> bool:
    """Whether the recipe reads its text as packed blocks for ``original`` (a model with an output head), from its
    config alone: a sentence encoder (a bare ``...Model``, as MiniLM's ``BertModel``) reads sentences of any length
    instead. A config that does not read counts as a model with a head (its load names the problem)."""
    try:
        names = getattr(read_config(original), "architectures", None) or []
    except (PlanError, OSError, ValueError):
        return True
    return not names or not all(n.endswith("Model") and not n.endswith("LMHeadModel") for n in names)


def check_data(config, calibrates: bool, packs: bool = True) -> None:
    """Read every text source before any model loads, so a missing file, an unreachable Hub dataset, a byte that
    is not UTF-8 or a source without one whole block stops the run at once with one line naming the key that
    overrides it (``Source.preflight``); a whole block is asked of each only where the run ``packs`` its text into
    blocks (:func:`packs_blocks`)."""
    training = [("train_data", spec, "calibration", "block_len") for spec in config.train_sources]
    sources = [*training, ("eval_data", config.eval_data, "evaluation", "block_len")]
    if calibrates:  # a converted checkpoint is calibrated already
        sources.insert(0, ("calibration.data", config.calibration.data, "calibration", "calibration.block_len"))
    if config.streaming:  # one row read: the stream is opened, not downloaded
        sources = [s for s in sources if s[0] != "train_data"]
        try:
            hub_stream(config.train_data, None, config.block_len)
        except DataError as error:
            fail(f"train_data: {error}")
    lengths = {"block_len": config.block_len, "calibration.block_len": config.calibration.block_len} if packs \
        else {"block_len": None, "calibration.block_len": None}
    for key, spec, split, block_key in sources:
        try:
            source(spec).preflight(split, lengths[block_key])
        except NoWholeBlock as error:
            fail(f"{key}: {error} (give more text: {key}=PATH, or a smaller {block_key})")
        except DataError as error:
            fail(f"{key}: {error} ({key}=PATH)")
    same = lambda a, b: source(a).same_sample(source(b))  # noqa: E731
    if any(same(spec, config.eval_data) for spec in (*config.train_sources, config.calibration.data or "builtin")):
        fail(f"eval_data {config.eval_data} samples the same text as the training or calibration data: give it "
             "another seed, e.g. eval_data=generated:seed=1")
    check_final_tasks(config.final_eval.task_names, config.model)
    mixed = config.train_sources
    if any(a == b or same(a, b) for i, a in enumerate(mixed) for b in mixed[i + 1:]):
        fail(f"train_data {mixed} names the same text twice: mix different sources (generated samples with another "
             "seed, e.g. generated:seed=1)")


@dataclass(frozen=True)
class SampleDraw:
    """Who draws the original's samples (a ``generated`` source): ``original``, each process of ``state`` its share,
    or the main process all of them when the others hold the original on the meta device (``from_main``,
    ``RecoveryRun.original_read_once``), which then receive its texts."""

    original: nn.Module | None = None
    state: PartialState | None = None
    from_main: bool = False


def block_dataset(tokenizer, spec: str, split: str, block_len: int, max_tokens: int | None = None,
                  max_blocks: int | None = None, *, draw: SampleDraw = SampleDraw()):
    """Packed causal-LM blocks (``input_ids`` = ``labels``) of a text spec, as a ``datasets.Dataset``; the original's
    samples (``generated``) are drawn up to the budget as ``draw`` says."""
    limits = [n for n in (max_blocks, None if max_tokens is None else max_tokens // block_len) if n is not None]
    original, state = draw.original, draw.state
    share = {"rank": state.process_index, "world_size": state.num_processes} if state is not None else {}
    from_main = draw.from_main and source(spec).samples_original
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
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks}, features=block_features())


def mixed(parts: list):
    """The training rows of a mix: each source's rows in turn, a shorter source read again until the longest ends
    (``interleave_datasets``, all exhausted), so every source is an equal share of what the run trains on."""
    return parts[0] if len(parts) == 1 else datasets.interleave_datasets(parts, stopping_strategy="all_exhausted")


def training_blocks(text: TrainingText, tokenizer, original, state):
    """The training sources (``text``: ``RecoveryRun.text``) packed into blocks, a mix in equal shares. The
    original's samples and local text files are streams read as the run trains (:func:`training_stream`); where the
    original is sharded as the teacher under FSDP2 it cannot sample between steps, and its samples are drawn before
    training, each source up to its share."""
    if text.drawn_first and any(source(s).samples_original for s in text.sources):
        draw = SampleDraw(original, state, text.from_main)
        return mixed([block_dataset(tokenizer, spec, "calibration", text.block_len, share, draw=draw)
                      for spec, share in zip(text.sources, text.shares)])
    parts = [training_stream(spec, share if text.capped else None, text.block_len, text.seed, tokenizer, original,
                             state) for spec, share in zip(text.sources, text.shares)]
    if any(isinstance(part, datasets.IterableDataset) for part in parts):  # a mix is of one kind; the Trainer
        # shuffles a Dataset it is given, not a stream, so a source read whole is shuffled here, with the run's seed
        parts = [part if isinstance(part, datasets.IterableDataset) else
                 part.shuffle(seed=text.seed).to_iterable_dataset() for part in parts]
    return mixed(parts)


def training_stream(spec: str, cap: int | None, block_len: int, seed: int, tokenizer, original, state):
    """One training source as the run reads it: its stream (``Source.stream``: the original's samples drawn as the
    run reads them, this process drawing its own batches; a local text file read lazily), or, for a source read
    whole, a ``datasets.Dataset``; at most ``cap`` tokens of it (None: all)."""
    try:
        stream = source(spec).stream(tokenizer, block_len, original=original, rank=state.process_index,
                                     world_size=state.num_processes, seed=seed)
    except DataError as error:
        raise stopped(f"{spec}: {error}") from None
    if stream is None:
        return block_dataset(tokenizer, spec, "calibration", block_len, cap, draw=SampleDraw(state=state))
    return stream if cap is None else stream.take(max(1, cap // block_len))


def sentence_dataset(tokenizer, spec: str, max_len: int, max_tokens: int | None = None):
    """A sentence encoder's training rows: prose sentences with the tokenizer's special tokens, as the encoder is
    used and evaluated (``hf_normswap.evaluation.embeddings``), padded per batch by the Trainer's collator. Packed blocks would
    train it on inputs it never sees: no [CLS] / [SEP], no padding."""
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


def recipe_datasets(text: TrainingText, tokenizer, original, state, encoder: bool):
    """(training rows, eval blocks) of ``text`` (``RecoveryRun.text``): a sentence encoder's sentences and no eval
    blocks (it is evaluated by embedding cosine after training), else packed blocks of the training sources (or
    the Hub stream, packed on the fly: ``hf_normswap.data.streaming``) and the eval blocks of ``eval_data``."""
    if encoder:
        return mixed([sentence_dataset(tokenizer, spec, text.block_len, share)
                      for spec, share in zip(text.sources, text.shares)]), None
    if text.hub_stream:
        try:
            train_set = hub_stream(text.sources[0], tokenizer, text.block_len)
        except DataError as error:
            raise stopped(f"{text.sources[0]}: {error}") from None
    else:
        train_set = training_blocks(text, tokenizer, original, state)
    return train_set, block_dataset(tokenizer, text.eval_data, "evaluation", text.block_len,
                                    max_blocks=text.eval_blocks, draw=SampleDraw(original, state, text.from_main))


def sentence_steps(train_tokens: int, rows_per_step: int, train_set) -> int:
    """The ``max_steps`` that trains a sentence encoder on ``train_tokens`` in all: a global batch's rows counted at
    the mean sentence's tokens (packed blocks are of ``block_len`` tokens: ``RecoveryRun.steps``)."""
    return max(1, math.ceil(int(train_tokens) / (rows_per_step * tokens_per_row(train_set))))


def check_final_tasks(task_names: str | None, model: str) -> None:
    """``final_eval.tasks`` checked before any model loads (lm-eval installed, every name known, every task file
    readable), as ``normswap eval --tasks`` checks them; a task file inside the model's folder is refused (its
    Python would run)."""
    if task_names is None:
        return
    folder = Path(resolve(model)[0])
    try:
        check_tasks(task_names, [folder] if folder.is_dir() else [])
    except EvaluationError as error:
        fail(f"final_eval.tasks: {str(error).removeprefix('--tasks ')}")
