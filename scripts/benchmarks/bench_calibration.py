"""Calibration benchmark for BENCHMARKS.md: one (model, method, strategy) per process, so peak memory is its own.

SmolLM2 (causal LM): WikiText-2 test perplexity of the original and the calibrated model over the same
non-overlapping windows (``hf_normswap.evaluation.perplexity.evaluate``, lm-eval conventions), plus KL(original || converted)
and top-1 agreement, after calibrating on WikiText-2 *validation* text. MiniLM (sentence encoder): mean cosine
similarity of mean-pooled sentence embeddings of the converted model to the original's, on WikiText-2 test lines.
Appends one JSON line per run to ``--out``.

``--exact-at first`` / ``--exact-at rest`` (repeatable) asks where the conversion loses: a copy of the calibrated
model is scored beside it (same windows, one pass of the original) with every converted module's output replaced by
the original norm's output on the same input at the first position of each sequence (``first``: the attention sink,
BERT's [CLS]) or at every other position (``rest``).

    python scripts/benchmarks/bench_calibration.py --model offline:smollm2 --to eln --out /tmp/calib.jsonl  # auto: block
    python scripts/benchmarks/bench_calibration.py --model offline:minilm --to eln --strategy kl --out /tmp/calib.jsonl

The text comes from ``--calib`` and ``--eval`` (any ``hf_normswap.data`` spec), by default from ``$WIKITEXT``, a
directory holding WikiText-2's ``wiki.valid.tokens`` and ``wiki.test.raw`` (what BENCHMARKS.md's rows used).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

from hf_normswap import CalibrationConfig, METHODS, convert, load_model
# internal: the strategies, precisions and reading of --calib the CLI offers, so that a row measures what a flag sets
from hf_normswap.calibration.calibrate import DEFAULT_STRATEGY, STRATEGIES
from hf_normswap.data import load_texts
from hf_normswap.precision import PRECISIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_model, add_output, add_threads, script_parser, use_threads
from harness.memory import peak_rss_mb
from harness.record import machine


WIKITEXT = os.environ.get("WIKITEXT")  # a directory with WikiText-2's files, when the data are not named


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sentence_similarity(original, models: dict, tokenizer, texts: list[str], count: int) -> dict[str, float]:
    """Mean cosine similarity of each model's mean-pooled last hidden states (sentence-transformers' pooling for
    MiniLM) to the original's, on the same sentences."""
    lines = [t.strip() for text in texts for t in text.split("\n") if len(t.split()) >= 5 and not t.strip().startswith("=")]
    lines = lines[:count]
    sims = {name: [] for name in models}

    def pooled(model, enc, mask):
        return (model(**enc).last_hidden_state * mask).sum(1) / mask.sum(1)

    with torch.no_grad():
        for start in range(0, len(lines), 32):
            enc = tokenizer(lines[start:start + 32], padding=True, truncation=True, max_length=256, return_tensors="pt")
            mask = enc["attention_mask"].unsqueeze(-1).float()
            reference = pooled(original, enc, mask)
            for name, model in models.items():
                sims[name].append(torch.nn.functional.cosine_similarity(reference, pooled(model, enc, mask), dim=-1))
    return {name: float(torch.cat(values).mean()) for name, values in sims.items()}


POSITIONS = {"first": slice(0, 1), "rest": slice(1, None)}


def keep_original_at(converted, original, names: list[str], positions: slice) -> list:
    """Forward hooks that put the original norm's output back at ``positions`` (along the sequence) of every
    converted module; returns the handles. The element-wise modules still compute all other positions."""
    def hook(source):
        def splice(module, args, out):
            out = out.clone()
            out[:, positions] = source(args[0])[:, positions]
            return out
        return splice

    return [converted.get_submodule(name).register_forward_hook(hook(original.get_submodule(name))) for name in names]


