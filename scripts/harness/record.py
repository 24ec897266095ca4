"""What every result is recorded with: the machine (CPU model and the flags that decide matmul speed, threads, load;
on a GPU its name) and the checkout's commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout
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


def relative(path: str) -> str:
    """``path`` from the checkout's root, as a command run there names it."""
    return str(Path(path).resolve().relative_to(ROOT))
