"""The sequential block pass: convert norm by norm in forward order, block by block, GPTQ-style.

The inputs of the first repeated block are cached once; then, for each block, each target norm's input is captured
(``capture.py``) on the model whose earlier norms are already converted, ``fit(info, source, sample)`` builds and
fits its replacement, which is swapped in, and the block is re-run to give the next block its input. Norms outside
the blocks (an embedding LayerNorm before, the final norm after) are handled before / after them. With
``block_steps`` each block's new modules are then tuned so that the block reproduces the original block's output
(:func:`tune_block`; with ``block_weights_lr`` the block's own weights too, ``reconstruct.py``), and a final norm
fed straight by the last block is tuned the same way toward the original final norm's output on the original
trajectory.

Each block is on the compute device (``CalibrationConfig.device``, by default where the model is) only for its own
stage, then goes back; the hidden states passed from stage to stage live in an :class:`ActivationCache` (CPU memory,
files past ``cache_memory_mb``). A model in CPU memory is so calibrated on a GPU that holds one block, as
llm-compressor's sequential pipeline does; ``reconstruct.py`` gives the memory formula. The forward passes of the
whole model (the first block's inputs, norms outside the blocks) run where the model is.

Models whose norms do not sit in one stack of blocks (encoder-decoder: two stacks) fall back to :func:`one_shot`:
every norm fitted on activations of the original model, captured in one pass.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from accelerate.utils import send_to_device
from torch import nn
from tqdm.auto import tqdm

from .. import offload
from ..discovery.norms import NormInfo
from ..discovery.roles import block_of
from ..model_inputs import StopForward, first_tensor, forward_without_cache
from ..modules import adam_groups
from .activation_cache import ActivationCache, CachedTensors
from .capture import capturing, first_call_inputs
from .end_to_end import training_only
from .reconstruct import block_weights, per_token_relative_error


@dataclass
class BlockPlan:
    stack_name: str
    stack: nn.ModuleList
    pre: list[NormInfo]
    blocks: list[list[NormInfo]]  # per block, in forward order
    post: list[NormInfo]


def _capture_kwargs(config) -> dict:
    return dict(max_tokens=config.max_tokens_per_norm, max_first=config.max_first_per_norm, seed=config.seed)


def one_shot(model, selected, batches, fit, replace, config) -> None:
    """All norms fitted on activations of the original model, captured in one pass over the data."""
    modules = {info.name: model.get_submodule(info.name) for info in selected}
    with capturing(modules, **_capture_kwargs(config)) as capture:
        for batch in tqdm(batches, desc="calibration: capture", disable=not config.progress, leave=False):
            capture.mask = batch["attention_mask"]
            forward_without_cache(model, batch)
    for info in tqdm(selected, desc="calibration: fit", disable=not config.progress, leave=False):
        replace(model, info.name, fit(info, modules[info.name], capture.samples[info.name]))


def block_plan(model: nn.Module, selected: list[NormInfo], batch: dict) -> BlockPlan | None:
    """Group norms by repeated block, in forward order, or None when they do not sit in one stack of blocks."""
    by_stack: dict[str, list[NormInfo]] = {}
    outside = []
    for info in selected:
        block = block_of(info.name)
        if block is None:
            outside.append(info)
        else:
            by_stack.setdefault(block.rpartition(".")[0], []).append(info)
    if len(by_stack) != 1:
        return None
    (stack_name, inside), = by_stack.items()
    stack = model.get_submodule(stack_name)
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        return None
    order: list[str] = []
    handles = []

    def mark(name):
        def hook(*_):
            order.append(name)
        return hook

    for info in selected:
        handles.append(model.get_submodule(info.name).register_forward_pre_hook(mark(info.name)))
    handles.append(stack[0].register_forward_pre_hook(mark("<stack start>")))
    handles.append(stack[-1].register_forward_hook(mark("<stack end>")))
    small = {k: v[:1, :16] if v.dim() == 2 else v for k, v in batch.items()}
    try:
        with torch.no_grad():
            forward_without_cache(model, small)
    finally:
        for h in handles:
            h.remove()
    if "<stack start>" not in order or "<stack end>" not in order:
        return None
    first_seen = {}
    for i, name in enumerate(order):
        first_seen.setdefault(name, i)
    begin, end = first_seen["<stack start>"], first_seen["<stack end>"]
    pre = [i for i in outside if first_seen.get(i.name, -1) < begin]
    post = [i for i in outside if first_seen.get(i.name, -1) > end]
    if len(pre) + len(post) != len(outside) or any(i.name not in first_seen for i in selected):
        return None
    index_of = {id(block): k for k, block in enumerate(stack)}
    blocks: list[list[NormInfo]] = [[] for _ in stack]
    for info in sorted(inside, key=lambda i: first_seen[i.name]):
        block = model.get_submodule(block_of(info.name))
        if id(block) not in index_of:
            return None
        blocks[index_of[id(block)]].append(info)
    key = lambda i: first_seen[i.name]  # noqa: E731
    return BlockPlan(stack_name=stack_name, stack=stack, pre=sorted(pre, key=key), blocks=blocks,
                     post=sorted(post, key=key))


def _block_inputs(model, stack, batches, cache: ActivationCache) -> tuple[CachedTensors, list[tuple]]:
    """The first block's hidden states for each batch, held by ``cache``, and its other inputs (mask, position
    embeddings: ``(args, kwargs)``) on the compute device; each forward stops at that block."""
    hidden, others = cache.store(()), []
    for batch in batches:
        args, kwargs = first_call_inputs(stack[0], lambda: forward_without_cache(model, batch))
        first, args, kwargs = (args[0], args[1:], kwargs) if args else (kwargs.pop("hidden_states"), (), kwargs)
        hidden.append(first)
        others.append(send_to_device((args, kwargs), cache.device))
    return hidden, others


@contextmanager
def _on_device(model: nn.Module, name: str, device: torch.device):
    """The submodule ``name`` on ``device`` for the duration, then back where it was (weights on disk: back to
    disk, ``offload.in_memory``). Looked up again at the end: a converted final norm is a new module at the same
    name."""
    module = model.get_submodule(name)
    if offload.is_offloaded(module):
        with offload.in_memory(model, name, device):
            yield
        return
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    home = device if first is None else first.device
    module.to(device)
    try:
        yield
    finally:
        model.get_submodule(name).to(home)


def _call_block(block, hidden, args, kwargs):
    if args or not _takes_hidden_states_keyword(type(block)):
        return first_tensor(block(hidden, *args, **kwargs))
    return first_tensor(block(hidden_states=hidden, **kwargs))


@functools.cache
def _takes_hidden_states_keyword(block_class: type) -> bool:
    """Whether the block's forward names ``hidden_states`` (looked up once per class: block tuning calls blocks
    thousands of times)."""
    return "hidden_states" in inspect.signature(block_class.forward).parameters


def _capture_pass(modules, stop_after, batches, run, config):
    """Capture inputs of ``modules`` while ``run(batch_index)`` executes for every batch; returns the samples."""
    with capturing(modules, stop_after=stop_after, **_capture_kwargs(config)) as capture:
        for k, batch in enumerate(batches):
            capture.mask = batch["attention_mask"]
            try:
                run(k)
            except StopForward:
                pass
        return capture.samples


def sequential(model, plan: BlockPlan, batches, fit, replace, config) -> tuple[list[dict], dict]:
    """Convert in forward order; returns the block-tuning record (empty without ``block_steps``) and what the
    activation cache held at its peak. Each block is on the compute device (``config.device``) only for its own
    stage; the hidden states between stages are held by an :class:`ActivationCache`."""
    home = offload.first_weight_device(plan.stack)
    device = torch.device(config.device) if config.device else home
    limit = None if config.cache_memory_mb is None else int(config.cache_memory_mb * 2**20)
    total = len(plan.pre) + sum(len(b) for b in plan.blocks) + len(plan.post)
    tuning = []
    masks = [batch["attention_mask"].to(device) for batch in batches]

    def convert_one(info, run):
        source = model.get_submodule(info.name)
        samples = _capture_pass({info.name: source}, info.name, batches, run, config)
        replace(model, info.name, fit(info, source, samples[info.name]))
        bar.update()

    def through(block, inputs, others):  # the block's outputs on every batch, into the cache as they come
        return cache.store(_call_block(block, inputs[k], *others[k]) for k in range(len(inputs)))

    with ActivationCache(limit, device) as cache, \
            tqdm(total=total, desc="calibration: norms", disable=not config.progress, leave=False) as bar:
        hidden, others = _block_inputs(model, plan.stack, batches, cache)
        # the original model's trajectory, which block tuning steers each converted block back onto, on the
        # sequences tuning reads
        reference = None
        if config.block_steps:
            reference = cache.store(hidden[k] for k in range(_leading_batches(batches, tuned_rows(config))))
        for info in plan.pre:  # e.g. BERT's embedding LayerNorm: runs before the first block
            convert_one(info, lambda k: forward_without_cache(model, batches[k]))
        if plan.pre:  # the blocks' inputs changed with the converted norms before them
            hidden.release()
            hidden, others = _block_inputs(model, plan.stack, batches, cache)
        for index, (block, infos) in enumerate(zip(plan.stack, plan.blocks)):
            with _on_device(model, f"{plan.stack_name}.{index}", device):
                if reference is not None:  # the original block, before its norms are replaced
                    reference = _replaced(reference, through(block, reference, others))
                for info in infos:
                    convert_one(info, lambda k: _call_block(block, hidden[k], *others[k]))
                if reference is not None and infos:
                    modules = [model.get_submodule(info.name) for info in infos]
                    # the block's outputs come from its last error pass
                    runner = _block_runner(block, others, [len(mask) for mask in masks])
                    record, outputs = tune_block(block, modules, runner, hidden, reference, masks, config, cache)
                    tuning.append(dict(block=index, **record))
                    bar.set_postfix(block_error=f"{tuning[-1]['error_after']:.3g}")
                else:
                    outputs = through(block, hidden, others)
                hidden = _replaced(hidden, outputs)
        for info in plan.post:  # final norm: its input is the last block's output when nothing sits in between
            if _post_input_is_stack_output(model, model.get_submodule(info.name), batches[0], hidden[0]):
                with _on_device(model, info.name, device):
                    record = _convert_post_norm(model, info, hidden, reference, masks, convert_one, config, cache)
                if record is not None:
                    tuning.append(record)
            else:
                convert_one(info, lambda k: forward_without_cache(model, batches[k]))
        return tuning, cache.summary()


def _convert_post_norm(model, info, hidden, reference, masks, convert_one, config, cache) -> dict | None:
    """A final norm fed straight by the last block, converted on that block's outputs and, with block tuning, tuned
    like one more block: it too inherits the error of everything before it. Returns its tuning record (``None``
    without block tuning)."""
    source = model.get_submodule(info.name)
    # what the original norm makes of the original trajectory
    target = None if reference is None else cache.store(source(r) for r in reference)
    convert_one(info, lambda k: source(hidden[k]))
    if target is None:
        return None
    module = model.get_submodule(info.name)
    record, outputs = tune_block(module, [module], lambda x, k, rows: module(x), hidden, target, masks, config, cache)
    outputs.release()
    target.release()
    return dict(block=info.name, **record)


def _replaced(old: CachedTensors, new: CachedTensors) -> CachedTensors:
    """``new``, once ``old``'s memory and files are freed."""
    old.release()
    return new


