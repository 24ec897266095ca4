"""Which attention heads of a converted model stop attending as the original does, and where: for every layer and
head, the total-variation distance between the two models' attention rows by query position range, and each head's
induction score on a repeated passage (the attention a token of a later copy pays to the token after its own
earlier occurrence, the head that copies), for both models.

A converted model whose loss ratio grows with position while its residual stream does not (``position_error.py``)
has lost some use of its context: the heads whose distance grows with position, and the original's induction heads
that the converted model no longer has, say which. ``--restore ROLE...`` puts the original's norms back at the
converted norms of those roles first (``attention_input``, ``mlp_input``, ``final``, ...): which norms' conversion
costs the copying; with ``--restore-first``, at the first position alone (the attention sink's token).

    python scripts/analyses/attention_agreement.py OUT/runs/RUN/final --against offline:smollm2 \\
        --data $WIKITEXT/wiki.test.raw --block-len 2048 --period 256 --out attention.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hf_normswap import load_model
# internal: the converted norms' roles read from the record, a module swapped as convert swaps it, --data read as
# normswap reads it
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.discovery.roles import ROLES
from hf_normswap.modules import replace_module
from hf_normswap.data import load_texts, token_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from analyses.position_error import ranges
from harness.flags import add_output, add_text_blocks, add_threads, script_parser, use_threads
from harness.record import commit, machine

TOP_HEADS = 10  # the original's strongest induction heads listed


class FirstFromOriginal(torch.nn.Module):
    """The converted norm at every position but the first, which the original's norm gives."""

    def __init__(self, converted: torch.nn.Module, original: torch.nn.Module):
        super().__init__()
        self.converted, self.original = converted, original

    def forward(self, x):
        out = self.converted(x).clone()
        out[:, :1] = self.original(x[:, :1]).to(out.dtype)
        return out


def restore(model, original, roles: list[str], first_only: bool = False) -> list[str]:
    """Put the original's norm back at each of ``model``'s converted norms of ``roles`` (an unfolded conversion:
    its consumers still expect the norm's scale), at every position or at the first alone; the names restored."""
    record = ConversionRecord.of(model)
    if record is None:
        raise SystemExit(f"--restore: {model.config.name_or_path} is not a converted checkpoint")
    if record.folded:
        raise SystemExit("--restore: the checkpoint is folded (its norms' weights moved into their consumers); "
                         "restore on an unfolded one")
    names = [name for name, entry in record.converted.items() if entry.role in roles]
    if not names:
        raise SystemExit(f"--restore {' '.join(roles)}: no converted norm has that role (roles here: "
                         f"{', '.join(sorted({e.role for e in record.converted.values()}))})")
    for name in names:
        back = original.get_submodule(name)
        replace_module(model, name, FirstFromOriginal(model.get_submodule(name), back) if first_only else back)
    return names


def attention_rows(model, ids: torch.Tensor, query_stride: int) -> list[torch.Tensor]:
    """Every layer's attention weights (heads, sampled queries, keys) on one sequence, each ``query_stride``-th
    query kept (eager attention: the weights exist only there; a copy, so that the whole matrix is not held)."""
    model.set_attn_implementation("eager")
    found = []
    layers = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    handles = [m.register_forward_hook(lambda m, a, o: found.append(o[1][0, :, ::query_stride].float().clone()))
               for m in layers]
    try:
        with torch.no_grad():
            model(input_ids=ids[None])
    finally:
        for handle in handles:
            handle.remove()
    if len(found) != len(layers) or not layers:
        raise SystemExit(f"{type(model).__name__}: no attention weights from its self_attn modules")
    return found


def distances(ours: list[torch.Tensor], theirs: list[torch.Tensor], spans, query_stride: int) -> list:
    """Per layer and head, the mean total-variation distance (half the L1 distance, 0 to 1) between the rows, one
    value a query range."""
    queries = torch.arange(0, ours[0].shape[1]) * query_stride
    table = []
    for a, b in zip(ours, theirs):
        tv = 0.5 * (a - b).abs().sum(-1)  # heads x sampled queries
        table.append([[float(tv[h, (queries >= s) & (queries < e)].mean()) for s, e in spans]
                      for h in range(tv.shape[0])])
    return table


def induction_scores(rows: list[torch.Tensor], period: int, query_stride: int) -> list[list[float]]:
    """Per layer and head: the mean attention a query in a later copy of a ``period``-token passage pays to the
    key one past its earlier occurrence (query ``i``, key ``i - period + 1``)."""
    queries = torch.arange(0, rows[0].shape[1]) * query_stride
    later = queries >= period
    keys = queries[later] - period + 1
    return [[float(layer[h, later].gather(-1, keys[:, None]).mean()) for h in range(layer.shape[0])]
            for layer in rows]


