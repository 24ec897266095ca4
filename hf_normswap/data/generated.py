"""The original model's own samples as text: data for calibration, training and evaluation without a dataset.

A user who converts a model rarely has its pretraining data, but always has the model. Sequences sampled from it
(batched ``model.generate`` with the KV cache) are text in the model's own domain, in any amount, offline: data-free
distillation of this kind is how LLM-QAT recovered quantized LLaMA models. Three parts of generate's defaults cost
more than the model's own matmuls on a CPU and are replaced here, through generate's own arguments: the cache
(:class:`PreallocatedLayer`), the draw (:class:`InverseCdfSampler`) and the weights' precision
(:func:`sampling_precision`); and the linear layers run on weights packed once (:mod:`.packed_linear`).

The spec is ``generated`` or ``generated:key=value,...`` with the fields of :class:`SamplingSettings`, for example
``generated:temperature=0.8,top_p=0.95,length=512`` or ``generated:prompt=wikitext:wikitext-2-raw-v1:train``
(the first ``prompt_tokens`` tokens of that source's lines start the sequences instead of the BOS token).

Samples go to a cache on disk (:mod:`.sample_cache`), one file a batch, under a key made of the model's identity,
the settings and the prompt's content. Batch ``i`` is drawn with
its own seed, from ``seed`` and ``i``, so the text does not depend on how many processes drew it or in how many
launches: a resumed run, another method or another process reads the batches already there and draws only the rest,
and processes of one launch each draw the batches ``i`` with ``i % world_size == rank``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import CompileConfig, DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation import TemperatureLogitsWarper, TopPLogitsWarper

from ..model_inputs import check_context, model_device
from ..precision import matmul_speedup, weights_in
from .packed_linear import packed_linears
from .sample_cache import DamagedBatch, SampleCache, wait_for
PREFIX = "generated"
DEFAULT_TOKENS = 8192  # tokens sampled where the caller names no budget (an evaluation without --max-tokens)
COMPILE_TOKENS = 2**20  # a CUDA draw of at least this many tokens compiles its decode step (a compile: about a minute)
MAX_BATCH = 4096  # sequences a generate call: each step holds this many rows of vocabulary-wide fp32 scores
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_generated(spec: str | None) -> bool:
    return isinstance(spec, str) and (spec == PREFIX or spec.startswith(PREFIX + ":"))


@dataclass(frozen=True)
class SamplingSettings:
    """How the original's samples are drawn."""

    temperature: float = 1.0
    top_p: float = 1.0
    length: int = 512  # tokens a sequence, prompt included
    batch_size: int = 64  # sequences a generate call (and a cache file); more are faster a token (the configs: 128)
    prompt: str = "bos"  # bos, or a text spec whose lines' first prompt_tokens tokens start the sequences
    prompt_tokens: int = 8
    seed: int = 0
    precision: str = "auto"  # fp32, bf16 or fp16 weights while sampling; auto: see sampling_precision

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"generated: temperature must be above 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"generated: top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("length", "batch_size", "prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"generated: {name} must be a whole number of at least 1, got {value!r}")
        if self.precision not in ("auto", *WEIGHT_DTYPES):
            raise ValueError(f"generated: precision must be auto, {', '.join(WEIGHT_DTYPES)}, got {self.precision!r}")
        if self.prompt == "bos" and self.length < 2:
            raise ValueError("generated: length must be at least 2 (the start token and one sampled), got "
                             f"{self.length}")
        if self.batch_size > MAX_BATCH:
            raise ValueError(f"generated: batch_size must be at most {MAX_BATCH}, got {self.batch_size} (each step "
                             "of a batch holds batch_size x vocabulary scores)")
        if self.prompt != "bos" and self.prompt_tokens >= self.length:
            raise ValueError(f"generated: prompt_tokens ({self.prompt_tokens}) must be below length ({self.length})")

    @classmethod
    def from_spec(cls, spec: str) -> "SamplingSettings":
        """``generated`` or ``generated:key=value,...``; ValueError names a bad key or value, or a key given twice.
        A comma-separated item that is not ``key=value`` of a field continues ``prompt=`` (a text spec of several
        files holds commas), so the prompt may stand anywhere in the list."""
        options = spec[len(PREFIX) + 1:] if spec.startswith(PREFIX + ":") else ""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        items: list[list[str]] = []
        for item in filter(None, options.split(",")):
            key, sep, value = item.partition("=")
            if sep and key in fields:
                if any(known == key for known, _ in items):
                    raise ValueError(f"generated: {key} is given twice; give it once")
                items.append([key, value])
            elif items and items[-1][0] == "prompt":
                items[-1][1] += "," + item
            else:
                raise ValueError(f"generated: {item!r} is not one of {', '.join(f'{k}=...' for k in fields)}")
        values = {}
        for key, value in items:
            kind = {"float": float, "int": int}.get(fields[key], str)
            try:
                values[key] = kind(value)
            except ValueError:
                written = "an integer (digits, e.g. 64)" if kind is int else "a number"
                raise ValueError(f"generated: {key}={value!r} is not {written}") from None
        return cls(**values)

    def check_model(self, model: nn.Module) -> None:
        """The model can sample, within its context; ValueError naming the fix otherwise."""
        if model is None:
            raise ValueError("generated text is sampled from the original model: this command has none to sample "
                             "from (name the original, e.g. eval MODEL --against ORIGINAL)")
        if not (getattr(model, "can_generate", lambda: False)() and model.get_output_embeddings() is not None):
            raise ValueError(f"generated text needs a model with a language-model head; {type(model).__name__} "
                             "has none: name a text source instead")
        check_context({"generated: length": self.length}, model)


def sampling_precision(model: nn.Module, requested: str) -> str:
    """The weights' precision while sampling. ``auto``: a half-precision model as it is; an fp32 model cast to
    bf16 for the duration (:func:`precision.weights_in`) where a bf16 matmul runs faster than fp32 on its device
    (:func:`precision.matmul_speedup`, under a second), else fp32. Timed, so processes may differ: the cache key
    holds ``auto`` as requested (both are samples of the same model), and each batch records what it was drawn in."""
    if requested != "auto":
        return requested
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype in half:
        return half[dtype]
    return "bf16" if matmul_speedup(model_device(model)) > 1 else "fp32"


class InverseCdfSampler(LogitsProcessor):
    """Draws each row's token from ``softmax(scores)`` by the inverse of its cumulative distribution (one uniform
    variate a row) and returns a one-hot ``uint8`` row, so that generate's argmax returns the sample. generate's own
    sampling (``torch.multinomial``) draws an exponential variate for every vocabulary entry, which took longer on
    the CPU than the model's matmuls. The search runs in two levels, over sums of :attr:`BLOCK` entries and then
    within the chosen block, which replaces a cumulative sum over the whole vocabulary (sequential within a row)
    with a vectorised sum; and the argmax over a ``uint8`` row reads a quarter of the bytes of an fp32 one
    (BENCHMARKS.md, "Fresh text"). ``scores`` is generate's own fp32 copy of the logits and is overwritten."""

    BLOCK = 256

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, width = scores.shape
        weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # unnormalised probabilities; masked: 0
        whole = width // self.BLOCK * self.BLOCK
        sums = weights[:, :whole].view(rows, -1, self.BLOCK).sum(dim=-1)
        if whole < width:
            sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
        cumulative = sums.cumsum(dim=-1)
        # Below the total by at least one rounding step, so that the search never ends past the last entry of
        # weight above 0, in the blocks or within one.
        below_one = 1 - 2 ** -23
        targets = torch.rand(rows, 1, device=scores.device) * below_one * cumulative[:, -1:]
        block = torch.searchsorted(cumulative, targets, right=True)
        mass = sums.gather(1, block)
        within = ((targets - cumulative.gather(1, block) + mass) / mass).clamp_(0, below_one)
        columns = block * self.BLOCK + torch.arange(self.BLOCK, device=scores.device)
        inside = torch.where(columns < width, weights.gather(1, columns.clamp(max=width - 1)), 0.0).cumsum_(dim=-1)
        tokens = block * self.BLOCK + torch.searchsorted(inside, within * inside[:, -1:], right=True)
        return torch.zeros(rows, width, dtype=torch.uint8, device=scores.device).scatter_(1, tokens, 1)


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer that writes each step into a buffer of the sequence's final length and hands attention a
    view of the filled part. transformers' DynamicLayer concatenates the whole cache at every step, which grows
    with the square of the length."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.filled = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[-1])
        self.keys, self.values = self.key_buffer[..., :0, :], self.value_buffer[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        self.key_buffer[..., self.filled:end, :].copy_(key_states)
        self.value_buffer[..., self.filled:end, :].copy_(value_states)
        self.filled = end
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values


def preallocated_cache(model: nn.Module, length: int) -> DynamicCache | None:
    """The model's own cache with its full-attention layers preallocated to ``length`` tokens (sliding-window and
    other layer kinds stay as they are); None where generate would not make a DynamicCache (encoder-decoder and
    recurrent models): generate then picks its own."""
    supported = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    if getattr(model.config, "is_encoder_decoder", False) or not supported:
        return None
    try:
        cache = DynamicCache(config=model.config)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    cache.layers = [PreallocatedLayer(length) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_argument(model: nn.Module) -> str:
    """generate's keyword for a cache made beforehand, as the installed transformers names it: ``cache`` where the
    model's forward takes it (later 5.x releases), else ``past_key_values`` (earlier ones, e.g. 5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def batches_for(max_tokens: int, settings: SamplingSettings) -> int:
    return max(1, math.ceil(max_tokens / (settings.length * settings.batch_size)))


class Prompts:
    """The starts of the sequences, from a prompt source's text: the first ``prompt_tokens`` tokens of each of its
    lines in turn (a source read as one document, a large file or WikiText's rows joined, still gives many starts),
    tokenized once and only as far as the sequences drawn reach; the lines are read again from the first when the
    sequences outnumber them. A line longer than :attr:`PIECE_CHARS` is cut into pieces of that size."""

    PIECE_CHARS = 4096
    CHUNK = 256  # lines tokenized in one call

    def __init__(self, settings: SamplingSettings, tokenizer, texts: list[str]):
        self.settings, self.tokenizer, self.starts, self.done = settings, tokenizer, [], False
        self.pieces = (line[i:i + self.PIECE_CHARS] for text in texts for line in text.splitlines() if line.strip()
                       for i in range(0, len(line), self.PIECE_CHARS))

    def __call__(self, index: int) -> list[int]:
        while not self.done and len(self.starts) <= index:
            chunk = list(itertools.islice(self.pieces, self.CHUNK))
            self.done = not chunk
            for ids in self.tokenizer(chunk, add_special_tokens=False)["input_ids"] if chunk else ():
                if len(ids) >= self.settings.prompt_tokens:
                    self.starts.append(ids[: self.settings.prompt_tokens])
        if not self.starts:
            raise ValueError(f"generated: no line of {self.settings.prompt} has {self.settings.prompt_tokens} tokens "
                             "to start from")
        return self.starts[index % len(self.starts)] if self.done else self.starts[index]


def _prompts(settings: SamplingSettings, tokenizer, prompts: Prompts | None, count: int,
             start: int) -> torch.Tensor:
    """``(count, P)`` prompt ids of the sequences ``start .. start + count - 1``: the BOS token, or ``prompts``'
    starts."""
    if settings.prompt == "bos":
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ValueError("generated: the tokenizer has no BOS or EOS token to start the original's samples "
                             "from: calibrate on text instead (--calib FILE; in the recipe calibration.data=FILE), "
                             "or start the samples from text (generated:prompt=FILE)")
        return torch.full((count, 1), bos, dtype=torch.long)
    return torch.tensor([prompts(start + i) for i in range(count)], dtype=torch.long)


def sampling_config(settings: SamplingSettings, eos: int | None) -> tuple[GenerationConfig, LogitsProcessorList]:
    """generate's settings for a sample at ``settings.temperature`` and ``top_p`` of the model's distribution, and
    nothing of the model's own generation defaults (repetition penalties, top-k): the argmax of
    :class:`InverseCdfSampler`'s one-hot rows is the sample."""
    new_tokens = settings.length - (1 if settings.prompt == "bos" else settings.prompt_tokens)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens if eos is None
                              else 0, eos_token_id=eos, pad_token_id=eos if eos is not None else 0, use_cache=True)
    sampler = LogitsProcessorList([TemperatureLogitsWarper(settings.temperature)] if settings.temperature != 1 else [])
    if settings.top_p < 1:
        sampler.append(TopPLogitsWarper(settings.top_p))
    sampler.append(InverseCdfSampler())
    return config, sampler


@torch.no_grad()
def draw(model: nn.Module, tokenizer, cache: SampleCache, indices: list[int], *,
         prompts: Prompts | None = None, progress: bool = True, redraw: bool = False,
         compiled: CompileConfig | None = None) -> str | None:
    """Sample and cache the batches ``indices`` that are not cached yet (``redraw``: all of them, over what is
    there; the settings are the cache's); returns the precision they were drawn in, None when this call drew none
    (nothing was missing, or another run drew it while this one waited on :meth:`SampleCache.drawing`).

    A CUDA draw of :data:`COMPILE_TOKENS` or more (or ``compiled``, on any device) runs on transformers' static
    cache with the decode step compiled (``mode="reduce-overhead"``: CUDA graphs): the Python cost of eager steps
    bounds a GPU (BENCHMARKS.md, "On a GPU"). Elsewhere :class:`PreallocatedLayer` and eager steps: a CPU, or a
    short draw, would not earn the compile back. Both draw the same uniform variates: the same tokens up to
    rounding."""
    settings = cache.settings
    missing = [i for i in indices if redraw or not cache.has(i)]
    if not missing:
        return None
    cache.prepare()
    device = model_device(model)
    eos = tokenizer.eos_token_id
    precision = sampling_precision(model, settings.precision)
    generation_config, sampler = sampling_config(settings, eos)
    if compiled is None and device.type == "cuda" and len(missing) * settings.batch_size * settings.length >= \
            COMPILE_TOKENS:
        compiled = CompileConfig(mode="reduce-overhead")
    if compiled is not None:  # generate makes the static cache and compiles its decode step once per shape
        generation_config.cache_implementation, generation_config.compile_config = "static", compiled
    kept_config, was_training = model.generation_config, model.training
    model.generation_config = generation_config  # generate fills what a passed config leaves unset from this one
    model.eval()
    bar = tqdm(total=len(missing) * settings.batch_size * settings.length, unit="tok", unit_scale=True,
               desc="sampling the original", disable=not progress)
    drawn = 0
    try:
        # a compiled step runs the weights as they are (packing is a CPU eager path)
        packing = packed_linears(model, settings.batch_size) if compiled is None else contextlib.nullcontext(False)
        with weights_in(model, WEIGHT_DTYPES[precision]), packing as packed:
            bar.set_postfix_str(f"{precision} weights{', packed' if packed else ''}", refresh=False)
            for index in missing:
                with cache.drawing(index):
                    if not redraw and cache.has(index):  # another run drew it while this one waited
                        continue
                    starts = _prompts(settings, tokenizer, prompts, settings.batch_size, index * settings.batch_size)
                    starts = starts.to(device)
                    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                        torch.manual_seed(settings.seed * 1_000_003 + index)
                        own_cache = ({} if compiled else
                                     {cache_argument(model): preallocated_cache(model, settings.length)})
                        out = model.generate(input_ids=starts, attention_mask=torch.ones_like(starts),
                                             logits_processor=sampler, **own_cache)
                    cache.write(index, out.cpu(), _lengths(out, starts.shape[1], eos).cpu(), precision)
                drawn += 1
                bar.update(settings.batch_size * settings.length)
    finally:
        bar.close()
        model.generation_config = kept_config
        model.train(was_training)
    return precision if drawn else None


def _lengths(out: torch.Tensor, prompt_len: int, eos: int | None) -> torch.Tensor:
    """Tokens of each row up to and including its first sampled EOS (generate pads after it)."""
    lengths = torch.full((out.shape[0],), out.shape[1], dtype=torch.long)
    if eos is not None:
        for row, ids in enumerate(out[:, prompt_len:]):
            hits = (ids == eos).nonzero()
            if len(hits):
                lengths[row] = prompt_len + int(hits[0]) + 1
    return lengths


@dataclass(frozen=True)
class DrawShare:
    """This process's part of a draw that the processes of one launch share: it draws the batches ``i`` with
    ``i % world_size == rank`` and waits for the others' up to ``wait_seconds`` (default: 0 alone, 6 hours with
    other processes)."""

    rank: int = 0
    world_size: int = 1
    wait_seconds: float | None = None

    def wait(self) -> float:
        if self.wait_seconds is not None:
            return self.wait_seconds
        return 0.0 if self.world_size == 1 else 6 * 3600.0


def sample_texts(model: nn.Module, tokenizer, settings: SamplingSettings, max_tokens: int, *,
                 prompt_texts: list[str] | None = None, share: DrawShare = DrawShare(), progress: bool = True,
                 cache_dir: Path | None = None) -> list[str]:
    """Texts of at least ``max_tokens`` sampled tokens, one a sequence (``prompt_texts``: the text of
    ``settings.prompt``). Sequences that end early (EOS) are made up for by further batches. This process draws its
    ``share`` of the missing batches and waits for the others'."""
    settings.check_model(model)
    cache = SampleCache(model, settings, cache_dir, prompt_texts)
    prompts = None if settings.prompt == "bos" else Prompts(settings, tokenizer, prompt_texts or [])
    rows, have, read, count = [], 0, 0, batches_for(max_tokens, settings)
    start, missing = time.time(), set()
    while have < max_tokens:
        needed = range(read, count)
        mine = [i for i in needed if i % share.world_size == share.rank and not cache.has(i)]
        missing.update(mine)
        draw(model, tokenizer, cache, mine, prompts=prompts, progress=progress)
        wait_for(cache, needed, share.wait())
        for index in needed:
            batch = read_or_redraw(model, tokenizer, cache, index, prompts)
            rows.extend(batch)
            have += sum(map(len, batch))
        read, count = count, count + batches_for(max_tokens - have, settings)
    if progress:
        _say_drawn(settings, cache, len(cache.written & missing), len(missing - cache.written), time.time() - start)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]


def _say_drawn(settings: SamplingSettings, cache: SampleCache, drawn: int, reused: int, seconds: float) -> None:
    """What this call sampled, and what another run sampling the same batches at once drew for it (two runs
    sharing a draw would each claim the whole of it)."""
    tokens = settings.batch_size * settings.length
    others = f"{reused * tokens:,} tokens another run drew at the same time reused from {cache.directory}"
    if drawn:
        print(f"[generated] {drawn * tokens:,} tokens sampled in {seconds:.0f} s into {cache.directory}"
              + (f"; {others}" if reused else ""), file=sys.stderr, flush=True)
    elif reused:
        print(f"[generated] {others}", file=sys.stderr, flush=True)


def read_or_redraw(model, tokenizer, cache: SampleCache, index: int, prompts) -> list[list[int]]:
    """Batch ``index``; a damaged one is named and drawn again in its place (its seed gives the same rows)."""
    try:
        return cache.read(index)
    except DamagedBatch as damaged:
        print(f"[generated] {damaged}: drawing it again", file=sys.stderr, flush=True)
    draw(model, tokenizer, cache, [index], prompts=prompts, progress=False, redraw=True)
    try:
        return cache.read(index)
    except DamagedBatch as damaged:
        raise ValueError(f"generated: {damaged}, and again after drawing it anew") from None
