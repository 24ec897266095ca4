"""Every stage on a CUDA GPU: the modules and their fused path, calibration on the GPU and from CPU memory, a
remote-code checkpoint placed by transformers, and the command line. Skipped without a GPU; `pytest -m cuda`
(scripts/gpu_check.sh) runs them.

Tolerances: the GPU computes the same fp32 formulas in another order (and attention with other kernels), so
values agree to a relative 1e-5 for a module and 1e-3 after a calibrated conversion, whose fits and Adam steps
carry the differences on; a half-precision output may differ in its last bit (bf16: 2^-8 relative, fp16: 2^-11)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import hf_normswap
from hf_normswap import kernels
from hf_normswap.calibration.calibrate import CalibrationConfig
from hf_normswap.cli import main
from hf_normswap.modules import ERF_SLOPE_RATIO, Derf, DyT, ELN
from tiny_models import full_length_tokenizer, random_elementwise, tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# class, shape value for C = 576
METHODS = {"eln": (ELN, 576.0), "dyt": (DyT, 576 ** -0.5), "derf": (Derf, ERF_SLOPE_RATIO * 576 ** -0.5)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fused against the reference formula, relative to the norm of the result: output and grad x in the input's dtype
# (one rounding apart), the reduced parameter grads (fp32 sums in another order, then the parameter's dtype)
FUSED_RTOL = {"fp32": 1e-5, "bf16": 2 ** -7, "fp16": 2 ** -10}
CONVERSION_RTOL = 1e-3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _module(method: str, dtype: torch.dtype, per_channel: bool, size: int = 576):
    """As ``convert`` builds it: the affine parameters in the model's dtype, the shape parameter in fp32."""
    cls, shape = METHODS[method]
    module = random_elementwise(cls, size, shape=shape, amplitude=size ** 0.5, per_channel=per_channel)
    module.weight.data, module.bias.data = module.weight.data.to(dtype), module.bias.data.to(dtype)
    return module


def _activations(tokens: int, size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    torch.manual_seed(1)
    x = 4 * torch.randn(tokens, size)
    x[0] *= 100  # a massive activation, as real models have
    return x.to(device, dtype)


def _forward_backward(module, x, grad):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(grad)
    return y.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_modules_forward_and_backward_on_cuda_match_the_cpu(method):
    with kernels.fallback():
        module = _module(method, torch.float32, per_channel=True, size=96)
        x, grad = _activations(64, 96, torch.float32, "cpu"), torch.randn(64, 96)
        cpu = _forward_backward(module, x, grad)
        gpu = _forward_backward(copy.deepcopy(module).cuda(), x.cuda(), grad.cuda())
    assert _relative(gpu[0], cpu[0]) < 1e-5 and _relative(gpu[1], cpu[1]) < 1e-5
    for name, value in cpu[2].items():
        assert _relative(gpu[2][name], value) < 1e-5, name


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_fused_path_on_cuda_matches_the_reference_formula(method, dtype, per_channel, monkeypatch):
    """The compiled kernels, as CUDA runs them where triton is absent (tests/test_triton_kernels.py: where present)."""
    monkeypatch.setattr(kernels, "_on_triton", lambda x: False)
    kernels.install()
    module = _module(method, DTYPES[dtype], per_channel).cuda()
    x = _activations(256, 576, DTYPES[dtype], "cuda")  # 147k elements: above kernels.MIN_NUMEL
    grad = torch.randn_like(x)
    fused = _forward_backward(module, x, grad)
    key = (type(module).squash, x.device, 576, x.dtype, x.dtype, x.dtype, int(per_channel),
           tuple((e.dtype, e.dim()) for e in module.extras()))  # Derf's shift: fp32, a scalar
    broken = {name: kernel.broken for (name, *rest), kernel in kernels._kernels.items() if tuple(rest) == key}
    assert broken == {"fwd": False, "bwd": False}, "the fused path did not run on CUDA"
    with kernels.fallback():
        reference = _forward_backward(module, x, grad)
    tolerance = FUSED_RTOL[dtype]
    assert _relative(fused[0], reference[0]) < tolerance
    assert _relative(fused[1], reference[1]) < tolerance
    for name, value in reference[2].items():
        assert fused[2][name].dtype == value.dtype and _relative(fused[2][name], value) < tolerance, name


def _calibration(device=None):
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    return CalibrationConfig(data=ids, batch_size=4, block_steps=6, block_rows=2, tune_steps=4, tune_blocks=2,
                             max_iter=10, progress=False, device=device)


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids.to(next(model.parameters()).device))
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float().cpu()


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_conversion_calibrated_on_cuda_matches_the_cpu(arch):
    """Calibrated entirely on the GPU (the model there), and block by block on the GPU from CPU memory (Llama: its
    norms sit in one stack; BERT's embedding norm runs before it), both as on the CPU."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    cpu = tiny_model(arch)
    hf_normswap.convert(cpu, "eln", calibration=_calibration())
    expected = _logits(cpu, ids)
    on_gpu = tiny_model(arch).cuda()
    hf_normswap.convert(on_gpu, "eln", calibration=_calibration())
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
    assert _relative(_logits(on_gpu, ids), expected) < CONVERSION_RTOL
    from_cpu = tiny_model(arch)
    report = hf_normswap.convert(from_cpu, "eln", calibration=_calibration(device="cuda"))
    assert report.calibration["mode"] == "sequential"
    assert {p.device.type for p in from_cpu.parameters()} == {"cpu"}
    assert _relative(_logits(from_cpu, ids), expected) < CONVERSION_RTOL


def test_remote_code_checkpoint_loads_onto_cuda_with_device_map(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    hf_normswap.convert(model, "eln", calibration=_calibration())
    hf_normswap.save_pretrained(model, tmp_path / "converted", tokenizer=tiny_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", trust_remote_code=True, device_map="cuda")
    assert type(loaded).__module__.startswith("transformers_modules")
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    assert _relative(_logits(loaded.eval(), ids), _logits(model, ids)) < 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-cli")
    for arch in ("llama", "bert"):
        tiny_model(arch, max_position_embeddings=128).save_pretrained(root / arch)
        tiny_tokenizer().save_pretrained(root / arch)
    return root


def _eval(capsys, *argv) -> dict:
    assert main(["eval", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_converts_evaluates_and_maps_sensitivity_on_cuda(saved, tmp_path, capsys):
    llama, converted = saved / "llama", tmp_path / "converted"
    assert main(["inspect", str(llama), "--device", "cuda"]) == 0
    assert main(["convert", str(llama), "--to", "eln", "--device", "cuda", "--calib", "builtin", "--calib-blocks",
                 "4", "--calib-len", "32", "--strategy", "fast", "--output", str(converted)]) == 0
    capsys.readouterr()
    gpu = {device: _eval(capsys, converted, "--against", llama, "--device", device, "--max-tokens", "96")
           for device in ("cuda", "cpu")}
    assert gpu["cuda"]["tokens"] == gpu["cpu"]["tokens"] == 96
    for name in ("original", "converted"):
        cuda, cpu = (gpu[d]["results"][name]["token_perplexity"] for d in ("cuda", "cpu"))
        assert cuda == pytest.approx(cpu, rel=1e-3), name
    assert gpu["cuda"]["kl"]["converted"] == pytest.approx(gpu["cpu"]["kl"]["converted"], rel=1e-2, abs=1e-5)
    assert main(["sensitivity", str(llama), "--to", "eln", "--windows", "1", "--window-len", "32", "--device", "cuda",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_cli_eval_of_an_encoder_on_cuda(saved, capsys):
    bert = saved / "bert"
    result = _eval(capsys, bert, "--against", bert, "--device", "cuda", "--dtype", "bfloat16", "--max-length", "64",
                   "--max-tokens", "2000")
    assert result["results"]["converted"]["cosine"] == pytest.approx(1.0, abs=1e-3)


def test_one_recipe_step_on_cuda_in_bf16(tmp_path):
    """recipes/finetune.py on the GPU: calibration, a bf16 autocast training step (student forward and backward, the
    teacher's forward), the final evaluation and the reload check, in one process."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    model_dir = tmp_path / "tiny-llama"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(
        model_dir)
    tokenizer.save_pretrained(model_dir)
    config = {"model": str(model_dir), "method": "eln", "precision": "bf16", "block_len": 32, "eval_blocks": 1,
              "calibration": {"data": "builtin", "num_blocks": 4, "block_len": 32, "progress": False},
              "final_eval": {"max_tokens": 256, "max_length": 32}, "output_dir": str(tmp_path / "run"),
              "training": {"max_steps": 1, "per_device_train_batch_size": 2, "eval_strategy": "no",
                           "save_strategy": "no", "report_to": "none", "disable_tqdm": True}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, str(root / "recipes" / "finetune.py"), "--config",
                             str(tmp_path / "c.yaml")], cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["training"]["precision"]["precision"] == "bf16" and summary["reload_identical"]
    assert summary["training"]["steps"] == 1


