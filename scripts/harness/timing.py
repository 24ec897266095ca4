"""What the speed benchmarks share (bench_norms.py, bench_model_speed.py, bench_calibration_cost.py,
bench_training.py): candidates timed interleaved, peak memory of a fresh process, and the run's frame (machine,
command, sections, JSON).

Every comparison interleaves its candidates (A B C A B C ...) and reports medians, so that a noisy shared machine
slows all candidates alike and the ratios stay meaningful.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from hf_normswap import kernels  # internal: what is timed is the fused path against the plain formula
from hf_normswap.placement import check_device  # internal: --device refused as the package refuses it

from harness.flags import add_device, add_output, script_parser
from harness.record import machine, relative

kernels.install()  # modules built by hand here: route them through the fused path (--eager runs turn it off)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(*args):
    print(*args, flush=True)


def synchronize():
    """Wait for the GPU's queued work, so that a timing covers it (nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def interleaved(candidates: dict, reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate, calls interleaved round-robin."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def eager(fn):
    """``fn`` with the fused path switched off: the plain formula, as in remote code or without a compiler."""
    def run():
        with kernels.fallback():
            return fn()
    return run



class PeakRSS:
    """Peak resident memory of this process above its level at start, sampled every 2 ms in a thread.

    Only meaningful in a fresh process (:func:`child_result` starts one): a warm one serves new tensors from memory it
    freed earlier without growing, so that an in-process reading misses what the call allocates.
    """

    def __init__(self):
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, False

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2 ** 20

    @property
    def absolute_mib(self) -> float:
        return self.peak / 2 ** 20


def child_result(script: str, arguments: list[str], what: str) -> dict:
    """The JSON that the script at ``script`` (a path: its ``__file__``) prints last when run with ``arguments`` in a
    fresh process (its peak memory is then its own)."""
    result = subprocess.run([sys.executable, script, *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def arguments(doc: str, quick: str, device: str | None = "cpu, cuda, cuda:1 (default: cpu)"):
    """The parser of a speed benchmark: its docstring, ``--quick`` (a smoke run: ``quick``), ``--device`` (unless
    None) and ``--json``."""
    parser = script_parser(doc)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    if device:
        add_device(parser, device)
    add_output(parser, None, "write all rows to this file", flag="--json")
    return parser


def run_sections(script: str, args, sections: dict, argv, summary=None, children: dict | None = None) -> int:
    """Log the machine and the command (``script``: the script's ``__file__``), run ``args.sections`` in order, write every row (and ``summary(rows)``) to
    ``args.json``. ``children``: ``{option: measure}``; a child process started with that option set prints
    ``measure(args)`` as JSON instead (:func:`child_result` reads it)."""
    for option, measure in (children or {}).items():
        if getattr(args, option):
            print(json.dumps(measure(args)))
            return 0
    info = dict(machine(args.device), device=args.device)
    log(f"machine: {info}")
    log(f"command: python {relative(script)} {' '.join(sys.argv[1:] if argv is None else argv)}")
    rows = []
    for name in args.sections:
        start = time.perf_counter()
        rows += sections[name](args)
        log(f"[{name} section: {time.perf_counter() - start:.0f}s]")
    info["load_average_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=info, args=vars(args), rows=rows, cpu=info["cpu"],
                                                   cpu_flags=info["cpu_flags"], **(summary(rows) if summary else {})),
                                              indent=1))
    return 0


def split_list(text: str, kind=str) -> list:
    """A comma-separated option as a list."""
    return [kind(s.strip()) for s in text.split(",") if s.strip()]


def device_option(parser, args):
    """``args``, its ``--device`` refused through ``parser`` (exit 2) when this machine has no such device."""
    try:
        check_device(args.device, "--device")
    except ValueError as error:
        parser.error(str(error))
    return args