def _rows(value, rows: slice, batch_size: int):
    """``value`` (a tensor, or tuples / dicts of them) cut to ``rows`` along every leading batch dimension."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() and value.shape[0] == batch_size and batch_size > 1 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, rows, batch_size) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, batch_size) for k, v in value.items()}
    return value


def _relative_error(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over tokens of ||out - target||^2 / ||target||^2: every token counts alike, sinks at RMS 1000 too."""
    per_token = per_token_relative_error(out, target)
    if mask is not None and mask.shape == per_token.shape:
        return per_token[mask.bool()].mean()
    return per_token.mean()


def _block_runner(block, others, sizes: list[int]):
    """``run(x, k, rows)``: the block on hidden states ``x`` of those rows of batch ``k`` (``sizes[k]`` sequences),
    its other inputs (``others[k]``, see :func:`_block_inputs`) cut to the same rows."""
    def run(x, k, rows):
        args, kwargs = others[k]
        return _call_block(block, x, _rows(args, rows, sizes[k]), _rows(kwargs, rows, sizes[k]))

    return run


GUARD_ROWS = 16  # sequences on which tuning's "never worse" check compares the block before and after


def tuned_rows(config) -> int:
    """Sequences that block tuning reads: its steps' (``block_steps`` x ``block_rows``, the first ones in order)
    and the guard's. Only these need the original block's output: of 256 calibration sequences, the default 60 steps
    of one sequence read 60."""
    return max(config.block_steps * config.block_rows, GUARD_ROWS)


