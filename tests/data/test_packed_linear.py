"""Linear layers on packed weights: the same outputs, chosen by timing, and the model as it was afterwards."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from hf_normswap.data import packed_linear
from hf_normswap.data.packed_linear import packed_linears

pytestmark = pytest.mark.skipif(not packed_linear._ops_available(), reason="this torch has no oneDNN linear ops")


class Scaled(nn.Linear):
    """A subclass with its own forward, as LoRA and quantized layers have."""

    def forward(self, inputs):
        return 2 * super().forward(inputs)


def _always(monkeypatch, speedup: float) -> None:
    monkeypatch.setattr(packed_linear, "packing_speedup", lambda layers, packed, rows: speedup)


def _packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of ``dtype`` (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 4, dtype=dtype), 2)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_give_the_outputs_of_their_own_weights(monkeypatch, dtype):
    if not _packs(dtype):
        pytest.skip(f"this CPU's oneDNN has no {dtype} linear kernels (the layers then stay unpacked)")
    _always(monkeypatch, 2.0)
    model = tiny_model("llama").to(dtype).eval()
    ids = torch.tensor([[1, 5, 9, 3], [2, 4, 6, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with packed_linears(model, rows=2) as packed:
            assert packed and all("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
            logits = model(input_ids=ids).logits
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    assert not any("forward" in m.__dict__ for m in model.modules())  # the model's own forward again


def test_layers_stay_as_they_are_where_packing_is_not_faster(monkeypatch):
    _always(monkeypatch, 1.0)
    model = tiny_model("llama")
    with packed_linears(model, rows=2) as packed:
        assert not packed and not any("forward" in m.__dict__ for m in model.modules())


def test_subclasses_and_fp16_layers_keep_their_own_forward(monkeypatch):
    _always(monkeypatch, 2.0)
    model = nn.Sequential(nn.Linear(8, 8), Scaled(8, 8), nn.Linear(8, 8).half())
    inputs = torch.randn(3, 8)
    with torch.no_grad(), packed_linears(model, rows=3):
        assert ["forward" in m.__dict__ for m in model] == [True, False, False]
        assert torch.allclose(model[1](inputs), 2 * nn.functional.linear(inputs, model[1].weight, model[1].bias))


def test_the_speedup_is_plain_seconds_over_packed_seconds_on_inputs_of_each_layers_shape(monkeypatch):
    now, shapes = [0.0], {"plain": [], "packed": []}

    def costing(name, seconds):
        return lambda inputs, **kw: shapes[name].append(tuple(inputs.shape)) or now.__setitem__(0, now[0] + seconds)

    layers = [nn.Linear(16, 32), nn.Linear(32, 16, bias=False)]
    for layer in layers:
        layer.forward = costing("plain", 2.0)
    monkeypatch.setattr(packed_linear, "_packed_forward", costing("packed", 0.5))
    speedup = packed_linear.packing_speedup(layers, [None, None], rows=4, clock=lambda: now[0])
    assert speedup == 4.0
    rounds = packed_linear.REPETITIONS + 1  # a warm-up, then the timed rounds
    assert shapes["plain"] == shapes["packed"] == [(4, 16), (4, 32)] * rounds
