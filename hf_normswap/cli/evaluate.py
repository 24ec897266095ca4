"""``normswap eval``: perplexity (token, word, byte) and, against the original, the fit-for-use report: KL and top-1
agreement, the tails of the per-token loss, the ratio by position, the repetition check and, with ``--tasks``,
lm-eval tasks on both models; for an encoder, the agreement of its sentence embeddings with the original's."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.loading import load_model, resolve
from ..checkpoint.record import ConversionRecord
from ..data import check_spec
from ..evaluation import finite_json
from ..evaluation.embeddings import evaluate_embeddings
from ..evaluation.perplexity import EvaluationError, check_window
from ..evaluation.fit_for_use import FitSettings, fit_report
from ..evaluation.tasks import MIN_RECOVERY, check_tasks
from ..evaluation.documents import evaluation_texts
from ..model_inputs import is_encoder, text_config
from ..validation import ValidationError, check_data_files, check_number
from ..conversion.evaluation import calibration_overlap, warn
from .common import MODEL_HELP, check_evaluation_args, evaluation_args, placement, placement_args, run_evaluation


def add_parser(commands) -> None:
    ev = commands.add_parser("eval", help="perplexity (token, word, byte) and, with --against, KL / top-1 vs original; "
                                          "for an encoder (no LM head): embedding agreement with --against")
    ev.add_argument("model", help=MODEL_HELP + ", or a converted checkpoint")
    ev.add_argument("--against", metavar="ORIGINAL", help="the original model: adds KL, top-1 agreement, ratios")
    ev.add_argument("--data", default="builtin",
                    help="text to score: builtin (held-out half of the offline corpus), local files, or a Hub "
                         "dataset name[:config[:split]], split defaulting to test (default: %(default)s)")
    ev.add_argument("--calib", metavar="DATA", help="calibration data used for the model: warn if --data overlaps it "
                    "(a converted checkpoint's recorded calibration is checked without this)")
    evaluation_args(ev)
    ev.add_argument("--no-tails", action="store_true",
                    help="with --against, the perplexity table alone: no loss tails, ratio by position or repetition "
                         "check (half the passes); an encoder: no per-sentence tails")
    tasks = ev.add_argument_group("downstream tasks (with --against; needs the extra: pip install "
                                  "'hf-normswap[eval]')")
    tasks.add_argument("--tasks", metavar="NAMES",
                       help="comma-separated lm-eval task names (Hub datasets) and local task YAML files or folders, "
                            "run on both models through lm-eval, each metric with its recovery (--batch-size: lm-eval's). A task folder's "
                            "own Python (lm-eval's `!function`) runs as lm-eval runs it")
    tasks.add_argument("--limit", type=float, help="examples per task, as lm-eval (below 1: a fraction of them)")
    tasks.add_argument("--num-fewshot", type=int, help="few-shot examples, as lm-eval (default: each task's own)")
    tasks.add_argument("--min-recovery", type=float, default=MIN_RECOVERY,
                       help="recovery (converted / original, 1 = no loss) below which a metric is marked "
                            "(default: %(default)s)")
    tasks.add_argument("--trust-remote-code", action="store_true",
                       help="run a task file that lies inside a model's checkpoint folder (its Python runs)")
    placement_args(ev)
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _original_of(model, against):
    """The model generated evaluation text is sampled from: ``--against``, or the model itself when it is an
    original (a converted model's samples would score it on its own text)."""
    if against is not None:
        return against
    return None if ConversionRecord.of(model) is not None else model


def _embedding_evaluation(args, model, tokenizer, against, texts):
    """``eval`` of an encoder (no LM head): agreement of its sentence embeddings with the original's."""
    if against is None:
        raise EvaluationError(f"{args.model} is an encoder ({type(model).__name__}): its embeddings are compared "
                              "with the original's; pass --against ORIGINAL")
    if tokenizer is None:
        raise EvaluationError(f"{args.model} has no tokenizer: sentence embeddings need one")
    if args.stride:
        raise EvaluationError("--stride applies to perplexity windows; an encoder is scored on whole sentences")
    return evaluate_embeddings(model, against, tokenizer, texts, max_tokens=args.max_tokens,
                               max_length=args.max_length, data=args.data)


def _check_same_vocabulary(args, scored, reference) -> None:
    """``--against`` compares the model's outputs with the original's position by position and id by id: both must
    be the same kind of model (an encoder, or one that predicts the next token) reading text into the same ids."""
    (model, tokenizer), (against, against_tokenizer) = scored, reference
    sizes = [getattr(text_config(m), "vocab_size", None) for m in (model, against)]
    if is_encoder(model) != is_encoder(against):
        kinds = ["an encoder" if is_encoder(m) else "a language model" for m in (model, against)]
        difference = f"{args.model} is {kinds[0]}, {args.against} {kinds[1]}"
    elif None not in sizes and sizes[0] != sizes[1]:
        difference = f"{args.model} has a vocabulary of {sizes[0]} tokens, {args.against} of {sizes[1]}"
    elif None not in (tokenizer, against_tokenizer) and tokenizer.get_vocab() != against_tokenizer.get_vocab():
        difference = f"the tokenizers of {args.model} and {args.against} read text into other ids"
    else:
        return
    raise EvaluationError(f"--against names another model: {difference}; name the model's own original")


def _declares_encoder(spec: str) -> bool:
    """Whether a local checkpoint's config names only classes without a language-model head (read before any
    load; a model whose config is not at hand is checked once loaded)."""
    location, extra = resolve(spec)
    config = Path(location) / "config.json"
    if "gguf_file" in extra or not config.is_file():
        return False
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # the load says what is wrong with it
    names = (found.get("architectures") or []) if isinstance(found, dict) else []
    return bool(names) and not found.get("is_encoder_decoder") and not any(
        isinstance(n, str) and ("CausalLM" in n or "LMHead" in n) for n in names)


def _task_request(args):
    """The ``--tasks`` request checked before any model loads; None without ``--tasks``."""
    if args.tasks is None:
        if args.limit is not None or args.num_fewshot is not None:
            raise ValidationError("--limit and --num-fewshot apply to --tasks; name the tasks to run")
        return None
    if not args.against:
        raise ValidationError("--tasks compares the model with its original: pass --against ORIGINAL")
    if args.limit is not None and not args.limit > 0:
        raise ValidationError(f"--limit must be positive (examples per task, or a fraction below 1), got {args.limit:g}")
    if args.num_fewshot is not None:
        check_number(args.num_fewshot, "--num-fewshot", minimum=0)
    check_number(args.min_recovery, "--min-recovery", minimum=0)
    encoder = next((spec for spec in (args.model, args.against) if _declares_encoder(spec)), None)
    if encoder is not None:
        raise EvaluationError(f"--tasks needs language models; {encoder} is an encoder: drop --tasks")
    folders = [Path(resolve(spec)[0]) for spec in (args.model, args.against)]
    return check_tasks(args.tasks, [f for f in folders if f.is_dir()], args.trust_remote_code)


def run(args) -> None:
    check_evaluation_args(args)
    check_data_files(check_spec(args.data), "--data")
    request = _task_request(args)
    where = placement(args)
    model, tokenizer = load_model(args.model, **where)
    against = None
    if args.against:
        against, against_tokenizer = load_model(args.against, **where)
        _check_same_vocabulary(args, (model, tokenizer), (against, against_tokenizer))
    check_window(args.max_length, {args.model: model, **({args.against: against} if against else {})},
                 "--max-length")
    texts = evaluation_texts(args.data, _original_of(model, against), tokenizer, args.max_tokens)
    record = ConversionRecord.of(model)
    warn(calibration_overlap(args.calib, record.calibration if record else None, args.data, texts))
    if is_encoder(model):
        if request is not None:
            raise EvaluationError(f"--tasks needs language models; {args.model} is an encoder: drop --tasks")
        evaluation = _embedding_evaluation(args, model, tokenizer, against, texts)
        evaluation.tails = None if args.no_tails else evaluation.tails
    else:
        evaluation = run_evaluation(args, model, tokenizer, against, args.data, texts)
        if against is not None:
            models = {"original": against, "converted": model}
            settings = FitSettings(context=not args.no_tails, tasks=request, limit=args.limit,
                                   num_fewshot=args.num_fewshot, max_tokens=args.max_tokens,
                                   batch_size=args.batch_size, min_recovery=args.min_recovery)
            evaluation = fit_report(evaluation, models, tokenizer, texts, settings)
    if args.json:
        print(finite_json.dumps(evaluation.to_dict(), indent=2))
    else:
        print(f"{args.model} on {evaluation.describe()}\n{evaluation.table()}")
