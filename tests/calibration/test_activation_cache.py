"""The block pass's bounded activation cache and its one-block-at-a-time placement on the compute device."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch
from tiny_models import tiny_model

from hf_normswap import convert
from hf_normswap.calibration import block_pass
from hf_normswap.calibration.activation_cache import ActivationCache
from hf_normswap.calibration.calibrate import CalibrationConfig


def _tensors(count=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, 128, generator=generator) for _ in range(count)]  # 16 KiB each


def test_cache_keeps_tensors_in_memory_up_to_the_limit_and_the_rest_in_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tensors = _tensors()
    size = tensors[0].numel() * 4
    with ActivationCache(memory_limit=2 * size) as cache:
        cached = cache.store(iter(tensors))  # a generator is fine: stored as it comes
        assert len(cached) == 4 and cached.on_disk == 2
        files = list(tmp_path.rglob("*.safetensors"))
        file_bytes = sum(f.stat().st_size for f in files)
        assert len(files) == 2 and cache.memory_bytes == 2 * size and cache.disk_bytes == file_bytes > 2 * size
        for k in (3, 0, 2, 2, 1):  # any order, repeats served from the last file read
            torch.testing.assert_close(cached[k], tensors[k], rtol=0, atol=0)
        cached.release()
        assert len(cached) == 0 and cache.memory_bytes == 0 and cache.disk_bytes == 0
        assert not list(tmp_path.rglob("*.safetensors"))
        again = cache.store(tensors[:1])
        assert again.on_disk == 0  # the freed memory is used again
    assert not list(tmp_path.iterdir())  # the spill directory is gone with the cache
    assert (cache.peak_memory_bytes, cache.peak_disk_bytes) == (2 * size, file_bytes)


def test_cache_limit_zero_puts_every_tensor_on_disk_and_none_is_unbounded():
    tensors = _tensors(3)
    with ActivationCache(memory_limit=0) as on_disk, ActivationCache() as in_memory:
        assert on_disk.store(tensors).on_disk == 3 and on_disk.memory_bytes == 0
        assert in_memory.store(tensors).on_disk == 0 and in_memory.disk_bytes == 0


def _calibration(**options):
    return CalibrationConfig(data=torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1)),
                             batch_size=4, strategy="block", block_steps=6, block_rows=2, block_weights_lr=1e-3,
                             tune_steps=0, progress=False, max_iter=10, **options)


def test_block_pass_spilled_to_disk_converts_exactly_as_in_memory(tmp_path, monkeypatch):
    """Every cached hidden state read back from a file: the same fits, block tuning and final norm, to the bit."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    models, reports = [], []
    for limit in (None, 0):
        model = tiny_model("llama")
        reports.append(convert(model, "eln", calibration=_calibration(cache_memory_mb=limit)))
        models.append(model)
    in_memory, on_disk = (r.calibration["activation_cache"] for r in reports)
    assert in_memory["peak_disk_mb"] == 0 < in_memory["peak_memory_mb"]
    assert on_disk["peak_memory_mb"] == 0 < on_disk["peak_disk_mb"]
    assert [t["block"] for t in reports[1].calibration["block_tuning"]] == [0, 1, "model.norm"]
    assert reports[0].calibration["block_tuning"] == reports[1].calibration["block_tuning"]
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert not list(tmp_path.iterdir())


def test_block_pass_runs_each_block_only_in_its_own_stage_on_the_compute_device(monkeypatch):
    """The placement protocol, on a machine with one device: the pass puts each block (then the final norm) on the
    compute device once, in order, and within a stage calls no other block. The full-model forwards around the
    stages (the first block's inputs, the final norm's check) run where the model is, outside every stage."""
    model = tiny_model("llama")
    stages, active = [], []
    placed = block_pass._on_device

    @contextlib.contextmanager
    def recording(model_, name, device):
        stages.append((name, torch.device(device).type))
        active.append(name)
        with placed(model_, name, device):
            yield
        active.pop()

    def check(name):
        def hook(*_):
            assert not active or active[-1] == name, f"{name} ran in the stage of {active[-1]}"
        return hook

    for index, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(check(f"model.layers.{index}"))
    monkeypatch.setattr(block_pass, "_on_device", recording)
    convert(model, "eln", calibration=_calibration(device="cpu"))
    assert stages == [("model.layers.0", "cpu"), ("model.layers.1", "cpu"), ("model.norm", "cpu")]
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_a_device_for_a_model_fitted_in_one_pass_is_named_as_unused(caplog):
    """Two stacks of blocks (T5) leave no block pass to place: the setting must not be dropped in silence."""
    report = convert(tiny_model("t5"), "eln", calibration=CalibrationConfig(
        data=torch.randint(0, 128, (4, 16)), batch_size=4, strategy="kl", tune_steps=0, progress=False, max_iter=5,
        device="cpu"))
    assert report.calibration["mode"] == "one-shot"
    assert "calibration device cpu unused" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_pass_on_cuda_leaves_the_model_on_the_cpu_and_matches_a_cpu_pass():
    results = []
    for device in (None, "cuda"):
        model = tiny_model("llama")
        convert(model, "eln", calibration=_calibration(device=device))
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        results.append(model.state_dict())
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("options,message", [
    ({"device": "nonsense"}, "is not a torch device"),
    ({"cache_memory_mb": -1}, "cache_memory_mb must be at least 0"),
])
def test_bad_placement_settings_fail_before_any_work(options, message):
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(**options).resolved()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_the_machine_lacks_is_named_with_the_fix():
    with pytest.raises(ValueError, match="this machine has no cuda device; leave the device unset"):
        CalibrationConfig(device="cuda").resolved()
