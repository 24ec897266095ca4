"""The start without text: each norm's real inputs from one forward pass of the original on random token ids.

The theory's shape parameter is exact for inputs of a known RMS; assuming RMS 1 is wrong by the size of the
residual stream (tens to thousands on pretrained models), which saturates every module and compounds through the
layers. One forward pass on a few sequences of token ids drawn from the vocabulary (the BOS token first, where the
model has one) needs no tokenizer and no text, yet gives each norm's median token scale within a few percent of
what real text gives. For LayerNorm that scale is all the theory needs. RMSNorm models carry attention sinks (first
positions of 100x the median RMS) that a module linear at the median scale passes through 100x too large, so they
take calibration's saturating start (``fitting.saturating_init``) on the same pass, one ceiling per channel.
"""

from __future__ import annotations

import torch
from torch import nn

from ..discovery.norms import NormInfo
from ..model_inputs import forward_without_cache, probe_ids
from .fitting import analytic_input_scale, saturating_init

@torch.no_grad()
def norm_inputs(model: nn.Module, selected: list[NormInfo], inputs: dict) -> dict[str, tuple]:
    """Norm name -> (its input tokens, fp32 on the CPU, one row a token; which rows are first positions), from one
    forward pass of ``model`` on ``inputs``."""
    captured, handles = {}, []

    def hook(name: str):
        def record(module, args):
            x = args[0].detach().float()
            x = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 2 else x.unsqueeze(0)  # (rows, positions, C)
            is_first = torch.zeros(x.shape[:2], dtype=torch.bool)
            is_first[:, 0] = True
            captured[name] = (x.reshape(-1, x.shape[-1]).cpu(), is_first.reshape(-1))
        return record

    was_training = model.training
    model.eval()
    try:
        for info in selected:
            handles.append(model.get_submodule(info.name).register_forward_pre_hook(hook(info.name)))
        forward_without_cache(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return captured


def measured_start(model: nn.Module, selected: list[NormInfo], build, replace, inputs: dict | None = None) -> dict:
    """Build and set each selected norm's replacement from the original's inputs on ``inputs`` (default
    ``model_inputs.probe_ids``): the theory at the measured scale, per module; for RMSNorm the saturating start, per
    channel. ``build(source, info, input_scale=, per_channel=)`` makes a module and ``replace(model, name, module)``
    sets it, as in calibration. Returns norm name -> measured input scale."""
    captured = norm_inputs(model, selected, probe_ids(model) if inputs is None else inputs)
    saturating = any(info.kind == "rmsnorm" for info in selected)
    scales = {}
    for info in selected:
        x, is_first = captured.get(info.name, (torch.empty(0, info.size), torch.empty(0, dtype=torch.bool)))
        scales[info.name] = analytic_input_scale(x, info.kind, is_first) if x.shape[0] else 1.0
        replacement = build(model.get_submodule(info.name), info, input_scale=scales[info.name],
                            per_channel=saturating)
        if saturating and x.shape[0]:
            saturating_init(replacement, x, info.kind, scales[info.name], is_first)
        replace(model, info.name, replacement)
    return scales
