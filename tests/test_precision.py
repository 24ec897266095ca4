"""precision: auto picks bf16 autocast only where the probe finds it faster; bf16 keeps fp32 master weights."""

from __future__ import annotations

import pytest
import torch

from hf_normswap import precision
from hf_normswap.precision import choose_precision
from tiny_models import tiny_model


@pytest.fixture
def bf16_matmuls(monkeypatch):
    """A machine whose bf16 matmuls are fast, so that ``auto`` goes on to time the step (whatever this CPU has)."""
    monkeypatch.setattr(precision, "matmul_speedup", lambda device="cpu": 2.0)


def _fake_timed_step(fp32_seconds: float, bf16_seconds: float):
    """A step and a timer whose clock advances by the step's fake duration under the active precision."""
    now = [0.0]

    def step():
        now[0] += bf16_seconds if torch.is_autocast_enabled("cpu") else fp32_seconds

    return step, lambda: now[0]


@pytest.mark.parametrize("fp32, bf16, expected", [(10.0, 5.0, "bf16"), (5.0, 10.0, "fp32"), (10.0, 9.8, "fp32")])
def test_auto_picks_bf16_only_when_the_probe_finds_it_faster(fp32, bf16, expected, bf16_matmuls):
    step, timer = _fake_timed_step(fp32, bf16)
    choice = choose_precision("auto", step, timer=timer)
    assert choice.precision == expected
    assert (choice.fp32_seconds, choice.bf16_seconds) == (fp32, bf16)
    assert f"{fp32:.3g}s" in choice.describe()


def test_slow_bf16_matmuls_pick_fp32_without_timing_the_step(monkeypatch):
    """A CPU without bf16 matrix instructions (AVX2 alone: bf16 matmuls about 45x slower) must not time a bf16 step."""
    monkeypatch.setattr(precision, "matmul_speedup", lambda device="cpu": 0.014)

    def step():
        raise AssertionError("the step was timed")

    choice = choose_precision("auto", step)
    assert (choice.precision, choice.fp32_seconds, choice.bf16_seconds) == ("fp32", None, None)
    assert "0.014x fp32's speed" in choice.describe() and "not timed" in choice.describe()


def test_matmul_probe_returns_a_finite_speed_ratio_and_restores_the_random_state():
    torch.manual_seed(0)
    assert 0 < precision.matmul_speedup() < float("inf")
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))


def test_fixed_precisions_do_not_probe_and_unknown_ones_fail():
    assert choose_precision("fp32").precision == "fp32" and choose_precision("bf16").bf16
    with pytest.raises(ValueError, match="precision must be one of"):
        choose_precision("fp16")


def test_probe_restores_the_random_state(bf16_matmuls):
    torch.manual_seed(0)
    choose_precision("auto", lambda: torch.rand(1), repetitions=1)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))


def test_bf16_autocast_step_keeps_fp32_master_weights_and_gradients():
    from hf_normswap.precision import autocast

    model = tiny_model("llama").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 8))
    with autocast(True):
        out = model(input_ids=ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16  # the matmuls did run in bf16
    out.loss.backward()
    optimizer.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(s.dtype == torch.float32 for state in optimizer.state.values() for s in state.values()
               if isinstance(s, torch.Tensor) and s.dim())


def test_bf16_calibration_runs_its_passes_under_autocast_and_keeps_fp32_modules():
    from hf_normswap import convert
    from hf_normswap.calibration.calibrate import CalibrationConfig
    from hf_normswap.modules import ElementwiseNorm

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for chosen in ("fp32", "bf16"):
        model = tiny_model("llama")
        seen = []
        model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        config = CalibrationConfig(data=ids, num_blocks=4, block_len=16, batch_size=4, strategy="block",
                                   block_steps=3, tune_steps=2, tune_blocks=2, progress=False, precision=chosen)
        report = convert(model, "eln", calibration=config)
        assert report.calibration["precision"]["precision"] == chosen
        assert (torch.bfloat16 in seen) == (chosen == "bf16")  # convert's own passes outside calibration: fp32
        norms = [m for m in model.modules() if isinstance(m, ElementwiseNorm)]
        assert norms and all(p.dtype == torch.float32 for m in norms for p in m.parameters())
        results[chosen] = torch.cat([p.detach().flatten() for m in norms for p in m.parameters()])
    torch.testing.assert_close(results["bf16"], results["fp32"], rtol=0.1, atol=0.05)  # same fit, bf16 rounding


def test_auto_calibration_probes_the_model_and_records_both_timings(bf16_matmuls):
    from hf_normswap import convert
    from hf_normswap.calibration.calibrate import CalibrationConfig

    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    config = CalibrationConfig(data=ids, num_blocks=2, block_len=8, batch_size=2, strategy="block", block_steps=1,
                               tune_steps=0, progress=False, precision="auto")
    chosen = convert(tiny_model("llama"), "dyt", calibration=config).calibration["precision"]
    assert chosen["requested"] == "auto" and chosen["precision"] in ("fp32", "bf16")
    assert chosen["fp32_seconds"] > 0 and chosen["bf16_seconds"] > 0


def test_recipe_rejects_an_unknown_precision_before_any_work(capsys):
    from hf_normswap.training import recipe_settings

    assert recipe_settings.load_config(["precision=bf16"]).precision == "bf16"
    with pytest.raises(SystemExit) as error:
        recipe_settings.load_config(["precision=fp16"])
    assert error.value.code == 2 and "precision 'fp16' is unknown: choose auto, fp32 or bf16" in capsys.readouterr().err


@pytest.mark.parametrize("model_type, settings", [
    ("llama", dict(weight=1.0)),
    ("llama", dict(weight=1.0, hidden=1.0)),
    ("bert", dict(weight=1.0, logits=False, hidden=1.0, sink_weight=1.0)),  # no logits, no labels
    ("bert", dict(weight=1.0, logits=False, embedding=1.0)),
])
def test_auto_probes_the_training_step_of_decoders_and_encoders(model_type, settings, bf16_matmuls):
    from hf_normswap import convert
    from hf_normswap.training.config import DistillSettings
    from hf_normswap.training.recovery_loss import RecoveryLoss
    from hf_normswap.training.step_precision import training_step_precision

    student, teacher = tiny_model(model_type), tiny_model(model_type)
    if model_type == "bert":  # the encoder alone, ending in hidden states as a sentence encoder does
        student, teacher = student.bert, teacher.bert
    convert(student, to="eln")
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    choice = training_step_precision("auto", student, teacher, {"input_ids": ids, "attention_mask": mask},
                                     loss=RecoveryLoss.of(DistillSettings(**settings), student))
    assert choice.requested == "auto" and choice.fp32_seconds > 0 and choice.bf16_seconds > 0
    assert all(p.grad is None for p in student.parameters())
