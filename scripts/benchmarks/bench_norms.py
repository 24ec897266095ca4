"""Speed of the element-wise norms against the norms they replace, as side-by-side ratios taken in one run.

tokens x C in fp32 / bf16, forward (no grad) and forward+backward: each element-wise method (default fused path
and the eager fallback) against a memory copy (``x.clone()``, the physical floor of a forward that reads x and
writes y), ``nn.LayerNorm`` and transformers' ``LlamaRMSNorm``. Candidates interleaved, medians (``harness/timing.py``).

    python scripts/benchmarks/bench_norms.py --sizes 576,4096 --dtypes fp32
    python scripts/benchmarks/bench_norms.py --quick                  # a smoke run: C=576, fp32, few repetitions
    python scripts/benchmarks/bench_norms.py --device cuda --sizes 576,4096 --dtypes bf16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from hf_normswap import METHODS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.timing import DTYPES, arguments, device_option, eager, interleaved, log, run_sections, split_list


def module_section(args) -> list[dict]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rows = []
    for size in args.sizes:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            torch.manual_seed(0)
            x = (4 * torch.randn(args.tokens, size)).to(args.device, dtype)
            x[0] *= 100  # a massive activation
            grad = torch.randn(args.tokens, size).to(args.device, dtype)
            norms = {
                "layernorm": nn.LayerNorm(size),
                "rmsnorm": LlamaRMSNorm(size),
                **{key: cls(size, cls.analytic_shape_value("rmsnorm", size, 1.0), amplitude=size ** 0.5)
                   for key, cls in METHODS.items()},  # ELN beta = C, DyT alpha = 1 / sqrt(C), Derf slope-matched
            }
            norms = {k: v.to(args.device, dtype) for k, v in norms.items()}
            for mode in ("forward", "forward+backward"):
                candidates = {"copy": lambda: x.clone()} if mode == "forward" else {}
                if mode == "forward+backward":
                    xg = x.detach().clone().requires_grad_()

                    def copy_step():
                        xg.clone().backward(grad)
                        xg.grad = None
                    candidates["copy"] = copy_step
                for name, norm in norms.items():
                    if mode == "forward":
                        call = (lambda n: lambda: n(x))(norm)
                    else:
                        def call(n=norm):
                            n(xg).backward(grad)
                            xg.grad = None
                            n.zero_grad(set_to_none=True)
                    candidates[name] = call
                    if name in METHODS:
                        candidates[name + "-eager"] = eager(call)
                grad_context = torch.no_grad() if mode == "forward" else torch.enable_grad()
                with grad_context:
                    med = interleaved(candidates, args.reps, warmup=2)
                for name, seconds in med.items():
                    row = dict(section="module", C=size, dtype=dtype_name, mode=mode, impl=name, ms=seconds * 1e3,
                               vs_copy=seconds / med["copy"], vs_layernorm=seconds / med["layernorm"],
                               vs_rmsnorm=seconds / med["rmsnorm"])
                    rows.append(row)
                log(f"C={size:<5} {dtype_name} {mode:<17} " + "  ".join(
                    f"{n}={s * 1e3:.2f}ms ({s / med['copy']:.2f}x copy)" for n, s in med.items()))
    return rows


def parse_args(argv=None):
    parser = arguments(__doc__, "C=576 fp32, few repetitions")
    parser.add_argument("--sizes", default="576,2048,4096")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=15, help="repetitions per candidate")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.dtypes, args.reps = "576", "fp32", 5
    args.sizes, args.dtypes, args.sections = split_list(args.sizes, int), split_list(args.dtypes), ["module"]
    return device_option(parser, args)


def main(argv=None) -> int:
    return run_sections(__file__, parse_args(argv), {"module": module_section}, argv)


if __name__ == "__main__":
    sys.exit(main())