def repeated(ids: torch.Tensor, period: int) -> torch.Tensor:
    """The sequence's first ``period`` tokens repeated to its length."""
    return ids[:period].repeat(-(-len(ids) // period))[:len(ids)]


def agreement(model, original, ids: torch.Tensor, period: int, query_stride: int) -> dict:
    """``{ranges, distance: [layer][head][range], induction: {original, converted}: [layer][head]}``."""
    spans = ranges(len(ids))  # from position 1: position 0 attends to itself alone
    distance = distances(attention_rows(model, ids, query_stride), attention_rows(original, ids, query_stride),
                         spans, query_stride)
    loop = repeated(ids, period)
    induction = {name: induction_scores(attention_rows(m, loop, query_stride), period, query_stride)
                 for name, m in (("original", original), ("converted", model))}
    return {"ranges": spans, "distance": distance, "induction": induction, "period": period,
            "query_stride": query_stride}


def report(found: dict) -> None:
    spans = found["ranges"]
    print("mean TV distance by query range (heads averaged; max head)")
    print("layer   " + " ".join(f"{a:>5d}-{b:<5d}" for a, b in spans))
    for layer, heads in enumerate(found["distance"]):
        mean = [sum(h[r] for h in heads) / len(heads) for r in range(len(spans))]
        worst = [max(h[r] for h in heads) for r in range(len(spans))]
        print(f"{layer:5d}   " + " ".join(f"{m:5.3f}/{w:5.3f}" for m, w in zip(mean, worst)))
    theirs, ours = found["induction"]["original"], found["induction"]["converted"]
    heads = sorted(((s, layer, h) for layer, row in enumerate(theirs) for h, s in enumerate(row)), reverse=True)
    print(f"induction score (period {found['period']}): the original's top {TOP_HEADS} heads, original / converted")
    for score, layer, h in heads[:TOP_HEADS]:
        print(f"  layer {layer:3d} head {h:2d}: {score:.3f} / {ours[layer][h]:.3f}")
    total = [sum(map(sum, scores)) for scores in (theirs, ours)]
    print(f"summed over all heads: original {total[0]:.2f}, converted {total[1]:.2f}")


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("checkpoint", help="a converted checkpoint (hf_normswap.save_pretrained)")
    parser.add_argument("--against", required=True, help="the original model")
    add_text_blocks(parser, "text to run (e.g. WikiText-2 test)", blocks=1, block_len=2048)
    parser.add_argument("--period", type=int, default=256, help="tokens of the passage repeated for the induction "
                        "score (default: %(default)s)")
    parser.add_argument("--query-stride", type=int, default=8, help="every N-th query position kept (memory: "
                        "layers x heads x length^2 / N values; default: %(default)s)")
    parser.add_argument("--restore", nargs="+", default=[], choices=ROLES, metavar="ROLE",
                        help="the original's norms put back at the converted norms of these roles first (choices: "
                             "%(choices)s)")
    parser.add_argument("--restore-first", action="store_true",
                        help="with --restore, the original's norm at the first position alone")
    add_threads(parser)
    add_output(parser, None, "JSON lines, appended")
    args = parser.parse_args(argv)
    if args.restore_first and not args.restore:
        parser.error("--restore-first restores the norms of --restore's roles at the first position: give --restore")
    if not 1 <= args.period < args.block_len:
        parser.error(f"--period must be from 1 to below --block-len ({args.block_len}), got {args.period}")
    use_threads(args)
    original, tokenizer = load_model(args.against, dtype=torch.float32)  # a GGUF original refuses .float()
    model, _ = load_model(args.checkpoint, dtype=torch.float32, with_tokenizer=False)
    restored = restore(model, original, args.restore, args.restore_first) if args.restore else []
    if restored:
        where = " at the first position" if args.restore_first else ""
        print(f"restored the original's {len(restored)} norms of {', '.join(args.restore)}{where}")
    ids = token_blocks(tokenizer, load_texts(args.data, "evaluation"), args.blocks, args.block_len)
    found = [agreement(model.eval(), original.eval(), row, args.period, args.query_stride) for row in ids]
    for one in found:
        report(one)
    if args.out:
        with open(args.out, "a") as stream:
            for one in found:
                stream.write(json.dumps({"checkpoint": args.checkpoint, "restored": args.restore,
                                         "first_only": args.restore_first, **one, "tokens": len(ids[0]),
                                         "commit": commit(), **machine()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
