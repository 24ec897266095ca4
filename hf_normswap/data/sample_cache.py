"""The cache of the original's samples on disk: one safetensors file a batch (token ids only, nothing executable),
under a key made of the model's identity (its name and a hash of a sample of every weight), the sampling settings
and the prompt's content, in ``HF_NORMSWAP_CACHE`` (default ``~/.cache/hf_normswap``).

Anything may have changed the files since they were written (a kill, a full disk, another program, a link put in
place): what is read back is checked against the model and the settings where it is read (:meth:`SampleCache.read`),
and a batch that fails is named and drawn again by the caller (``generated``); a cache that cannot be written is one
line naming ``HF_NORMSWAP_CACHE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..atomic_write import atomic_write
from ..model_inputs import text_config

CACHE_ENV = "HF_NORMSWAP_CACHE"
SAMPLER = "inverse-cdf"  # how a token is drawn (generated.InverseCdfSampler): part of the cache key


def weights_digest(model: nn.Module) -> str:
    """The model's name and a hash of every weight's name, shape, dtype and a strided sample of its values: a
    changed weight changes it, at the cost of a few thousand values a tensor, not the whole model."""
    digest = hashlib.sha256(str(getattr(model.config, "name_or_path", "")).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_normswap") / "generated"


class DamagedBatch(ValueError):
    """A cached batch that this cache did not write as it is: unreadable, of another shape, or out of range."""


class SampleCache:
    """The batches of one (model, settings) pair: ``batch-000012.safetensors``, written atomically. What is read
    back is checked against the model and the settings (:meth:`read`), since anything may have changed the files."""

    def __init__(self, model: nn.Module, settings, root: Path | None = None,
                 prompt_texts: list[str] | None = None):
        self.settings = settings
        key = {"model": weights_digest(model), "sampler": SAMPLER, **dataclasses.asdict(settings)}
        if settings.prompt != "bos":  # the spec names the source; its content is what the samples start from
            key["prompt_content"] = texts_digest(prompt_texts or [])
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.directory = (root or cache_root()) / name
        self.key = key
        self.vocabulary = vocabulary_size(model)
        self.written: set[int] = set()  # the batches this object wrote (a run sharing the folder writes others)

    def path(self, index: int) -> Path:
        return self.directory / f"batch-{index:06d}.safetensors"

    def has(self, index: int) -> bool:
        path = self.path(index)
        if path.is_dir():  # not ours to remove, and a batch cannot be written over it
            raise ValueError(f"generated: {path} is a directory, not a batch of samples: move it away")
        return path.is_file()

    @contextmanager
    def drawing(self, index: int):
        """Held while batch ``index`` is drawn: another process of the same cache (a second run of the same original
        and sampling settings) that reaches it waits, then reads what this one wrote instead of drawing it again.
        An OS lock (``flock``), so a killed holder releases it; its file is opened without following a link, and
        removed while still held (a waiter on the removed file starts again on a new one), so none is left."""
        path = self.directory / f".batch-{index:06d}.lock"
        lock = FileLock(path)
        try:
            lock.acquire()
        except OSError as error:  # a link or a folder in its place (ELOOP, EISDIR) says nothing of which
            if path.is_symlink() or path.is_dir():
                kind = "link" if path.is_symlink() else "folder"
                raise ValueError(f"generated: cannot write the sample cache {self.directory} ({path.name} is a "
                                 f"{kind}, not its lock file: {error.strerror}); move {path} away, or set "
                                 f"{CACHE_ENV} to another folder") from None
            raise _unwritable(self.directory, error) from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            lock.release()

    def prepare(self) -> None:
        """The cache's folder, made (and found writable) before anything is drawn into it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # a staging file of its own (two draws at once, in threads or processes), renamed over a link put
            # there, never written through it
            with atomic_write(self.directory / "settings.json") as partial:
                partial.write_text(json.dumps(self.key, indent=1))
        except OSError as error:
            raise _unwritable(self.directory, error) from None

    def write(self, index: int, ids: torch.Tensor, lengths: torch.Tensor, precision: str) -> None:
        """Batch ``index``, with the precision it was drawn in (``auto`` resolves per process) in its metadata."""
        self.prepare()
        try:
            with atomic_write(self.path(index)) as partial:  # a kill leaves a .partial file, never a half batch
                save_file({"input_ids": ids.to(torch.int32).contiguous(), "lengths": lengths.to(torch.int32)},
                          partial, metadata={"precision": precision})
        except (OSError, SafetensorError) as error:
            raise _unwritable(self.directory, error) from None
        self.written.add(index)

    def read(self, index: int) -> list[list[int]]:
        """The rows of batch ``index``; :class:`DamagedBatch` naming the file and why, for anything this cache
        would not have written: a link, an unreadable file, other tensors, shapes or dtypes, ids outside the
        model's vocabulary, lengths outside the rows."""
        path = self.path(index)
        if path.is_symlink():
            raise DamagedBatch(f"{path} is a link, not a batch this cache wrote")
        try:
            batch = load_file(path)
        except Exception as error:  # safetensors raises its own error types for a cut or garbage file
            raise DamagedBatch(f"{path} is unreadable ({_first_line(error)})") from None
        ids, lengths = batch.get("input_ids"), batch.get("lengths")
        settings = self.settings
        problem = None
        if set(batch) != {"input_ids", "lengths"}:
            problem = f"it holds {sorted(batch)}, not input_ids and lengths"
        elif ids.dtype != torch.int32 or lengths.dtype != torch.int32 or ids.dim() != 2 or lengths.dim() != 1:
            problem = "its ids or lengths are not rows of int32 token ids"
        elif ids.shape[0] != settings.batch_size or len(lengths) != ids.shape[0] or ids.shape[1] > settings.length:
            problem = (f"its ids are {tuple(ids.shape)} with {len(lengths)} lengths, not {settings.batch_size} rows "
                       f"of at most {settings.length}")
        elif ids.numel() and (int(ids.min()) < 0 or self.vocabulary and int(ids.max()) >= self.vocabulary):
            problem = f"its ids run from {int(ids.min())} to {int(ids.max())}, outside the model's vocabulary"
        elif len(lengths) and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
            problem = f"its lengths run from {int(lengths.min())} to {int(lengths.max())}, outside its rows"
        if problem:
            raise DamagedBatch(f"{path} is damaged: {problem}")
        return [row[:n].tolist() for row, n in zip(ids, lengths.tolist())]


def texts_digest(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:16]


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _unwritable(directory: Path, error: BaseException) -> ValueError:
    reason = getattr(error, "strerror", None) or _first_line(error)
    return ValueError(f"generated: cannot write the sample cache {directory} ({reason}): set {CACHE_ENV} to a "
                      "writable folder with free space")


def vocabulary_size(model: nn.Module) -> int | None:
    """Ids the model's output head draws from (its config's ``vocab_size`` where it has no head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    size = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [None])[0]
    return size or getattr(text_config(model), "vocab_size", None)


def wait_for(cache: SampleCache, indices, seconds: float) -> None:
    deadline = time.time() + seconds
    while not all(cache.has(i) for i in indices):
        if time.time() > deadline:
            missing = sum(not cache.has(i) for i in indices)
            raise ValueError(f"generated: {missing} of {len(indices)} batches of {cache.directory} were not drawn by "
                             "the other processes")
        time.sleep(1.0)
