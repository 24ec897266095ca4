"""Where a finished model goes, for ``convert`` and ``recover`` alike: saved into its directory, pushed to the Hub,
and checked to reload with identical logits. A save or push that fails keeps the model in a temporary directory
that the one-line error names (:func:`keep`), so hours of conversion or training are never lost to a full disk, a
vanished directory or a network failure."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..atomic_write import atomic_write
from ..model_inputs import first_tensor
from ..validation import first_line
from .directory import CheckpointError
from .hub import PushError, push
from .loading import load

PROBE_TEXT = "Normalization layers can be replaced by element-wise functions."


def keep(save, name: str) -> Path:
    """Save with ``save(directory)`` into a fresh temporary directory (its ``name`` subfolder) and return the path;
    when even that fails, CheckpointError and nothing left behind: a model that cannot be saved where it was asked
    to go (a full disk, a folder gone) is never lost to the failed write."""
    folder = Path(tempfile.mkdtemp(prefix="normswap-"))
    try:
        return save(folder / name)
    except (OSError, CheckpointError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(f"cannot save the model, not even to a temporary directory ({first_line(error)}); "
                              "free disk space and run again") from None


def save_or_keep(save: Callable, directory, *, overwrite: bool, what: str = "converted model") -> Path:
    """``save(directory, overwrite=...)`` (e.g. a ``functools.partial`` of ``save_pretrained``); on failure the
    model is saved into a temporary directory and a CheckpointError names it (``what``: the model, in words)."""
    try:
        save(directory, overwrite=overwrite)
    except (OSError, CheckpointError) as error:
        try:
            kept = keep(save, Path(directory).name)
        except CheckpointError as lost:
            raise CheckpointError(f"cannot save to {directory} ({first_line(error)}); {lost}") from None
        raise CheckpointError(f"cannot save to {directory} ({first_line(error)}); the {what} is kept in {kept}: "
                              "move it into place") from None
    return Path(directory)


def publish(save: Callable, directory: str | None, repo: str | None, *, overwrite: bool = False,
            private: bool = False, log: Callable[[str], None] = print) -> None:
    """Save into ``directory`` and push to the Hub ``repo``, either or both; pushing without a directory goes
    through a temporary one, removed once pushed (kept, and named, when the push fails)."""
    if directory:
        save_or_keep(save, directory, overwrite=overwrite)
        log(f"saved to {directory}")
    if not repo:
        return
    folder = directory or keep(save, "checkpoint")
    try:
        log(f"pushed to {push(folder, repo, private=private)}")
    except PushError as error:
        where = "" if directory else f"; the converted model is kept in {folder}: push it with `normswap push`"
        raise PushError(f"{error}{where}") from None
    if not directory:
        shutil.rmtree(Path(folder).parent)


def probe_logits(model, tokenizer) -> torch.Tensor:
    """The model's output on a fixed input, for the reload check."""
    ids = tokenizer(PROBE_TEXT, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return first_tensor(model(input_ids=ids["input_ids"].to(next(model.parameters()).device)))


def reloads_identically(expected: torch.Tensor, directory, tokenizer) -> bool:
    """Load the saved checkpoint back (``hf_normswap.load``) and compare its logits with the saved model's
    (``probe_logits`` before the save) bit for bit."""
    reloaded = load(directory).to(expected.device)
    return torch.equal(expected, probe_logits(reloaded, tokenizer))


def write_whole(path, text: str) -> None:
    """``path`` holds the new text or what it held before, never a part: a write that fails (a full disk) leaves no
    empty or truncated file (a conversion's report). A device or a pipe (``/dev/stdout``) is written in place."""
    path = Path(os.path.realpath(Path(path).expanduser()))
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    with atomic_write(path) as staging:
        staging.write_text(text)
