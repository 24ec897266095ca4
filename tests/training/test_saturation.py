"""The saturated share per converted module along a run (hf_normswap.training.saturation)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

import hf_normswap
from hf_normswap.training.saturation import SaturationLog
from tiny_models import tiny_model


def test_logging_steps_record_each_modules_saturated_share(tmp_path):
    model = tiny_model("llama")
    report = hf_normswap.convert(model, to="dyt")
    names = [c.name for c in report.converted]
    steep = model.get_submodule(names[0])
    steep.set_shape_parameter(1e4)  # tanh(1e4 x): every element of any sizeable input in the flat part
    log = SaturationLog(model, tmp_path / "saturation.jsonl")
    args = SimpleNamespace(logging_steps=2)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    history = []
    for step in range(4):
        state = SimpleNamespace(global_step=step, num_input_tokens_seen=24 * step, log_history=history)
        log.on_step_begin(args, state, None)
        with torch.no_grad():
            model(input_ids=ids)
        log.on_step_end(args, state, None)
        state.global_step = step + 1
        history.append({"loss": 1.0, "step": step + 1})
        log.on_log(args, state, None, logs=history[-1])
    lines = [json.loads(line) for line in (tmp_path / "saturation.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4]  # the steps the Trainer logs, not the others
    shares = lines[-1]["saturation"]
    assert set(shares) == set(names) and all(0 <= v <= 1 for v in shares.values())
    assert shares[names[0]] > 0.99 and min(shares.values()) < 0.5
    assert "saturation" in history[1] and "saturation" not in history[0]
    log.on_train_end(args, state, None)
    with torch.no_grad():
        model(input_ids=ids)
    assert not log.shares
