"""``normswap convert``'s two ``linear`` paths: linearising a model converted already (``--to linear`` on a DyT /
ELN checkpoint, ``linearise.py``) and saving as the original architecture (``--stock``, ``stock_export.py``)."""

from __future__ import annotations

from ..checkpoint.stock_export import export_stock
from ..surgery import ConversionError
from ..data import model_batches
from ..linearise import linearise
from ..modules import ElementwiseNorm

LINEARISE_BLOCKS, LINEARISE_LEN = 8, 256  # the text the saturation is measured on, without --calib-blocks / -len


def add_args(parser) -> None:
    parser.add_argument("--max-saturation", type=float, default=0.01,
                        help="--to linear on a converted checkpoint: linearise each element-wise module saturating "
                             "on at most this share of its inputs (measured on --calib, default builtin); keep the "
                             "rest")
    parser.add_argument("--stock", action="store_true",
                        help="save --output as the original architecture, loadable without remote code or this "
                             "package (every norm must be linear, position 0 at the common scale: after recovery)")


def check_args(args) -> None:
    """One line for a combination that cannot work, before anything loads."""
    if not 0 <= args.max_saturation <= 1:
        raise ConversionError(f"--max-saturation must be between 0 and 1, got {args.max_saturation}")
    if args.stock and (args.to != "linear" or not args.output or args.push_to_hub or args.fold):
        raise ConversionError("--stock saves a linear model to --output: use it with --to linear and --output, "
                              "without --push-to-hub or --fold")


def is_converted(model) -> bool:
    return any(isinstance(module, ElementwiseNorm) for module in model.modules())


def linearise_converted(args, model, tokenizer) -> None:
    """Linearise a converted model on the saturation measured over ``--calib`` text (default builtin)."""
    spec = args.calib if args.calib and args.calib != "none" else "builtin"
    batches, _ = model_batches(model, spec, tokenizer, num_blocks=args.calib_blocks or LINEARISE_BLOCKS,
                               block_len=args.calib_len or LINEARISE_LEN, batch_size=4)
    print(linearise(model, batches, args.max_saturation))


def save_stock(args, model, tokenizer) -> None:
    directory, eps, difference = export_stock(model, args.output, tokenizer=tokenizer, overwrite=args.overwrite)
    print(f"saved to {directory} as its original architecture: epsilon {eps:.0e}, logits within {difference:.1e} "
          "of the linear model's")
