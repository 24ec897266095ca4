"""Memory measured from inside a process: its peak and current resident set, its proportional set, a sampler per
phase, and the recipe run with its phases marked (bench_memory.py, bench_sharding.py, bench_from_disk.py)."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

from harness.record import ROOT


def peak_rss_mb() -> float:
    """This process's lifetime peak resident memory in MiB (``ru_maxrss`` is in kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_environment() -> dict:
    """The environment of a memory measurement's process: one thread, offline, and glibc returning freed tensors to
    the OS (``MALLOC_MMAP_THRESHOLD_``), this checkout first on the path."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=path)


def resident() -> int:
    """This process's resident set now, bytes."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proportional() -> int:
    """This process's proportional set now (Pss of /proc/self/smaps_rollup), bytes: each page shared with other
    processes (the libraries every process maps) counted as its share, so that a sum over processes is the host
    memory they take together; a sum of resident sets counts shared pages once a process."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def phase_sampler(phase: list[str], peaks: dict[str, int], done: threading.Event,
                  timeline: list | None = None) -> threading.Thread:
    """A thread that keeps the largest resident set seen under each name ``phase[0]`` takes, every 20 ms, and in
    ``timeline`` each sample of the ``load`` phase as (wall-clock time, resident bytes, proportional bytes)."""
    def sample():
        while not done.is_set():
            rss = resident()
            peaks[phase[0]] = max(peaks.get(phase[0], 0), rss)
            if timeline is not None and phase[0] == "load":
                timeline.append((time.time(), rss, proportional()))
            time.sleep(0.02)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    return thread


class TrainingReached(Exception):
    """Raised where training would start, when only the load phase is measured."""


def recipe_by_phase(recipe_args: list[str], during: str, after: str, timeline: list | None = None, *,
                    stop_at_training: bool = False) -> tuple[int, dict[str, int]]:
    """``recipe.main(recipe_args)`` and this process's largest resident set in each phase: ``load`` until training
    starts, ``during`` while ``NormSwapTrainer.train`` runs, ``after`` once it returns (:func:`phase_sampler`); with
    ``stop_at_training``, the run ends where training would start (the load phase alone, exit code 0)."""
    # internal: the recipe's phases are what is measured; imported here, so that a process measuring a load alone
    # does not count the Trainer's modules
    from hf_normswap.training import recipe, sharding, trainer

    phase, peaks, done = ["load"], {}, threading.Event()
    train = trainer.NormSwapTrainer.train

    def marked_train(self, *args, **kwargs):
        if stop_at_training:  # the shard units stated as training would (sharding.ShardingLog)
            if self.teacher is not None and sharding.is_sharded(self.teacher) and self.is_world_process_zero():
                print(f"[sharding] FSDP2: teacher {sharding.describe(self.teacher)}", flush=True)
            raise TrainingReached
        phase[0] = during
        try:
            return train(self, *args, **kwargs)
        finally:
            phase[0] = after

    trainer.NormSwapTrainer.train = marked_train
    sampler = phase_sampler(phase, peaks, done, timeline)
    try:
        code = recipe.main(recipe_args)
    except TrainingReached:
        code = 0
    finally:
        done.set()
        sampler.join()
        trainer.NormSwapTrainer.train = train
    return code, peaks
