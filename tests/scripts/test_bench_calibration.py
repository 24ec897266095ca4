"""The calibration benchmark's loss-location diagnostic (``--exact-at``) splices the original norms' outputs in at
exactly the positions it names, and nowhere else."""

from __future__ import annotations

import copy

import torch
from file_modules import import_file
from tiny_models import tiny_model

from hf_normswap import convert


def test_keep_original_at_restores_the_named_positions_only():
    bench = import_file("scripts/benchmarks/bench_calibration.py")
    original = tiny_model("llama")
    converted = copy.deepcopy(original)
    names = [c.name for c in convert(converted, "eln").converted]
    ids = torch.randint(0, original.config.vocab_size, (2, 12))
    with torch.no_grad():
        reference, plain = original(ids).logits, converted(ids).logits
        assert not torch.allclose(plain, reference, atol=1e-3)

        handles = bench.keep_original_at(converted, original, names, slice(None))
        torch.testing.assert_close(converted(ids).logits, reference)
        for handle in handles:
            handle.remove()
        torch.testing.assert_close(converted(ids).logits, plain)  # the hooks are gone

        bench.keep_original_at(converted, original, names, bench.POSITIONS["rest"])
        spliced = converted(ids).logits
    # causal attention: position 0 sees only itself, where the element-wise modules still compute
    torch.testing.assert_close(spliced[:, 0], plain[:, 0])
    assert not torch.allclose(spliced[:, 1:], plain[:, 1:], atol=1e-3)
    assert not torch.allclose(spliced[:, 1:], reference[:, 1:], atol=1e-3)
