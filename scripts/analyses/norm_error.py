"""Each converted module's distance from the norm it replaced, on the converted model's own activations.

For every module a checkpoint converted, its input ``x`` is captured on a forward pass of the converted model over
text blocks; the original model's norm of the same name is applied to the same ``x``. Reported per norm: the relative
error ``||new(x) - norm(x)|| / ||norm(x)||`` over ordinary tokens (first positions, the attention sink, apart) and
the share of saturated elements (``|f(x)| > 0.95``, calibration's ``sat.`` column), and the error left once each
channel of the module's output is rescaled by its least-squares factor toward the norm's (``rel_error_rescaled``).
A per-channel factor is what the module's ``gamma`` or the next linear layer absorbs in training, so the rescaled
error is the part of the gap that weights cannot close; the plain one also counts a channel scale that they can.
Comparing a run's calibrated start with its trained checkpoint shows which norms' error training brought down.

    python scripts/analyses/norm_error.py OUT/runs/RUN/calibrated OUT/runs/RUN/final --against offline:smollm2 \\
        --data $WIKITEXT/wiki.test.raw --out norm_error.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hf_normswap import ElementwiseNorm, load_model
# internal: the saturation calibration measures, --data read as normswap reads it
from hf_normswap.calibration.fitting import SATURATION, squash_share
from hf_normswap.data import load_texts, token_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, add_text_blocks, add_threads, script_parser, use_threads
from harness.record import commit, machine


@torch.no_grad()
def norm_errors(model, original, ids: torch.Tensor) -> dict[str, dict]:
    """``{norm: {rel_error, rel_error_first, rel_error_rescaled, saturation}}`` for every converted module of
    ``model``."""
    stats: dict[str, dict] = {}

    def hook(name):
        def capture(module, args, output):
            x = args[0]
            target = original.get_submodule(name)(x).float()
            diff = output.float() - target
            total = stats.setdefault(name, {"diff": [0.0, 0.0], "norm": [0.0, 0.0], "sat": [], "channels": 0})
            for i, rows in enumerate((slice(1, None), slice(0, 1))):  # ordinary tokens, then the first position
                total["diff"][i] += float(diff[:, rows].pow(2).sum())
                total["norm"][i] += float(target[:, rows].pow(2).sum())
            new, old = (t[:, 1:].flatten(0, -2).double() for t in (output, target))  # per channel, in fp64
            total["channels"] = total["channels"] + torch.stack([new * old, new * new, old * old]).sum(1)
            total["sat"].append(float((squash_share(module, x).abs() > SATURATION).double().mean()))
        return capture

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, ElementwiseNorm)]
    for row in ids:
        model(input_ids=row[None])
    for handle in handles:
        handle.remove()
    return {name: {"rel_error": (s["diff"][0] / s["norm"][0]) ** 0.5,
                   "rel_error_first": (s["diff"][1] / s["norm"][1]) ** 0.5,
                   "rel_error_rescaled": rescaled_error(*s["channels"]),
                   "saturation": sum(s["sat"]) / len(s["sat"])} for name, s in stats.items()}


def rescaled_error(cross: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> float:
    """``min over a of ||old - a * new|| / ||old||``, ``a`` one factor a channel, from the per-channel sums of
    ``new * old``, ``new^2`` and ``old^2``."""
    left = old - cross.pow(2) / new.clamp_min(1e-30)
    return float((left.clamp_min(0).sum() / old.sum()) ** 0.5)


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("checkpoints", nargs="+", help="converted checkpoints (hf_normswap.save_pretrained)")
    parser.add_argument("--against", required=True, help="the original model")
    add_text_blocks(parser, "text to run (e.g. WikiText-2 test)")
    add_threads(parser)
    add_output(parser, None, "JSON lines, one a checkpoint, appended")
    args = parser.parse_args(argv)
    use_threads(args)
    original, tokenizer = load_model(args.against, dtype=torch.float32)  # a GGUF original refuses .float()
    ids = token_blocks(tokenizer, load_texts(args.data, "evaluation"), args.blocks, args.block_len)
    for checkpoint in args.checkpoints:
        model, _ = load_model(checkpoint, dtype=torch.float32, with_tokenizer=False)
        errors = norm_errors(model.eval(), original.eval(), ids)
        mean = {key: sum(e[key] for e in errors.values()) / len(errors)
                for key in ("rel_error", "rel_error_rescaled", "saturation")}
        print(f"{checkpoint}: mean rel. error {mean['rel_error']:.4g} ({mean['rel_error_rescaled']:.4g} rescaled), "
              f"saturated {mean['saturation']:.2%}")
        print(f"  {'norm':45s} {'error':>8s} {'first':>8s} {'rescaled':>8s} {'sat.':>7s}")
        for name, e in errors.items():
            print(f"  {name:45s} {e['rel_error']:8.4f} {e['rel_error_first']:8.4f} {e['rel_error_rescaled']:8.4f} "
                  f"{e['saturation']:7.2%}")
        if args.out:
            with open(args.out, "a") as stream:
                stream.write(json.dumps({"checkpoint": checkpoint, "norms": errors, "mean": mean, "tokens": ids.numel(),
                                         "commit": commit(), **machine()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