def test_the_originals_samples_on_cuda_use_the_preallocated_cache(tmp_path):
    """Sampling on the GPU: the preallocated cache generates what transformers' own cache does, and a drawn batch
    reads back as whole sequences of the requested length."""
    from hf_normswap.data.generated import SampleCache, SamplingSettings, cache_argument, draw, preallocated_cache

    model = tiny_model("llama").to("cuda").eval()
    prompts = torch.tensor([[1, 5, 9], [1, 7, 3]], device="cuda")
    kwargs = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=20,
                  min_new_tokens=20, pad_token_id=0)
    ready = {cache_argument(model): preallocated_cache(model, 23)}
    assert torch.equal(model.generate(**kwargs, **ready), model.generate(**kwargs))
    tokenizer = full_length_tokenizer()
    cache = SampleCache(model, SamplingSettings(length=16, batch_size=4, precision="bf16"), tmp_path)
    assert draw(model, tokenizer, cache, [0], progress=False) == "bf16"
    assert [len(row) for row in cache.read(0)] == [16] * 4


def test_the_compiled_static_cache_draws_the_preallocated_caches_tokens_on_cuda(tmp_path):
    """The sampler's CUDA branch (static cache, decode step compiled with CUDA graphs) against the eager
    preallocated path, fp32 weights: the same seed gives the same tokens."""
    from transformers import CompileConfig

    from hf_normswap.data.generated import SampleCache, SamplingSettings, draw

    model, tokenizer = tiny_model("llama").to("cuda").eval(), full_length_tokenizer()
    settings = SamplingSettings(length=16, batch_size=8, precision="fp32")
    drawn = []
    for name, compiled in (("eager", None), ("graphs", CompileConfig(mode="reduce-overhead"))):
        cache = SampleCache(model, settings, tmp_path / name)
        draw(model, tokenizer, cache, [0, 1], progress=False, compiled=compiled)
        drawn.append([cache.read(0), cache.read(1)])
    assert drawn[0] == drawn[1]
