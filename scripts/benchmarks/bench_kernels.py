"""The norm kernels against a memory copy and torch's own norms, and what one norm call costs on the host.

Sections (``--sections``):

* ``device``: one norm layer at ``--tokens`` x each of ``--sizes`` in ``--dtype``, forward and forward+backward
  (gradients of the input and every parameter), against ``x.clone()`` (the memory floor), ``nn.LayerNorm`` and
  transformers' ``LlamaRMSNorm``. Each method through the Triton kernels (``-triton``, CUDA; on the CPU only under
  ``TRITON_INTERPRET=1``, a check of the code and no timing), the compiled kernels (``-compiled``) and the plain
  formula (``-eager``). On CUDA each timing is ``--calls`` calls between two CUDA events after ``--warmup`` calls,
  the candidates interleaved, the median of ``--reps`` rounds.
* ``host``: the same candidates on a tiny input (``--host-shape``, one decode step's tokens), where a call's time is
  what it costs on the host: the checks, the autograd function, the compiled function's guards, allocations. On the
  CPU the Triton path cannot launch; ``-triton-host`` runs everything of it but Triton's own launcher (its kernels
  replaced by a no-op), the part a CPU can measure. On CUDA ``-triton`` is the whole call.

    python scripts/benchmarks/bench_kernels.py --sections host --json /tmp/host.json                  # the CPU
    python scripts/benchmarks/bench_kernels.py --device cuda --sizes 4096 --dtype bf16 --json /tmp/k.json   # a GPU
"""

from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hf_normswap import ElementwiseNorm, METHODS, kernels  # internal: the fused paths (kernels) are what is timed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_device, add_output, script_parser
from harness.record import commit, machine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def log(*args):
    print(*args, flush=True)


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing (the host section on a CPU)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def path(name: str, device: str):
    """Route element-wise calls inside the block: 'triton', 'triton-host' (no launches), 'compiled' or 'eager'."""
    from hf_normswap import triton_kernels  # internal: its launches routed by hand

    saved = kernels._on_triton, kernels.MIN_NUMEL, triton_kernels._forward_kernel, triton_kernels._backward_kernel
    try:
        if name == "eager":
            kernels.set_fast_path(False)
        elif name == "compiled":
            kernels._on_triton, kernels.MIN_NUMEL = (lambda x: False), 0  # every size, as the Triton path
        elif name == "triton-host":
            kernels._on_triton = lambda x: True
            triton_kernels._forward_kernel = triton_kernels._backward_kernel = _NoLaunch()
        elif device == "cpu":  # 'triton' on CPU tensors: the interpreter, as the tests run it
            kernels._on_triton = lambda x: True
        yield
    finally:
        kernels.set_fast_path(True)
        kernels._on_triton, kernels.MIN_NUMEL, triton_kernels._forward_kernel, triton_kernels._backward_kernel = saved


def candidates(size: int, dtype: torch.dtype, device: str, paths: list[str]) -> dict:
    """name -> (path or None, module or None): the layers a call runs, parameters in the model's dtype."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {"copy": (None, None), "layernorm": (None, nn.LayerNorm(size)),
           "rmsnorm": (None, LlamaRMSNorm(size))}
    for method, cls in METHODS.items():
        for name in paths:
            module = cls(size, cls.analytic_shape_value("rmsnorm", size, 1.0), amplitude=size ** 0.5)
            out[f"{method}-{name}"] = (name, module)
    for _, module in out.values():
        if module is not None:
            module.to(device, dtype)
            if isinstance(module, ElementwiseNorm):
                module._log_param().data = module._log_param().data.float()  # as convert keeps it: fp32
    return out


def call(module, x, grad, backward: bool):
    if module is None:
        y = x.clone()
    else:
        y = module(x)
    if backward:
        params = [] if module is None else [p for p in module.parameters()]
        # allow_unused: a parameter the input does not reach (linear's position-0 scale on rows without positions)
        torch.autograd.grad(y, [x, *params], grad, allow_unused=True)
    return y


def timed(device: str, calls: int, fn) -> float:
    """Seconds per call over ``calls`` calls: CUDA events on a GPU, the wall clock on the CPU."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def measure(shape: tuple, dtype: torch.dtype, device: str, paths: list[str], args, label: str) -> list[dict]:
    layers = candidates(shape[-1], dtype, device, paths)
    torch.manual_seed(0)
    x = (4 * torch.randn(shape)).to(device, dtype).requires_grad_()
    grad = torch.randn(shape).to(device, dtype)
    rows = []
    for mode in ("forward", "forward+backward"):
        backward = mode != "forward"
        times = {name: [] for name in layers}
        for name, (route, module) in layers.items():  # warm-up: compiles, Triton's first launch
            with path(route, device) if route else contextlib.nullcontext(), torch.set_grad_enabled(backward):
                for _ in range(args.warmup):
                    call(module, x, grad, backward)
        for _ in range(args.reps):
            for name, (route, module) in layers.items():
                with path(route, device) if route else contextlib.nullcontext(), torch.set_grad_enabled(backward):
                    times[name].append(timed(device, args.calls, lambda: call(module, x, grad, backward)))
        copy = statistics.median(times["copy"])
        for name, values in times.items():
            seconds = statistics.median(values)
            interpreted = name.endswith("-triton") and device == "cpu"
            rows.append(dict(section=label, shape=list(shape), dtype=str(dtype).split(".")[-1], mode=mode,
                             impl=name, us=round(seconds * 1e6, 3), vs_copy=round(seconds / copy, 3),
                             **({"interpreted": True} if interpreted else {})))
            log(f"{label} {tuple(shape)} {mode:<16} {name:<18} {seconds * 1e6:10.2f} us  {seconds / copy:6.2f}x copy"
                + ("  (interpreter: not a timing)" if interpreted else ""))
    return rows


def parse_args(argv=None):
    parser = script_parser(__doc__)
    parser.add_argument("--sections", default="device,host", help="comma-separated: device, host")
    add_device(parser)
    parser.add_argument("--sizes", default="576,4096")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--host-shape", default="1,576", help="the host section's input: tokens,C")
    parser.add_argument("--calls", type=int, default=20, help="calls a timing")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--paths", default="triton,compiled,eager",
                        help="element-wise paths to time (the Triton one where it can run)")
    add_output(parser, None, "write all rows to this file", flag="--json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}: no CUDA GPU here; use --device cpu", file=sys.stderr)
        return 2
    kernels.install()
    on_gpu = device.startswith("cuda")
    try:
        import triton
        has_triton, interpret = True, bool(triton.knobs.runtime.interpret)
    except ImportError:
        has_triton, interpret = False, False
    rows = []
    sections = args.sections.split(",")
    wanted = args.paths.split(",")
    others = [name for name in ("compiled", "eager") if name in wanted]
    if "device" in sections:
        paths = (["triton"] if "triton" in wanted and has_triton and (on_gpu or interpret) else []) + others
        for size in map(int, args.sizes.split(",")):
            rows += measure((args.tokens, size), DTYPES[args.dtype], device, paths, args, "device")
    if "host" in sections:
        triton_path = ("triton" if on_gpu else "triton-host") if has_triton and "triton" in wanted else None
        paths = ([triton_path] if triton_path else []) + others
        shape = tuple(int(n) for n in args.host_shape.split(","))
        rows += measure(shape, DTYPES[args.dtype], device, paths, args, "host")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = {"machine": machine(device), "commit": commit(), "date": date, "argv": sys.argv[1:], "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
