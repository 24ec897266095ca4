"""The original's samples as a training stream: each batch drawn just before the step that reads it.

Drawing a run's whole share of samples before its first step made the first step wait for half a long run's tokens
(decoded one step at a time); read as a stream, the first step waits for one batch whatever the run's length. The
stream is the blocks :func:`.texts.token_blocks` cuts from :func:`.generated.sample_texts`' texts, in the same
order: batch ``i`` of the sample cache (drawn with its own seed, ``seed`` and ``i``), decoded and packed with its
remainder carried on. So a resumed run reads the batches it trained on from the cache and continues with the same
rows, and a run of any length starts from the same blocks.

Every process reads the whole stream (the Trainer gives each its slice of every global batch) and draws the batches
``i`` with ``i % world_size == rank``, reading the others' from the cache, so the processes draw in parallel.
"""

from __future__ import annotations

import itertools
import sys
import time

from .generated import Prompts, SamplingSettings, draw, read_or_redraw, wait_for
from .sample_cache import SampleCache
from .streaming import block_features, packed

OTHERS_WAIT = 6 * 3600.0  # seconds a process waits for a batch another process draws


def sampled_documents(model, tokenizer, settings: SamplingSettings, prompt_texts=None, rank: int = 0,
                      world_size: int = 1, progress: bool = True):
    """The decoded sequences of the cache's batches 0, 1, 2, ... (without end), each one document; this process
    draws its own batches as the stream reaches them and waits for the others'."""
    settings.check_model(model)
    cache = SampleCache(model, settings, None, prompt_texts)
    prompts = None if settings.prompt == "bos" else Prompts(settings, tokenizer, prompt_texts or [])
    for index in itertools.count():
        mine = [i for i in range(index, index + world_size) if i % world_size == rank]
        start = time.time()
        if draw(model, tokenizer, cache, mine, prompts=prompts, progress=False) and progress:
            print(f"[generated] {settings.batch_size * settings.length:,} tokens sampled in {time.time() - start:.0f} "
                  f"s into {cache.directory} (batch {mine[0]})", file=sys.stderr, flush=True)
        wait_for(cache, [index], 0.0 if world_size == 1 else OTHERS_WAIT)
        for ids in read_or_redraw(model, tokenizer, cache, index, prompts):
            yield tokenizer.decode(ids, skip_special_tokens=True), True


def _sample_blocks(model, tokenizer, settings, prompt_texts, block_len, rank, world_size, progress):
    documents = sampled_documents(model, tokenizer, settings, prompt_texts, rank, world_size, progress)
    yield from packed(documents, tokenizer, block_len)


def sample_stream(model, tokenizer, settings: SamplingSettings, block_len: int, *, prompt_texts=None, rank: int = 0,
                  world_size: int = 1, progress: bool = True):
    """The packed blocks of the original's samples as a ``datasets`` stream without end (``input_ids`` =
    ``labels``); the Trainer stops it at its ``max_steps``."""
    import datasets  # lazy: slow to import (~0.7 s), and `import hf_normswap` must not load it

    return datasets.IterableDataset.from_generator(_sample_blocks, features=block_features(), gen_kwargs={
        "model": model, "tokenizer": tokenizer, "settings": settings, "block_len": block_len,
        "prompt_texts": None if prompt_texts is None else tuple(prompt_texts), "rank": rank,
        "world_size": world_size, "progress": progress})
