"""How closely each element-wise method can follow a model's norms, module by module, on the same activations.

Every norm's input and output are captured once from the original model; each method is then fitted to each norm
on those same rows, from two starts:

* ``fitted``: the analytic start, then least squares over the shape parameter (with Derf's shift), weight and bias,
  per channel (``fitting.fit_module``, as the ``kl`` and ``encoder`` strategies do before their end-to-end steps);
* ``saturating``: the block strategy's start (``fitting.saturating_init``) as it is, before any block step.

Reported per method and start, over the norms: the relative error on ordinary tokens and on first-position tokens
(the attention sink), the mean absolute residual, and the share of elements whose ``|f(x)|`` exceeds 0.95 (saturated).
``--paper`` adds the simulation of "Elementwise Layer Normalization" (``scripts/analyses/reproduce_paper.py``, its draw from
``paper_draw.py``) for every method.

    python scripts/analyses/module_fit.py --model offline:smollm2 --data $WIKITEXT/wiki.valid.tokens --out module_fit.jsonl
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_normswap import METHODS, find_norms, load_model
# internal: the fits and starts calibration makes, each replacement as convert builds it, --data read as normswap
# reads it: these are what is analysed
from hf_normswap.calibration.fitting import analytic_input_scale, fit_curve, fit_module, saturating_init
from hf_normswap.data import load_texts, token_blocks
from hf_normswap.surgery import build_replacement

from paper_draw import C, SIGMA, outlier_points, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_model, add_output, add_text_blocks, add_threads, script_parser, use_threads
from harness.record import commit, machine

STARTS = ("fitted", "saturating")


def capture(model, ids: torch.Tensor) -> dict:
    """``{norm name: (inputs, outputs)}`` of the original model, rows = tokens, fp32 on the CPU."""
    norms = find_norms(model)
    seen = {}
    handles = [model.get_submodule(n.name).register_forward_hook(
        lambda m, a, o, name=n.name: seen.__setitem__(name, (a[0].detach().float().flatten(0, -2),
                                                             o.detach().float().flatten(0, -2)))) for n in norms]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return {n.name: (n, *seen[n.name]) for n in norms}


def fit_norm(model, info, x, y, is_first, method: str, start: str, max_iter: int) -> dict:
    scale = analytic_input_scale(x, info.kind, is_first)
    module = build_replacement(model.get_submodule(info.name), info, method, input_scale=scale, per_channel=True)
    module.float()
    if start == "saturating":
        saturating_init(module, x, info.kind, scale, is_first)
    params = ("shape", "weight", "bias") if start == "fitted" else ()
    stats = fit_module(module, x, y, params=params, is_first=is_first, max_iter=max_iter)
    return stats.to_dict()


def summary(rows: list[dict]) -> dict:
    def mean(key):
        values = [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]
        return statistics.fmean(values) if values else None

    return {"norms": len(rows), "rel_error_mean": mean("rel_error"),
            "rel_error_median": statistics.median(r["rel_error"] for r in rows),
            "rel_error_first_mean": mean("rel_error_first"), "mean_abs_residual": mean("mean_abs_residual"),
            "saturation_mean": mean("saturation")}


def paper(methods: list[str], seeds: int) -> dict:
    """Mean absolute residual of each method on the paper's outlier points, over ``seeds`` draws."""
    residuals = {m: [] for m in methods}
    for seed in range(seeds):
        x, y, index = simulate(seed)
        px, py = outlier_points(x, y, index)
        for method in methods:
            _, stats = fit_curve("layernorm", method, px, py, size=C, amplitude=math.sqrt(C - 1), input_scale=SIGMA)
            residuals[method].append(stats.mean_abs_residual)
    return {m: {"seed0": r[0], "mean": statistics.fmean(r), "std": statistics.stdev(r) if len(r) > 1 else 0.0}
            for m, r in residuals.items()}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_model(parser)
    add_text_blocks(parser, "text whose activations the methods are fitted to")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--max-iter", type=int, default=100, help="L-BFGS iterations a fit (calibration's default)")
    parser.add_argument("--paper", type=int, default=50, metavar="DRAWS", help="the paper's simulation (0: skip)")
    add_threads(parser)
    add_output(parser, "module_fit.jsonl", "JSON lines, one a run, appended")
    args = parser.parse_args(argv)
    use_threads(args)
    start_time = time.perf_counter()
    model, tokenizer = load_model(args.model)
    model.eval()
    ids = token_blocks(tokenizer, load_texts(args.data), args.blocks, args.block_len)
    captured = capture(model, ids)
    is_first = torch.zeros(ids.shape, dtype=torch.bool)
    is_first[:, 0] = True
    is_first = is_first.flatten()
    record = {"commit": commit(), "model": args.model, "data": args.data, "tokens": ids.numel(),
              "max_iter": args.max_iter, **machine(), "results": {}}
    for method in args.methods:
        for start in STARTS:
            rows = [fit_norm(model, info, x, y, is_first, method, start, args.max_iter)
                    for info, x, y in captured.values()]
            record["results"][f"{method}/{start}"] = summary(rows)
            print(f"[module_fit] {method:<5} {start:<10} " + json.dumps(record["results"][f"{method}/{start}"]),
                  flush=True)
    if args.paper:
        record["paper"] = paper(args.methods, args.paper)
        print(f"[module_fit] paper: {json.dumps(record['paper'])}", flush=True)
    record["seconds"] = round(time.perf_counter() - start_time, 1)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
