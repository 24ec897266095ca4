"""A checkpoint directory on disk: which files a save writes (and so may replace or push) and which are the user's,
and the transaction that puts a new checkpoint in place.

:func:`atomic_directory` yields a temporary directory beside the target and on success puts it in place: renamed
(absent or empty target), swapped by two renames (an existing checkpoint), or merged file by file (a directory
that holds other things, as a Trainer's output_dir). A killed save leaves the target as it was or complete; what
it leaves beside it, the next save into the same place cleans up (:func:`recover_interrupted`). Nothing the user
owns is replaced or removed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

from ..validation import ValidationError, check_path_length
from . import model_card, remote_code
from .record import converted_config


class CheckpointError(Exception):
    """A user-facing problem saving or loading a checkpoint; the message says what to change."""


class OutputExistsError(CheckpointError):
    """The output directory exists and is not empty, and overwriting was not asked for."""


# The files a save writes: config, weights (one file or shards), remote code, card, tokenizer / processor. Only a
# directory holding nothing else is replaced by an overwrite; anything else in it belongs to the user.
OWN_FILES = re.compile(
    r"config\.json|generation_config\.json|README\.md|" + re.escape(remote_code.FILE_NAME) + r"|"
    r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|"
    r"(tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|merges|chat_template|preprocessor_config|"
    r"processor_config|spiece|sentencepiece\.bpe|normalizer)\.(json|txt|model|jinja)"
)
WEIGHT_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def _temporary_siblings(target: Path, kind: str) -> list[Path]:
    """Leftovers of earlier saves into ``target`` whose process is gone: exactly the names a save gives them,
    ``.NAME.KIND-PID-HEX8``, so a folder of the user's that merely starts like one is never touched."""
    own = re.compile(rf"\.{re.escape(target.name)}\.{kind}-(\d+)-[0-9a-f]{{8}}")
    found = []
    for path in target.parent.glob(f".{glob_escape(target.name)}.{kind}-*"):
        match = own.fullmatch(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _alive(pid):
            continue  # another save into the same place is running
        found.append(path)
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


def _pending_restore(target: Path) -> Path | None:
    """The previous checkpoint that an overwrite interrupted between its two renames left in ``.NAME.old-*``, and
    that the next save into ``target`` puts back; None when ``target`` exists."""
    if target.exists() or target.is_symlink() or not target.parent.is_dir():
        return None
    old = _temporary_siblings(target, "old")
    return old[-1] if old else None


def recover_interrupted(path: str | os.PathLike) -> None:
    """Finish what an interrupted save into ``path`` left: put the previous checkpoint back if the overwrite
    stopped between its two renames, and remove staging and superseded copies (they are the package's own). Run by
    a save once its checks passed: a refused command touches nothing."""
    target = _real(path)
    if not target.parent.is_dir():
        return
    restore = _pending_restore(target)
    if restore is not None:
        os.rename(restore, target)
    for leftover in _temporary_siblings(target, "old") + _temporary_siblings(target, "partial"):
        shutil.rmtree(leftover, ignore_errors=True)


def _real(path: str | os.PathLike) -> Path:
    """The absolute path a save writes: through a symlink (a link to a checkpoint stays a link to the new one)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _is_own_file(path: Path, also_own: set[str] = frozenset()) -> bool:
    """A plain file with a name that a save writes (or one of ``also_own``)."""
    return path.is_file() and not path.is_symlink() and bool(OWN_FILES.fullmatch(path.name) or path.name in also_own)


def _users_readme(directory: Path) -> bool:
    """``directory`` holds a README.md that is not this package's card: the user's, never replaced or pushed."""
    card = directory / "README.md"
    return card.is_file() and not model_card.is_own_card(card)


def checkpoint_files(directory: Path) -> list[str]:
    """The files of a saved checkpoint in ``directory`` (sorted): what a push uploads, links to files included (the
    Hub cache's snapshots are links into its blobs). Anything beside them (a Trainer's checkpoint-N folders, notes,
    a README.md that is not this package's card) is the user's."""
    user = {"README.md"} if _users_readme(directory) else set()
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and OWN_FILES.fullmatch(p.name) and p.name not in user)


def _foreign_entries(directory: Path, also_own: set[str] = frozenset()) -> list[str]:
    """Entries of a checkpoint directory that a save would not write (sorted), besides ``also_own``."""
    return sorted(p.name for p in directory.iterdir() if not _is_own_file(p, also_own))


def _replaceable(directory: Path, also_own: set[str] = frozenset()) -> str | None:
    """Why an overwrite may not replace ``directory``, or None when it holds a checkpoint's own files only."""
    if converted_config(directory) is None:
        return "it is not empty and not a checkpoint saved by hf_normswap"
    foreign = _foreign_entries(directory, also_own)
    if foreign:
        return f"it holds more than a checkpoint ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
    return None


def check_output_dir(path: str | os.PathLike, overwrite: bool = False, into_existing: bool = False) -> Path:
    """Refuse, before any work is done, an output that exists as a file, or where nothing can be written, or that
    is a non-empty directory (without ``overwrite``) or holds anything but a checkpoint's own files (with it;
    ``into_existing`` allows that, see :func:`atomic_directory`). It changes nothing: a checkpoint that an
    interrupted save left to be put back is checked as if it were back (see :func:`recover_interrupted`)."""
    path = Path(path).expanduser()
    try:
        check_path_length(path, "output")
    except ValidationError as error:
        raise OutputExistsError(str(error)) from None
    real = _real(path)
    existing = real if real.exists() else _pending_restore(real)
    if existing is not None:
        if not existing.is_dir():
            raise OutputExistsError(f"output {path} exists and is not a directory; choose another --output")
        if any(existing.iterdir()) and not into_existing:
            if not overwrite:
                raise OutputExistsError(f"output directory {path} is not empty; pass --overwrite (overwrite=True) "
                                        "to replace the checkpoint in it")
            refused = _replaceable(existing)
            if refused:
                raise OutputExistsError(f"output directory {path}: {refused}; overwriting replaces only a "
                                        "checkpoint's own files: choose a new or empty directory")
    ancestor = real
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputExistsError(f"output {path}: {ancestor} is a file, not a folder; choose another --output")
    writable_in = ancestor if ancestor != real else ancestor.parent
    if not os.access(writable_in, os.W_OK | os.X_OK):
        raise OutputExistsError(f"output {path}: cannot write in {writable_in} (permission denied); choose another --output")
    return path


def _replace(target: Path, staging: Path) -> None:
    """Put ``staging`` at ``target`` (an existing checkpoint) so that at every moment one of the two sits under the
    name, or the old one waits in ``.NAME.old-*`` for :func:`recover_interrupted` to put it back."""
    previous = target.parent / f".{target.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(target, previous)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(previous, target)
        raise
    shutil.rmtree(previous, ignore_errors=True)


def _merge(target: Path, staging: Path) -> None:
    """Write the checkpoint's files into a directory that holds other things (a Trainer's output_dir with its
    checkpoint-N folders), file by file like transformers' own save; stale weight shards of an earlier save go. A
    README.md that is not a card of this package stays: it is the user's."""
    if _users_readme(target):
        (staging / "README.md").unlink()
    written = {p.name for p in staging.iterdir()}
    for stale in target.iterdir():
        if WEIGHT_FILES.fullmatch(stale.name) and stale.name not in written and stale.is_file():
            stale.unlink()
    for name in sorted(written, key=lambda n: n == "config.json"):  # config last: it marks the checkpoint complete
        os.replace(staging / name, target / name)
    staging.rmdir()


@contextmanager
def _commit_lock(parent: Path):
    """Saves into one folder commit one at a time, under a lock of the folder that a killed process releases;
    without ``flock`` (Windows) the no-replace rename of :func:`_commit` alone decides."""
    try:
        import fcntl  # lazy: POSIX only (absent on Windows)
    except ImportError:
        yield
        return
    handle = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing releases the lock


def _commit(path, target: Path, staging: Path, overwrite: bool, into_existing: bool) -> None:
    """Put ``staging`` at ``target``; what another save put there meanwhile is replaced only with ``overwrite``."""
    if target.exists() and any(target.iterdir()):
        if not (overwrite or into_existing):
            raise OutputExistsError(f"output directory {path} was filled by another save while this one ran; pass "
                                    "--overwrite (overwrite=True) to replace it, or choose another --output")
        refused = _replaceable(target, {p.name for p in staging.iterdir()})
        if not refused:
            _replace(target, staging)
        elif into_existing:
            _merge(target, staging)
        else:  # it was filled while we worked
            raise OutputExistsError(f"output directory {target} changed during the save: {refused}")
        return
    try:
        os.rename(staging, target)  # onto nothing or an empty folder; a folder with anything in it is never replaced
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise OutputExistsError(f"output {path} was created by another save while this one ran; pass --overwrite "
                                "(overwrite=True) to replace it, or choose another --output") from None


@contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False, into_existing: bool = False):
    """Yield a temporary directory beside ``path``; on success it becomes ``path``, on any error it is removed.

    ``path`` absent or empty: renamed into place. ``path`` a checkpoint (``overwrite``): replaced by two renames
    (see :func:`_replace`). ``into_existing``: a directory holding other things keeps them and gets the files (see
    :func:`_merge`). An interrupted save leaves ``path`` as it was, or the new checkpoint; what it leaves beside
    it, the next save into the same place cleans up.
    """
    check_output_dir(path, overwrite, into_existing)
    target = _real(path)
    recover_interrupted(target)
    created = []
    for parent in reversed(target.parents):
        try:
            parent.mkdir()
            created.append(parent)
        except FileExistsError:  # there already, or made by a save running beside this one
            pass
    staging = target.parent / f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        for written in staging.rglob("*"):  # some writers (safetensors) create files private (0600)
            if written.is_file():
                written.chmod(0o666 & ~umask)
        with _commit_lock(target.parent):  # the decision and the rename it allows, one save at a time
            _commit(path, target, staging, overwrite, into_existing)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in reversed(created):
            try:
                parent.rmdir()
            except OSError:
                break
        raise
