"""One launch at a time in a run folder: two recoveries into one ``output_dir`` both trained, rotated each other's
checkpoints away and replaced each other's ``final``. The folder is claimed under an OS lock (``flock``, through
filelock) held for the whole launch, as a convert's commit holds its folder's: a killed launch (kill -9 too)
releases it, so a stale lock never blocks the next launch. The lock file stays in the folder, empty; removing it
while held would let two later launches each lock a file of their own.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock, Timeout

from ..validation import ValidationError, first_line

LOCK = ".run.lock"


def lock_run_dir(output_dir: str | Path) -> FileLock:
    """The held lock of ``output_dir`` (created if need be); ValidationError, in one line, when another launch holds
    it or it cannot be taken. The caller releases it when the launch ends."""
    out = Path(output_dir)
    lock = FileLock(out / LOCK, timeout=0)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise ValidationError(f"output_dir {out} is in use by another launch of the recipe (it holds {out / LOCK}): "
                              "wait for it to end, or name another output_dir") from None
    except OSError as error:  # a link or a folder in its place, a read-only folder
        raise ValidationError(f"output_dir {out}: cannot take its lock {out / LOCK} ({first_line(error)}); remove "
                              "what is there, or name another output_dir") from None
    return lock
