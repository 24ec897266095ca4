"""Where a converted model's error grows with position: for every layer, the relative error of its hidden state
to the original's and both models' residual RMS, by position range, and each converted module's saturated share by
range, beside the perplexity ratio by range.

A residual stream that grows with position (nothing bounds it without a norm) shows as the converted model's RMS
pulling away from the original's at later ranges; an error that is flat with position while the loss ratio grows
points instead at what the context is used for (the original's loss falls with context; the converted model's
does not follow).

    python scripts/analyses/position_error.py OUT/runs/RUN/final --against offline:smollm2 \\
        --data $WIKITEXT/wiki.test.raw --blocks 2 --block-len 2048 --out positions.jsonl
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


def ranges(length: int) -> list[tuple[int, int]]:
    """1-128, 128-512, then doublings up to ``length`` (position 0, the sink, apart)."""
    edges = [1, 128, 512]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    edges = [e for e in edges if e < length] + [length]
    return list(zip(edges, edges[1:]))


@torch.no_grad()
def position_errors(model, original, ids: torch.Tensor) -> dict:
    """``{ranges, layers: [{error, rms, rms_original}], saturation: {module: [...]}, ratio: [...]}``, each list
    one value a range."""
    spans = ranges(ids.shape[1])
    saturated: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: saturated.setdefault(n, []).append(
        (squash_share(m, a[0]).abs() > SATURATION).double().mean(-1)[0])) for n, m in model.named_modules()
        if isinstance(m, ElementwiseNorm)]
    ours = [model(input_ids=row[None], output_hidden_states=True) for row in ids]
    for handle in handles:
        handle.remove()
    theirs = [original(input_ids=row[None], output_hidden_states=True) for row in ids]

    def cut(outputs, layer, a, b):
        return torch.cat([o.hidden_states[layer][0, a:b] for o in outputs]).double()

    layers = []
    for layer in range(len(ours[0].hidden_states)):
        pairs = [(cut(ours, layer, a, b), cut(theirs, layer, a, b)) for a, b in spans]
        layers.append({"error": [float((h - g).norm() / g.norm()) for h, g in pairs],
                       "rms": [float(h.pow(2).mean().sqrt()) for h, _ in pairs],
                       "rms_original": [float(g.pow(2).mean().sqrt()) for _, g in pairs]})

    def mean_loss(outputs, a, b):
        return sum(float(torch.nn.functional.cross_entropy(o.logits[0, a - 1:b - 1].double(), row[a:b]))
                   for o, row in zip(outputs, ids)) / len(ids)

    ratio = [float(torch.tensor(mean_loss(ours, a, b) - mean_loss(theirs, a, b)).exp()) for a, b in spans]
    return {"ranges": spans, "layers": layers, "ratio": ratio,
            "saturation": {n: [float(torch.stack(v)[:, a:b].mean()) for a, b in spans] for n, v in saturated.items()}}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("checkpoint", help="a converted checkpoint (hf_normswap.save_pretrained)")
    parser.add_argument("--against", required=True, help="the original model")
    add_text_blocks(parser, "text to run (e.g. WikiText-2 test)", blocks=2, block_len=2048)
    add_threads(parser)
    add_output(parser, None, "JSON lines, appended")
    args = parser.parse_args(argv)
    use_threads(args)
    original, tokenizer = load_model(args.against, dtype=torch.float32)  # a GGUF original refuses .float()
    model, _ = load_model(args.checkpoint, dtype=torch.float32, with_tokenizer=False)
    ids = token_blocks(tokenizer, load_texts(args.data, "evaluation"), args.blocks, args.block_len)
    found = position_errors(model.eval(), original.eval(), ids)
    print("positions     " + " ".join(f"{a:>5d}-{b:<5d}" for a, b in found["ranges"]))
    print("ppl ratio     " + " ".join(f"{r:11.3f}" for r in found["ratio"]))
    for layer, row in enumerate(found["layers"]):
        print(f"layer {layer:3d} err " + " ".join(f"{e:11.3f}" for e in row["error"]) + "   rms "
              + " ".join(f"{r:.1f}/{o:.1f}" for r, o in zip(row["rms"], row["rms_original"])))
    if args.out:
        with open(args.out, "a") as stream:
            stream.write(json.dumps({"checkpoint": args.checkpoint, **found, "tokens": ids.numel(),
                                     "commit": commit(), **machine()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
