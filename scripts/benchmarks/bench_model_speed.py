"""Speed of a converted model against its original, as side-by-side ratios taken in one run.

SmolLM2-135M (packaged GGUF; ``smollm2-random``: its shapes with random weights, where the package is not
installed) and a small GPT-2, batch x 512 tokens: forward tokens/s and training step (forward + loss + backward, no
optimizer) time, original versus converted (a calibrated start, so that finite activations are timed), its eager
fallback and its folded copy, eager and ``torch.compile``. Candidates interleaved, medians (``harness/timing.py``).

    python scripts/benchmarks/bench_model_speed.py --model-reps 7 --train-reps 2
    python scripts/benchmarks/bench_model_speed.py --models smollm2 --batch 16 --model-reps 3 --train-reps 0 --no-compile
    python scripts/benchmarks/bench_model_speed.py --quick            # a smoke run: tiny GPT-2, no compile
    python scripts/benchmarks/bench_model_speed.py --device cuda --models smollm2-random --model-dtype bf16
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

from hf_normswap import METHODS, find_norms, kernels  # internal: kernels, the fused path timed against its fallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_models
from harness.models import MODELS, load, model_variants
from harness.timing import (DTYPES, arguments, device_option, eager, interleaved, log, run_sections, split_list,
                            synchronize)


def probe_forward(model, ids, norm_names: list[str]) -> dict:
    """One untimed forward: the largest |logit| (inf or nan when the conversion overflows, so a broken model shows)
    and the seconds spent inside the norms (or what replaced them), by hooks around each (on a GPU each waits for
    the queued work): the part of the forward that a faster norm can shorten."""
    spent, starts = [], {}

    def before(module, args):
        synchronize()
        starts[module] = time.perf_counter()

    def after(module, args, output):
        synchronize()
        spent.append(time.perf_counter() - starts[module])

    modules = [model.get_submodule(name) for name in norm_names]
    handles = [m.register_forward_pre_hook(before) for m in modules] + [m.register_forward_hook(after) for m in modules]
    try:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        synchronize()
        total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return dict(largest_logit=logits.abs().max().item(), norm_seconds=sum(spent), norm_share=sum(spent) / total)


def model_section(args) -> list[dict]:
    rows = []
    for model_name in args.models:
        start = time.perf_counter()
        original, vocab = load(model_name, args.layers)
        original.to(args.device, DTYPES[args.model_dtype]).config.use_cache = False
        norm_names = [info.name for info in find_norms(original)]
        log(f"{model_name}: loaded in {time.perf_counter() - start:.1f}s")
        torch.manual_seed(1)
        ids = torch.randint(0, vocab, (args.batch, args.seq)).to(args.device)
        tokens = ids.numel()
        for method in args.methods:
            converted, folded = model_variants(original, method, args.model_calib, vocab, args.seq)

            def forward(m):
                return lambda: m(input_ids=ids)

            models = {"original": original, method: converted, f"{method}-eager": converted,
                      f"{method}-folded": folded}
            candidates = {name: eager(forward(model)) if name.endswith("-eager") else forward(model)
                          for name, model in models.items()}
            with torch.no_grad():
                med = interleaved(candidates, args.model_reps)
            probes = {}  # after the timing's warm-up, which compiled the fused kernels
            for name, model in models.items():
                with kernels.fallback() if name.endswith("-eager") else contextlib.nullcontext():
                    probes[name] = probe_forward(model, ids, norm_names)
            log(f"{model_name}: largest |logit|, time inside the {len(norm_names)} norms (share of that forward): "
                + ", ".join(f"{n} {p['largest_logit']:.3g}, {p['norm_seconds'] * 1e3:.0f} ms ({p['norm_share']:.1%})"
                            for n, p in probes.items()))
            forward_rows = _model_rows(model_name, method, "forward", "eager", med, tokens)
            rows += [dict(row, **probes[row["variant"]]) for row in forward_rows]

            def train_step(m):
                m.train()

                def step():
                    out = m(input_ids=ids, labels=ids)
                    out.loss.backward()
                    m.zero_grad(set_to_none=True)
                return step

            if args.train_reps:
                candidates = {"original": train_step(original), method: train_step(converted),
                              f"{method}-eager": eager(train_step(converted))}
                med = interleaved(candidates, args.train_reps)
                rows += _model_rows(model_name, method, "train step", "eager", med, tokens)
                original.eval(), converted.eval()
            if args.compile:
                rows += _compiled_rows(model_name, method, original, converted, ids, args, forward, train_step)
            del converted, folded
    return rows


def _compiled_rows(model_name, method, original, converted, ids, args, forward, train_step) -> list[dict]:
    rows = []
    torch._dynamo.reset()
    compiled = {"original": torch.compile(original), method: torch.compile(converted)}
    with torch.no_grad():
        for name, m in compiled.items():
            start = time.perf_counter()
            m(input_ids=ids)
            log(f"{model_name}: torch.compile {name} forward warm-up {time.perf_counter() - start:.1f}s")
        med = interleaved({n: forward(m) for n, m in compiled.items()}, args.model_reps)
    rows += _model_rows(model_name, method, "forward", "compile", med, ids.numel())
    if args.compile_train:
        for name, m in compiled.items():
            start = time.perf_counter()
            train_step(m)()
            log(f"{model_name}: torch.compile {name} train-step warm-up {time.perf_counter() - start:.1f}s")
        med = interleaved({n: train_step(m) for n, m in compiled.items()}, args.train_reps)
        rows += _model_rows(model_name, method, "train step", "compile", med, ids.numel())
        for m in (original, converted):
            m.eval()
    return rows


def _model_rows(model_name, method, mode, execution, med, tokens) -> list[dict]:
    base = med["original"]
    rows = []
    for name, seconds in med.items():
        rows.append(dict(section="model", model=model_name, method=method, mode=mode, execution=execution,
                         variant=name, ms=seconds * 1e3, tokens_per_s=tokens / seconds, speedup=base / seconds))
    log(f"{model_name} {mode:<10} {execution:<7} " + "  ".join(
        f"{n}={s * 1e3:.0f}ms {tokens / s:.0f}tok/s ({base / s:.3f}x)" for n, s in med.items()))
    return rows


def parse_args(argv=None):
    parser = arguments(__doc__, "tiny GPT-2, few repetitions, no compile")
    add_models(parser, MODELS, "smollm2,gpt2")
    parser.add_argument("--model-dtype", choices=sorted(DTYPES), default="fp32", help="the weights' dtype")
    parser.add_argument("--layers", type=int, default=30, help="smollm2-random: its layers (30, as SmolLM2-135M)")
    parser.add_argument("--methods", default="eln", help=f"comma-separated: {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--model-reps", type=int, default=5)
    parser.add_argument("--train-reps", type=int, default=3, help="0: no training-step rows")
    parser.add_argument("--no-model-calib", dest="model_calib", action="store_false",
                        help="time the analytic conversion (overflows on SmolLM2) instead of a saturating calibrated "
                             "start")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile runs")
    parser.add_argument("--compile-train", action="store_true", help="also time compiled training steps (slow)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.model_reps, args.train_reps, args.compile = "gpt2", 3, 2, False
    args.models, args.methods, args.sections = split_list(args.models), split_list(args.methods), ["model"]
    return device_option(parser, args)


def main(argv=None) -> int:
    return run_sections(__file__, parse_args(argv), {"model": model_section}, argv)


if __name__ == "__main__":
    sys.exit(main())
