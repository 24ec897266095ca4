"""The block pass's cached hidden states: in CPU memory up to a limit, in safetensors files on disk past it.

The block pass keeps one hidden-state tensor per calibration batch for the converted trajectory and, for the
sequences block tuning reads, one for the original's. Held on the compute device these would cap the calibration
data at what that device holds beside a block; here they live on the CPU, and past ``memory_limit`` bytes in a
temporary directory (under ``TMPDIR``), removed when the pass ends, also when the process is sent SIGTERM (a job
scheduler's stop: its default action would exit without cleanup). Each read hands the tensor to the compute device;
the last file read is kept, because block tuning's steps read the rows of one batch after another in order.

safetensors rather than ``torch.save``: it stores bare tensors, and loading one runs no pickle.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class ActivationCache:
    """Where a pass's :class:`CachedTensors` live. ``memory_limit``: bytes of CPU memory they may share (None: no
    limit; 0: every tensor on disk). ``device``: where reads hand them out (the compute device)."""

    def __init__(self, memory_limit: int | None = None, device: torch.device | str = "cpu"):
        self.memory_limit = memory_limit
        self.device = torch.device(device)
        self.memory_bytes = 0  # held in CPU memory now
        self.peak_memory_bytes = 0
        self.disk_bytes = 0  # in files now
        self.peak_disk_bytes = 0
        self._directory: tempfile.TemporaryDirectory | None = None
        self._files = 0
        self._sigterm = None  # the handler replaced while files exist

    def store(self, tensors: Iterable[torch.Tensor]) -> "CachedTensors":
        """The tensors, one at a time as they come (a generator is never held whole), moved off the device."""
        cached = CachedTensors(self)
        for tensor in tensors:
            cached.append(tensor)
        return cached

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor | Path:
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.memory_limit is None or self.memory_bytes + size <= self.memory_limit:
            self.memory_bytes += size
            self.peak_memory_bytes = max(self.peak_memory_bytes, self.memory_bytes)
            return tensor
        if self._directory is None:
            self._exit_on_sigterm()
            self._directory = tempfile.TemporaryDirectory(prefix="normswap-activations-")
        path = Path(self._directory.name) / f"{self._files}.safetensors"
        self._files += 1
        save_file({"hidden": tensor}, str(path))
        self.disk_bytes += path.stat().st_size
        self.peak_disk_bytes = max(self.peak_disk_bytes, self.disk_bytes)
        return path

    def _forget(self, entry: torch.Tensor | Path) -> None:
        if isinstance(entry, Path):
            self.disk_bytes -= entry.stat().st_size
            entry.unlink()
        else:
            self.memory_bytes -= entry.numel() * entry.element_size()

    def _exit_on_sigterm(self) -> None:
        """SIGTERM raises SystemExit while files exist, so the ``with`` around the pass removes them; only where
        nobody installed a handler of their own, and only in the main thread (where Python runs handlers)."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _terminate)

    def close(self) -> None:
        """Removes the spill directory and everything in it."""
        if self._directory is not None:
            self._directory.cleanup()
            self._directory = None
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        self.memory_bytes = self.disk_bytes = 0

    def summary(self) -> dict:
        return {"peak_memory_mb": round(self.peak_memory_bytes / 2**20, 1),
                "peak_disk_mb": round(self.peak_disk_bytes / 2**20, 1)}

    def __enter__(self) -> "ActivationCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # the exit status a shell reports for a process ended by the signal


class CachedTensors(Sequence):
    """A list of tensors held by an :class:`ActivationCache`; ``[k]`` gives tensor ``k`` on the compute device."""

    def __init__(self, cache: ActivationCache):
        self._cache = cache
        self._entries: list[torch.Tensor | Path] = []
        self._last_read: tuple[int, torch.Tensor] | None = None

    def append(self, tensor: torch.Tensor) -> None:
        self._entries.append(self._cache._keep(tensor))

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> torch.Tensor:
        entry = self._entries[index]
        if not isinstance(entry, Path):
            return entry.to(self._cache.device)
        if self._last_read is None or self._last_read[0] != index % len(self):
            self._last_read = (index % len(self), load_file(str(entry), device=str(self._cache.device))["hidden"])
        return self._last_read[1]

    @property
    def on_disk(self) -> int:
        """How many of the tensors are in files."""
        return sum(isinstance(entry, Path) for entry in self._entries)

    def release(self) -> None:
        """Frees the memory and files of every tensor; the list is empty after."""
        for entry in self._entries:
            self._cache._forget(entry)
        self._entries, self._last_read = [], None
