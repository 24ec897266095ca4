"""``normswap convert``: the flags (and ``--config job.yaml`` beneath them) mapped onto one conversion job, which
``hf_normswap.conversion.run_job`` checks and runs."""

from __future__ import annotations

from ..conversion.job import ConversionJob, read_job
from ..conversion.run import run_job
from ..modules import METHODS
from ..settings import check_values
from ..surgery import split_roles
from .calibration_flags import calibration_args
from .common import MODEL_HELP, evaluation_args, placement_args, selection_args

DEFAULTS = ConversionJob()


def add_parser(commands) -> None:
    conv = commands.add_parser("convert", help=f"replace norms with an element-wise method ({', '.join(METHODS)})")
    conv.add_argument("model", nargs="?", help=MODEL_HELP)
    conv.add_argument("--config", metavar="JOB.yaml", help="the job's settings from a YAML file (the keys of "
                      "hf_normswap.conversion.ConversionJob); flags given beside it win")
    conv.add_argument("--to", choices=sorted(METHODS), type=str.lower, help="element-wise method")
    flag = conv.add_argument
    flag("--per-channel", action="store_true", default=None, help="one alpha/beta per channel instead of per module")
    flag("--input-scale", type=float, help="with --calib none: typical input RMS for the analytic start (default: "
                                           "each norm's own, measured in one forward pass on random token ids)")
    flag("--no-check", action="store_false", dest="check", default=None,
         help="skip the check after converting (original and converted scored on a small slice; a warning when the "
              "converted model is far off)")
    flag("--fold", action="store_true", default=None,
         help="for inference: fold each norm's weight and bias into the linear layers it feeds (q/k/v, gate/up), "
              "leaving a bare element-wise function; norms feeding anything else skip")
    flag("--output", help="directory to save the converted checkpoint to (written atomically)")
    flag("--overwrite", action="store_true", default=None, help="replace --output when it exists and is not empty")
    flag("--push-to-hub", metavar="REPO", help="push the checkpoint to this Hub repo (NAME or OWNER/NAME)")
    flag("--private", action="store_true", default=None, help="with --push-to-hub: create the repo private")
    flag("--report", help="write the conversion report as JSON to this file")
    flag("--max-host-memory", metavar="SIZE",
         help="host memory the conversion may use, e.g. 16GB: weights beyond what fits stay on disk and calibration "
              "brings one block in at a time, without its end-to-end steps (default: the memory this machine has "
              "free). It bounds the weights and calibration's buffers; the interpreter, torch and transformers come "
              "on top")
    placement_args(conv, given_only=True)
    calibration_args(conv)
    selection_args(conv, given_only=True)
    flag("--eval", metavar="DATA", dest="eval_data",
         help="after converting, evaluate against the original on DATA (same forms as `eval --data`) and print the "
              "side-by-side table; it is stored in config.json and the model card")
    evaluation_args(conv, prefix="eval-", given_only=True)
    budget = conv.add_argument_group("quality budget (convert the largest greedy subset within it; see `normswap "
                                     "sensitivity`)").add_mutually_exclusive_group()
    budget.add_argument("--budget-kl", type=float, metavar="X", help="KL(original || converted) at most X nats/token")
    budget.add_argument("--budget-ppl-ratio", type=float, metavar="R", help="perplexity at most R times the original's")
    budget.add_argument("--budget-cosine", type=float, metavar="C", help="encoders: mean embedding cosine at least C")
    flag("--budget-data", help=f"text the budget is measured on (default: {DEFAULTS.budget.data}, the evaluation half)")
    flag("--max-saturation", type=float,
         help="--to linear on a converted checkpoint: linearise each element-wise module saturating on at most this "
              f"share of its inputs (measured on --calib, default builtin); keep the rest "
              f"(default: {DEFAULTS.max_saturation})")
    flag("--stock", action="store_true", default=None,
         help="save --output as the original architecture, loadable without remote code or this package (every "
              "norm must be linear, position 0 at the common scale: after recovery)")


def job_settings(args) -> dict:
    """The flags given, as the job's nested settings; a flag left out sets nothing (the file's or the default)."""
    roles = None if args.roles is None else list(split_roles(args.roles))
    settings = {
        "model": args.model, "to": args.to, "per_channel": args.per_channel, "input_scale": args.input_scale,
        "fold": args.fold, "check": args.check, "max_host_memory": args.max_host_memory, "device": args.device,
        "dtype": args.dtype, "max_saturation": args.max_saturation,
        "selection": {"roles": roles, "include": args.include, "exclude": args.exclude},
        "calibration": {"data": args.calib, "num_blocks": args.calib_blocks, "block_len": args.calib_len,
                        "strategy": args.strategy, "max_tokens_per_norm": args.max_tokens_per_norm,
                        "plots": args.plots, "precision": args.precision, "block_weights_lr": args.block_weights_lr,
                        "block_steps": args.block_steps, "block_rows": args.block_rows,
                        "device": args.calib_device, "cache_memory_mb": args.calib_cache_mb},
        "budget": {"kl": args.budget_kl, "ppl_ratio": args.budget_ppl_ratio, "cosine": args.budget_cosine,
                   "data": args.budget_data},
        "evaluation": {"data": args.eval_data, "max_length": args.eval_max_length, "stride": args.eval_stride,
                       "max_tokens": args.eval_max_tokens, "batch_size": args.eval_batch_size},
        "output": {"directory": args.output, "overwrite": args.overwrite, "push_to_hub": args.push_to_hub,
                   "private": args.private, "report": args.report, "stock": args.stock},
    }
    return {key: {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value
            for key, value in settings.items() if value is not None}


FLAG_OF = {"model": "MODEL", "eval_data": "--eval"}  # where a flag's name is not its destination's


def check_flag_values(args) -> None:
    """A ``${...}`` in a flag refused by the flag's own name, before the job's reader sees the value."""
    for dest, value in vars(args).items():
        if isinstance(value, str):
            check_values(value, FLAG_OF.get(dest, "--" + dest.replace("_", "-")))


def run(args) -> None:
    check_flag_values(args)
    settings = job_settings(args)
    job = read_job(settings, config_file=args.config)
    run_job(job)
