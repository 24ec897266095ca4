"""Per-norm input scale of a model on real text: RMS of the first position and quantiles of the other tokens.

Shows why one scalar alpha / beta per norm cannot follow every token: the first position (attention sink) and a few
other tokens carry many times the median RMS. Usage:

    python scripts/activation_stats.py offline:smollm2 --data ../shared/data/wikitext-2/wiki.valid.tokens
"""

from __future__ import annotations

import argparse

import torch

from hf_normswap.data import load_texts, token_blocks
from hf_normswap.discovery import find_norms
from hf_normswap.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-len", type=int, default=512)
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
    print(f"{'norm':<42} {'pos0 rms':>9} {'q01':>7} {'median':>7} {'q99':>7} {'max':>7} {'>5x median':>10}")
    for n in norms:
        rms = inputs[n.name].pow(2).mean(-1).sqrt()
        others = rms[:, 1:].flatten()
        q01, med, q99 = torch.quantile(others, torch.tensor([0.01, 0.5, 0.99])).tolist()
        print(f"{n.name:<42} {rms[:, 0].mean():9.1f} {q01:7.1f} {med:7.1f} {q99:7.1f} {others.max():7.1f} "
              f"{int((others > 5 * med).sum()):>10}")


if __name__ == "__main__":
    main()
