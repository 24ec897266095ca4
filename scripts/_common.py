"""What the benchmarks share: the machine and commit every result is recorded with, the process's peak memory, and
the simulated draw of "Elementwise Layer Normalization" (reproduce_paper.py, module_fit.py).

A script imports it as ``from _common import ...``: Python puts a script's own folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MATMUL_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


def machine(device: str = "cpu") -> dict:
    """CPU model, the `lscpu` flags that decide fp32 / bf16 matmul speed, threads and load, and on a GPU its name and
    Triton's version: recorded with every row."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    except OSError:
        lscpu, cpu = "", platform.processor()
    flags = set(next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), []))
    info = dict(cpu=cpu, cpu_flags=sorted(flags & MATMUL_FLAGS),
                cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                load_average=os.getloadavg()[0])
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


# The paper's simulation: C values from N(0, SIGMA^2), the largest raised by STEP * S for S = 1..STEPS
C, SIGMA, STEP, STEPS = 100, 2.0, 5.0, 9


def simulate(seed: int = 0, channels: int = C, sigma: float = SIGMA, step: float = STEP, steps: int = STEPS):
    """(inputs, outputs) of shape (steps, C): the base draw with its largest value raised by step*S, S = 1..steps,
    and LayerNorm of each, plus the index of the outlier channel."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(channels, generator=generator, dtype=torch.float64) * sigma
    index = int(base.argmax())
    x = base.repeat(steps, 1)
    x[:, index] += step * torch.arange(1, steps + 1, dtype=torch.float64)
    y = torch.nn.functional.layer_norm(x, (channels,), eps=0.0)
    return x, y, index


def outlier_points(x: torch.Tensor, y: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The outliers' points and their mirror images (-x, -y): the data the paper fits."""
    xo, yo = x[:, index], y[:, index]
    return torch.cat([xo, -xo]), torch.cat([yo, -yo])
