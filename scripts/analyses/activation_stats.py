"""Per-norm input scale of a model on real text: RMS of the first position and quantiles of the other tokens.

Shows why one scalar alpha / beta per norm cannot follow every token: the first position (attention sink) and a few
other "heavy" tokens carry many times the median RMS. The last columns give the RMS over the ordinary channels (all
but the 3 largest on average) of normal and of heavy tokens: when they are alike, the heavy tokens differ only in
their massive channels, and no element-wise function can give their ordinary channels the ~median/heavy smaller
output that RMSNorm gives them. Usage:

    python scripts/analyses/activation_stats.py offline:smollm2 --data wikitext:wikitext-2-v1:validation   # or a local file
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hf_normswap import find_norms, load_model
from hf_normswap.data import load_texts, token_blocks  # internal: --data read as normswap reads it

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared harness (run by path)

from harness.flags import add_text_blocks, script_parser


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("model")
    add_text_blocks(parser, "text to run (default: %(default)s)", data="builtin")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    ids = token_blocks(tokenizer, load_texts(args.data), args.blocks, args.block_len)
    norms = find_norms(model)
    inputs = {}
    handles = [model.get_submodule(n.name).register_forward_hook(
        lambda m, a, o, name=n.name: inputs.__setitem__(name, a[0].detach().float())) for n in norms]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    heavy_words = set()
    print(f"{'norm':<42} {'pos0 rms':>9} {'q01':>7} {'median':>7} {'q99':>7} {'max':>7} {'>5x median':>10} "
          f"{'ordinary: normal':>17} {'heavy':>6}")
    for n in norms:
        x = inputs[n.name]
        rms = x.pow(2).mean(-1).sqrt()
        others = rms[:, 1:].flatten()
        q01, med, q99 = torch.quantile(others, torch.tensor([0.01, 0.5, 0.99])).tolist()
        ordinary = torch.ones(x.shape[-1], dtype=torch.bool)
        ordinary[x[:, 1:].abs().mean((0, 1)).topk(3).indices] = False
        ordinary_rms = x[..., ordinary].pow(2).mean(-1).sqrt()[:, 1:]
        heavy = rms[:, 1:] > 5 * med
        heavy_words.update(tokenizer.decode(ids[b, t:t + 2]) for b, t in heavy.nonzero().tolist())
        heavy_text = f"{ordinary_rms[heavy].median():6.2f}" if heavy.any() else f"{'-':>6}"
        print(f"{n.name:<42} {rms[:, 0].mean():9.1f} {q01:7.1f} {med:7.1f} {q99:7.1f} {others.max():7.1f} "
              f"{int(heavy.sum()):>10} {ordinary_rms[~heavy].median():17.2f} {heavy_text}")
    if heavy_words:
        print("heavy tokens (with the token before):", ", ".join(repr(w) for w in sorted(heavy_words)[:12]))


if __name__ == "__main__":
    main()