def score(models: dict, original, tokenizer, texts: list[str], args) -> dict[str, dict]:
    """Per model, against the original on the same data (which is run once): MiniLM, mean cosine similarity of
    sentence embeddings; SmolLM2, perplexities, KL and top-1 agreement."""
    if "minilm" in args.model:
        sims = sentence_similarity(original, models, tokenizer, texts, args.sentences)
        return {name: {"mean_cosine_similarity": sim, "sentences": args.sentences} for name, sim in sims.items()}
    from hf_normswap import PerplexitySettings, evaluate

    result = evaluate(models, tokenizer, texts, against=original, settings=PerplexitySettings(
        max_length=args.eval_len, max_tokens=args.max_eval_tokens, batch_size=4, progress=False))
    return {name: {"ppl_original": result.results["original"].token_perplexity,
                   "ppl_converted": result.results[name].token_perplexity,
                   "kl": result.kl[name], "top1": result.top1[name],
                   "eval_tokens": result.results["original"].tokens, "eval_len": args.eval_len}
            for name in models}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_model(parser)
    parser.add_argument("--to", default="eln", choices=(*METHODS, "none"))
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=[DEFAULT_STRATEGY, *STRATEGIES])
    parser.add_argument("--tune-steps", type=int, default=None, help="override the strategy's end-to-end steps")
    parser.add_argument("--block-steps", type=int, default=None, help="override the strategy's per-block steps")
    parser.add_argument("--tune-blocks", type=int, default=None, help="override the strategy's tuning sequences")
    parser.add_argument("--block-rows", type=int, default=None,
                        help="sequences per block-tuning step (default: the strategy's)")
    parser.add_argument("--block-weights-lr", type=float, default=None,
                        help="> 0: block-wise reconstruction, the blocks' weights fitted at this rate; 0: the norms "
                             "alone (default: the strategy's)")
    parser.add_argument("--precision", default=CalibrationConfig.precision, choices=PRECISIONS)
    parser.add_argument("--cache-memory-mb", type=float, default=None,
                        help="the block pass's cached hidden states in CPU memory up to this, the rest on disk "
                             "(default: no limit)")
    parser.add_argument("--exact-at", choices=sorted(POSITIONS), action="append", default=[],
                        help="also score with the original norms' outputs at these positions (repeatable)")
    parser.add_argument("--calib", default=WIKITEXT and str(Path(WIKITEXT) / "wiki.valid.tokens"),
                        required=not WIKITEXT, help="calibration text (default: $WIKITEXT/wiki.valid.tokens)")
    parser.add_argument("--calib-blocks", type=int, default=64)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--eval", default=WIKITEXT and str(Path(WIKITEXT) / "wiki.test.raw"),
                        required=not WIKITEXT, help="evaluation text (default: $WIKITEXT/wiki.test.raw)")
    parser.add_argument("--eval-len", type=int, default=512, help="perplexity window (non-overlapping)")
    parser.add_argument("--max-eval-tokens", type=int, default=8192)
    parser.add_argument("--sentences", type=int, default=512, help="MiniLM: sentences compared")
    add_threads(parser, 2)
    add_output(parser, "/tmp/calibration_bench.jsonl", "JSON lines, one a run, appended")
    args = parser.parse_args(argv)
    if args.exact_at and args.to == "none":
        parser.error("--exact-at compares converted modules with the original norms: give a method to --to")
    use_threads(args)

    model, tokenizer = load_model(args.model)
    original = copy.deepcopy(model)
    record = {"model": args.model, "to": args.to, "strategy": args.strategy,
              "block_steps": args.block_steps, "tune_steps": args.tune_steps, "block_rows": args.block_rows,
              "block_weights_lr": args.block_weights_lr, "precision": args.precision,
              "cache_memory_mb": args.cache_memory_mb, **machine(),
              "calib": args.calib, "calib_blocks": args.calib_blocks, "calib_len": args.calib_len}
    rss_before = rss_mb()
    if args.to != "none":
        config = CalibrationConfig(data=args.calib, num_blocks=args.calib_blocks, block_len=args.calib_len,
                                   strategy=args.strategy, tune_steps=args.tune_steps, tune_blocks=args.tune_blocks,
                                   block_steps=args.block_steps, block_rows=args.block_rows,
                                   block_weights_lr=args.block_weights_lr, precision=args.precision,
                                   cache_memory_mb=args.cache_memory_mb, tokenizer=tokenizer)
        start, cpu_start = time.perf_counter(), time.process_time()
        report = convert(model, args.to, calibration=config)
        record["calibration_seconds"] = round(time.perf_counter() - start, 1)
        record["calibration_cpu_seconds"] = round(time.process_time() - cpu_start, 1)  # all threads
        record["calibration"] = report.calibration
        record["mode"] = report.calibration["mode"]
        record["norms_converted"] = len(report.converted)
        record["worst_rel_error"] = max(c.fit["stats"]["rel_error"] for c in report.converted)
    record["rss_before_calibration_mb"] = round(rss_before, 1)
    record["peak_rss_mb"] = round(peak_rss_mb(), 1)

    texts = load_texts(args.eval, "evaluation")
    models = {"converted": model}
    for where in args.exact_at:  # --to names a method here
        models[f"exact_at_{where}"] = spliced = copy.deepcopy(model)
        keep_original_at(spliced, original, [c.name for c in report.converted], POSITIONS[where])
    start = time.perf_counter()
    scores = score(models, original, tokenizer, texts, args)
    record.update(scores.pop("converted"), **scores)
    record["eval_seconds"] = round(time.perf_counter() - start, 1)  # all variants together
    print(json.dumps({k: v for k, v in record.items() if k != "calibration"}, indent=1))
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