def tune_block(block, modules, run, hidden, reference, masks, config,
               cache: ActivationCache) -> tuple[dict, CachedTensors]:
    """Adam on one block's new modules: fed the converted model's hidden states, the block (``run``, see
    :func:`_block_runner`) should reproduce the original block's output on the original's hidden states. Fitting
    each norm's own output leaves the error a block inherits to grow over 30 blocks; matching the block output
    makes each block compensate for it. ``hidden``, ``reference`` and ``masks`` hold one tensor per batch;
    ``reference`` may stop after the batches holding the first :func:`tuned_rows` sequences. Returns the error record
    (before and after, on the first :data:`GUARD_ROWS` sequences) and the block's outputs with the parameters it
    keeps, for every sequence (the next block's inputs), held by ``cache``. Tuning that leaves the guard's sequences
    worse is undone; checking on a subset instead of every row saves most of a pass over the data per block."""
    params = [p for m in modules for p in m.parameters(recurse=False)]
    groups = adam_groups(modules, config.block_lr)
    if config.block_weights_lr > 0:  # block-wise reconstruction
        weights = block_weights(block, modules)
        params += weights
        groups.append({"params": weights, "lr": config.block_weights_lr})
    sizes = [len(mask) for mask in masks]
    chunks = [(k, slice(s, min(s + config.block_rows, size))) for k, size in enumerate(sizes)
              for s in range(0, size, config.block_rows)]
    steps = _leading_chunks(chunks, config.block_steps * config.block_rows)
    guard = _leading_chunks(chunks, GUARD_ROWS)

    def error(k, rows, out=None):
        out = run(hidden[k][rows], k, rows) if out is None else out
        return _relative_error(out, reference[k][rows], masks[k][rows])

    def guard_error(outputs=None):
        with torch.no_grad():
            return sum(float(error(k, rows, None if outputs is None else outputs[k][rows]))
                       for k, rows in guard) / len(guard)

    def all_outputs():  # whole batches at a time, not block_rows
        with torch.no_grad():
            return cache.store(run(hidden[k], k, slice(None)) for k in range(len(hidden)))

    before = guard_error()
    start = [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(groups)
    with training_only(block, params):
        for step in range(config.block_steps):
            optimizer.zero_grad()
            loss = error(*steps[step % len(steps)])
            if not torch.isfinite(loss):
                break
            loss.backward()
            optimizer.step()
    outputs = all_outputs()
    after = guard_error(outputs)
    if not math.isfinite(after) or after > before:  # never leave the block worse than its start
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        outputs.release()
        after, outputs = before, all_outputs()
    return {"error_before": round(before, 6), "error_after": round(after, 6)}, outputs


def _leading(sizes: list[int], rows: int) -> int:
    """How many of the first items, of ``sizes`` sequences each, hold at least ``rows`` sequences (all of them for
    less data)."""
    count = 0
    for index, size in enumerate(sizes):
        if count >= rows:
            return index
        count += size
    return len(sizes)


def _leading_chunks(chunks: list[tuple[int, slice]], rows: int) -> list[tuple[int, slice]]:
    """The first chunks, in order, until they hold at least ``rows`` sequences."""
    return chunks[:_leading([part.stop - part.start for _, part in chunks], rows)]


def _leading_batches(batches, rows: int) -> int:
    """How many of the first batches hold at least ``rows`` sequences."""
    return _leading([batch["input_ids"].shape[0] for batch in batches], rows)


def _post_input_is_stack_output(model, source, batch, hidden) -> bool:
    call = first_call_inputs(source, lambda: forward_without_cache(model, batch))
    seen = call[0][0] if call and call[0] else None
    return isinstance(seen, torch.Tensor) and seen.shape == hidden.shape and \
        torch.allclose(seen.float(), hidden.to(seen.device).float(), rtol=1e-4, atol=1e-4)
