"""How far each element-wise module of a checkpoint is from a line, on its own inputs: what linearising loses.

For every element-wise module, its input ``x`` is captured on a forward pass over text blocks, and the module's
output is compared with two lines: the least-squares line ``linearise`` puts in its place (each channel's fit over
ordinary tokens, position 0 left out: ``hf_normswap.linearise``) and the tangent at 0 (the module's value and slope
at ``x = 0``). Reported per module: the relative error ``||line(x) - module(x)|| / ||module(x)||`` of each line on
ordinary tokens and on position 0 (the attention sink), position 0's input RMS against the others', and the error
at position 0 once it has one scale of its own (the least-squares factor on the line's slope, as a ``linear``
module's ``log_first`` gives it).

    python scripts/analyses/line_error.py OUT/runs/RUN/final --data $WIKITEXT/wiki.valid.tokens --out lines.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hf_normswap import ElementwiseNorm, load_model
# internal: the line linearise fits, --data read as normswap reads it
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.data import load_texts, token_blocks
from hf_normswap.linearise import LineStatistics, fitted_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_output, add_text_blocks, add_threads, script_parser, use_threads
from harness.record import commit, machine


def tangent(module: ElementwiseNorm, x: torch.Tensor) -> torch.Tensor:
    """The module's tangent at 0 applied to ``x``: ``weight * (f(0) + f'(0) x) + bias``."""
    zero = torch.zeros(module.normalized_shape, dtype=torch.float64)
    shape = module.shape_parameter().detach().double().expand_as(zero)
    value, slope, *_ = type(module).grads(zero, shape, *(e.detach().double() for e in module.extras()))
    y = module.weight.double() * (value + slope * x)
    return y + module.bias.double() if module.bias is not None else y


def relative(predicted: torch.Tensor, target: torch.Tensor) -> float:
    return float((predicted - target).norm() / target.norm().clamp_min(1e-30))


@torch.no_grad()
def line_errors(model, ids: torch.Tensor) -> dict[str, dict]:
    """``{module: {line, tangent, line_first, tangent_first, line_first_own, rms, rms_first}}``."""
    kinds = {name: entry.kind for name, entry in ConversionRecord.of(model).converted.items()}
    modules = {n: m for n, m in model.named_modules() if isinstance(m, ElementwiseNorm)}
    seen: dict[str, list] = {name: [] for name in modules}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: seen[n].append((a[0].double(), o.double())))
               for n, m in modules.items()]
    for row in ids:
        model(input_ids=row[None])
    for handle in handles:
        handle.remove()
    errors = {}
    for name, module in modules.items():
        x, y = (torch.cat([pair[i] for pair in seen[name]]) for i in (0, 1))
        stats = LineStatistics()
        stats.add(module, kinds[name], x, y)
        line = fitted_line(module, kinds[name], stats).double()
        fit, touch = line(x), tangent(module, x)
        bias = line.bias if line.bias is not None else 0
        slope_part, rest = fit[:, 0] - bias, y[:, 0] - bias  # position 0's scale: the factor on the slope part
        own = float((slope_part * rest).sum() / (slope_part * slope_part).sum().clamp_min(1e-30))
        errors[name] = {"line": relative(fit[:, 1:], y[:, 1:]), "tangent": relative(touch[:, 1:], y[:, 1:]),
                        "line_first": relative(fit[:, 0], y[:, 0]), "tangent_first": relative(touch[:, 0], y[:, 0]),
                        "line_first_own": relative(own * slope_part + bias, y[:, 0]),
                        "rms": float(x[:, 1:].pow(2).mean().sqrt()), "rms_first": float(x[:, 0].pow(2).mean().sqrt())}
    return errors


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("checkpoints", nargs="+", help="converted checkpoints (hf_normswap.save_pretrained)")
    add_text_blocks(parser, "text to run (e.g. WikiText-2 validation)", blocks=2)
    add_threads(parser)
    add_output(parser, None, "JSON lines, one a checkpoint, appended")
    args = parser.parse_args(argv)
    use_threads(args)
    for checkpoint in args.checkpoints:
        model, tokenizer = load_model(checkpoint, dtype=torch.float32)
        ids = token_blocks(tokenizer, load_texts(args.data, "evaluation"), args.blocks, args.block_len)
        errors = line_errors(model.eval(), ids)
        print(f"{checkpoint}:\n  {'module':45s} {'line':>7s} {'tangent':>8s} | position 0: {'rms':>6s} {'line':>7s} "
              f"{'tangent':>8s} {'own':>6s}")
        for name, e in errors.items():
            print(f"  {name:45s} {e['line']:7.3f} {e['tangent']:8.3f} | {e['rms_first'] / e['rms']:9.1f}x "
                  f"{e['line_first']:7.2f} {e['tangent_first']:8.2f} {e['line_first_own']:6.3f}")
        if args.out:
            with open(args.out, "a") as stream:
                stream.write(json.dumps({"checkpoint": checkpoint, "modules": errors, "tokens": ids.numel(),
                                         "commit": commit(), **machine()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
