"""Save / reload of converted models: package load and remote-code load (without hf_normswap) give bit-identical
logits for every tiny architecture; stock loaders refuse; output is atomic and a refused output is left untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import ModelCard

import hf_normswap
from hf_normswap import cli
from hf_normswap.checkpoint import directory as checkpoint_dir, loading, model_card, remote_code
from hf_normswap.checkpoint.record import converted_config
from hf_normswap.model_inputs import dummy_inputs, first_tensor
from matrix import Case, converted
from tiny_models import ARCHITECTURES, tiny_model

METHOD = {arch: ("dyt" if i % 3 == 1 else "eln") for i, arch in enumerate(ARCHITECTURES)}  # Derf: saved_derf


pytestmark = pytest.mark.usefixtures("one_thread")


def _save_all(root: Path, methods: dict[str, str]) -> dict:
    """arch -> (checkpoint dir, inputs, reference output of the converted model before saving)."""
    result = {}
    for arch in ARCHITECTURES:
        model, _ = converted(Case(arch, methods[arch], per_channel=arch in ("llama", "bert")))
        inputs = dummy_inputs(model)
        with torch.no_grad():
            derfs = [m for m in model.modules() if isinstance(m, hf_normswap.modules.Derf)]
            for i, module in enumerate(derfs):  # a shift of its own each, so that a lost one shows
                module.shift.fill_(0.01 * (i + 1))
            reference = first_tensor(model(**inputs))
        directory = root / arch
        hf_normswap.save_pretrained(model, directory)
        result[arch] = (directory, inputs, reference)
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save_all(tmp_path_factory.mktemp("checkpoints"), METHOD)


@pytest.fixture(scope="module")
def saved_derf(tmp_path_factory):
    return _save_all(tmp_path_factory.mktemp("derf"), dict.fromkeys(ARCHITECTURES, "derf"))


REMOTE_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["hf_normswap"] = None  # the package is installed editable in this venv: make it unimportable
    import json, torch, transformers
    torch.set_num_threads(1)
    try:
        import hf_normswap
        print("IMPORTED hf_normswap", flush=True)
    except ImportError:
        print("hf_normswap not importable", flush=True)
    jobs = json.loads(sys.argv[1])
    outputs = {}
    for arch, (directory, inputs_file) in jobs.items():
        auto_map = json.load(open(directory + "/config.json"))["auto_map"]
        auto = sorted(k for k in auto_map if k != "AutoConfig")[0]
        model = getattr(transformers, auto).from_pretrained(directory, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(**torch.load(inputs_file))
        tensor = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        outputs[arch] = (type(model).__name__, type(model).__module__, tensor)
    torch.save(outputs, sys.argv[2])
""")


def _load_remote(saved: dict, work: Path):
    """Load every saved checkpoint with trust_remote_code in ONE subprocess that cannot import hf_normswap."""
    jobs = {}
    for arch, (directory, inputs, _) in saved.items():
        torch.save(inputs, work / f"{arch}.pt")
        jobs[arch] = (str(directory), str(work / f"{arch}.pt"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", REMOTE_SCRIPT, json.dumps(jobs), str(work / "outputs.pt")],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, torch.load(work / "outputs.pt")


@pytest.fixture(scope="module")
def remote(saved, tmp_path_factory):
    return _load_remote(saved, tmp_path_factory.mktemp("remote"))


@pytest.fixture(scope="module")
def remote_derf(saved_derf, tmp_path_factory):
    return _load_remote(saved_derf, tmp_path_factory.mktemp("remote-derf"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reload_with_package_is_bit_exact(saved, arch):
    directory, inputs, reference = saved[arch]
    model = hf_normswap.load(directory)
    assert type(model).__name__.startswith("NormSwap")
    modules = [m for m in model.modules() if isinstance(m, hf_normswap.ElementwiseNorm)]
    config = json.loads((directory / "config.json").read_text())
    assert len(modules) == len(config["normswap"]["converted"]) > 0
    assert all(isinstance(m, hf_normswap.modules.METHODS[METHOD[arch]]) for m in modules)
    with torch.no_grad():
        output = first_tensor(model(**inputs))
    assert output.dtype == torch.float32
    assert torch.equal(output, reference)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reload_with_remote_code_without_package_is_bit_exact(saved, remote, arch):
    _, _, reference = saved[arch]
    class_name, module, output = remote[1][arch]
    assert class_name.startswith("NormSwap") and "modeling_normswap" in module
    assert torch.equal(output, reference)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_derf_reloads_bit_exact_with_the_package_and_with_remote_code(saved_derf, remote_derf, arch):
    """Derf has a parameter the other methods lack (its shift): every architecture, both loaders."""
    directory, inputs, reference = saved_derf[arch]
    model = hf_normswap.load(directory)
    modules = [m for m in model.modules() if isinstance(m, hf_normswap.modules.Derf)]
    assert modules and all(m.shift.shape == () and m.shift != 0 for m in modules)
    with torch.no_grad():
        assert torch.equal(first_tensor(model(**inputs)), reference)
    class_name, module, output = remote_derf[1][arch]
    assert class_name.startswith("NormSwap") and "modeling_normswap" in module
    assert torch.equal(output, reference)
    assert "IMPORTED" not in remote_derf[0]


def test_remote_process_could_not_import_the_package(remote):
    assert "hf_normswap not importable" in remote[0]
    assert "IMPORTED" not in remote[0]


def test_saved_files_and_config(saved):
    directory = saved["llama"][0]
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "modeling_normswap.py", "README.md"} <= names
    assert not [n for n in os.listdir(directory.parent) if n.startswith(".")]  # no staging leftovers
    umask = os.umask(0)
    os.umask(umask)
    assert {oct((directory / n).stat().st_mode & 0o777) for n in names} == {oct(0o666 & ~umask)}  # none private
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "normswap_llama"
    assert config["architectures"] == ["NormSwapLlamaForCausalLM"]
    assert config["auto_map"] == {"AutoConfig": "modeling_normswap.NormSwapConfig",
                                  "AutoModelForCausalLM": "modeling_normswap.NormSwapLlamaForCausalLM"}
    block = config["normswap"]
    assert block["method"] == METHOD["llama"] and block["version"] == hf_normswap.__version__
    assert block["base"] == {"architecture": "LlamaForCausalLM", "config_class": "LlamaConfig", "model_type": "llama"}
    assert "calibration" in block
    converted = block["converted"]
    assert set(converted) == {"model.norm"} | {f"model.layers.{i}.{n}" for i in range(2)
                                               for n in ("input_layernorm", "post_attention_layernorm")}
    entry = converted["model.norm"]
    assert entry["kind"] == "rmsnorm" and entry["amplitude"] == pytest.approx(32 ** 0.5)
    assert entry["normalized_shape"] == [32] and entry["per_channel"] is True and entry["bias"] is False
    seq2seq = json.loads((saved["t5"][0] / "config.json").read_text())["auto_map"]
    assert seq2seq["AutoModelForSeq2SeqLM"] == "modeling_normswap.NormSwapT5ForConditionalGeneration"
    assert "AutoModelForSpeechSeq2Seq" in json.loads((saved["whisper"][0] / "config.json").read_text())["auto_map"]
    assert json.loads((saved["vit"][0] / "config.json").read_text())["auto_map"]["AutoModel"].endswith("NormSwapViTModel")
    assert "AutoModelForMaskedLM" in json.loads((saved["bert"][0] / "config.json").read_text())["auto_map"]


def test_remote_code_imports_only_torch_and_transformers(saved):
    import ast
    for arch in ("llama", "t5", "vit"):
        tree = ast.parse((saved[arch][0] / "modeling_normswap.py").read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0
                roots.add(node.module.split(".")[0])
        assert roots - sys.stdlib_module_names <= {"torch", "transformers"}, roots  # nothing else to install


def test_generated_modules_are_checked_against_the_package():
    text = remote_code.render("LlamaForCausalLM", "LlamaConfig", "llama")
    remote_code.check_remote_modules(text)  # identical source: passes
    drifted = text.replace("x * torch.rsqrt(beta + x * x)", "x * torch.rsqrt(beta + x * x + 1e-6)")
    assert drifted != text
    with pytest.raises(remote_code.RemoteCodeError, match="differs"):
        remote_code.check_remote_modules(drifted)


def test_stock_auto_loader_refuses_without_trust_remote_code(saved, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda *a: "")  # the interactive prompt answers "no"
    directory = saved["llama"][0]
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(directory)
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoConfig.from_pretrained(directory)


def test_model_card(saved):
    assert METHOD["gpt2"] == "eln" and METHOD["bert"] == "dyt"
    card = ModelCard.load(saved["gpt2"][0] / "README.md")
    assert card.data.library_name == "transformers"
    assert {"hf-normswap", "eln", "gpt2"} <= set(card.data.tags)
    text = card.text
    assert "x / sqrt(beta + x^2)" in text and "Stollenwerk" in text and "Zhu" in text
    assert "trust_remote_code=True" in text and "hf_normswap.load" in text
    assert "transformer.h.0.ln_1" in text and "No calibration data" in text
    dyt = ModelCard.load(saved["bert"][0] / "README.md")
    assert "tanh(alpha * x)" in dyt.text and "Stollenwerk" not in dyt.text
    assert "AutoModelForMaskedLM.from_pretrained" in dyt.text


def test_derf_model_card_gives_its_formula_and_both_citations(saved_derf):
    text = ModelCard.load(saved_derf["gpt2"][0] / "README.md").text
    assert "erf(alpha * x + shift)" in text and "Stronger Normalization-Free Transformers" in text
    assert "arXiv:2512.10938" in text and "Transformers without Normalization" in text and "Stollenwerk" not in text


def test_model_card_base_model_evaluation_and_calibration():
    config = {
        "model_type": "normswap_llama",
        "auto_map": {"AutoConfig": "x", "AutoModelForCausalLM": "y"},
        "normswap": {
            "method": "eln", "version": "0.1.0", "per_channel": False,
            "base": {"architecture": "LlamaForCausalLM", "config_class": "LlamaConfig", "model_type": "llama"},
            "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "converted": {"model.norm": {"kind": "rmsnorm", "role": "final", "size": 576, "amplitude": 24.0}},
            "calibration": {"dataset": "wikitext-2", "tokens": 65536, "keep_first_position": True},
            "evaluation": {"dataset": "wikitext-2 test", "metrics": {"perplexity": {"original": 20.0, "converted": 25.0}}},
        },
    }
    card = ModelCard(model_card.render(config))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "| perplexity | 20 | 25 | 1.25 |" in card.text
    assert "| tokens | 65536 |" in card.text and "wikitext-2 test" in card.text
    assert model_card.hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_card.hub_id("/tmp/some/local/dir") is None


@pytest.mark.parametrize("distill, loss", [
    ({"weight": 1.0, "temperature": 1.0, "logits": True, "hidden": 10.0, "embedding": 0.0},
     "distillation from the original alone, KL divergence to the original's logits (temperature 1) plus every "
     "block's output toward the original's (weight 10);"),
    ({"weight": 0.5, "temperature": 2.0, "logits": True, "hidden": 0.0, "embedding": 0.0},
     "causal-LM cross-entropy (0.5) and distillation (0.5), KL divergence to the original's logits (temperature 2);"),
    ({"weight": 1.0, "logits": False, "hidden": 1.0, "embedding": 1.0},
     "distillation from the original alone, every block's output toward the original's (weight 1) plus 1 - cosine "
     "of the pooled embedding to the original's (weight 1);"),
    ({"weight": 1.0, "temperature": 1.0, "logits": True, "hidden": 10.0, "scale": 3.0},
     "distillation from the original alone, KL divergence to the original's logits (temperature 1) plus every "
     "block's output toward the original's (weight 10) plus the spread of the final norm's input scale across "
     "tokens (weight 3);"),
    ({"weight": 0.0, "temperature": 1.0, "logits": True}, "causal-LM cross-entropy;"),
])
def test_model_card_names_the_recovery_loss_the_recipe_trained_with(distill, loss):
    """(1 - weight) * CE + weight * distillation: the SmolLM2 configs' weight 1 has no cross-entropy at all."""
    config = {"model_type": "normswap_llama", "normswap": {
        "method": "eln", "base": {"architecture": "LlamaForCausalLM", "config_class": "LlamaConfig", "model_type": "llama"},
        "converted": {},
        "training": {"distill": distill, "trainable": "all", "steps": 4, "tokens_seen": 4096,
                     "train_data": ["generated", "wiki.txt"], "wall_seconds": 1.0}}}
    text = ModelCard(model_card.render(config)).text
    assert f"(transformers `Trainer`): {loss} trained parameters: `all`" in text
    assert "4096 tokens of `generated + wiki.txt`" in text


def test_model_save_pretrained_writes_the_full_checkpoint(tmp_path):
    model = tiny_model("qwen3")
    hf_normswap.convert(model, to="eln")
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "modeling_normswap.py").is_file()
    reloaded = loading.load(tmp_path / "out")
    inputs = dummy_inputs(model)
    with torch.no_grad():
        assert torch.equal(first_tensor(model(**inputs)), first_tensor(reloaded(**inputs)))
    reloaded.save_pretrained(tmp_path / "again")  # a reloaded model saves the same way
    assert json.loads((tmp_path / "again" / "config.json").read_text())["normswap"]["base"]["architecture"] == \
        "Qwen3ForCausalLM"


def test_saving_into_a_trainer_output_dir_keeps_the_user_s_readme_and_rewrites_its_own_card(tmp_path):
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln")
    ours = tmp_path / "trainer-out"
    (ours / "checkpoint-1").mkdir(parents=True)
    model.save_pretrained(ours)  # no README yet: the card is written, and rewritten by the next save
    (ours / "README.md").write_text((ours / "README.md").read_text() + "\nstale line\n")
    model.save_pretrained(ours)
    assert "stale line" not in (ours / "README.md").read_text()
    assert model_card.is_own_card(ours / "README.md")

    theirs = tmp_path / "user-out"
    (theirs / "checkpoint-1").mkdir(parents=True)
    for text in ("# My experiment\nnotes\n", "---\ntags: [mine]\n---\nnotes\n", "---\n: : bad\n---\n"):
        (theirs / "README.md").write_text(text)
        model.save_pretrained(theirs)
        assert (theirs / "README.md").read_text() == text
        assert converted_config(theirs) and (theirs / "checkpoint-1").is_dir()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def _snapshot(root: Path, dir_mtimes: bool = True) -> dict:
    """Every path under root with size and mtime (directories' mtimes change when a temporary entry came and went)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns if dir_mtimes or not p.is_dir() else 0, p.stat().st_size,
                                       p.is_dir()) for p in root.rglob("*")}


def test_refused_output_directory_leaves_filesystem_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = _snapshot(tmp_path)
    # the model spec does not even exist: the output check must come first, before any loading or conversion
    code = cli.main(["convert", str(tmp_path / "no-such-model"), "--to", "eln", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "not empty" in err and "--overwrite" in err
    assert _snapshot(tmp_path) == before
    assert (out / "keep.txt").read_text() == "precious"


def test_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(checkpoint_dir.OutputExistsError, match="not a directory"):
        checkpoint_dir.check_output_dir(tmp_path / "file", overwrite=True)


def test_cli_convert_saves_and_overwrite_replaces(tmp_path, capsys):
    source = tmp_path / "source"
    tiny_model("gpt_neox").save_pretrained(source)
    out = tmp_path / "nested" / "out"
    assert cli.main(["convert", str(source), "--to", "dyt", "--calib", "none", "--output", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["normswap"]["method"] == "dyt"
    (out / "stale.txt").write_text("old")
    assert cli.main(["convert", str(source), "--to", "eln", "--calib", "none", "--output", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["convert", str(source), "--to", "eln", "--calib", "none", "--output", str(out),
                     "--overwrite"]) == 2
    assert "it holds more than a checkpoint (stale.txt)" in capsys.readouterr().err  # overwrite replaces only its own
    (out / "stale.txt").unlink()
    assert cli.main(["convert", str(source), "--to", "eln", "--calib", "none", "--output", str(out),
                     "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["normswap"]["method"] == "eln"
    model, _ = hf_normswap.checkpoint.loading.load_model(str(out), with_tokenizer=False)  # the CLI's loader reads it back
    assert isinstance(model.get_submodule("gpt_neox.final_layer_norm"), hf_normswap.ELN)
    assert sorted(os.listdir(out.parent)) == ["out"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_save_leaves_no_half_checkpoint(tmp_path, monkeypatch, interrupt, existing):
    model = tiny_model("phi")
    hf_normswap.convert(model, to="eln")
    out = tmp_path / "parent" / "out"
    if existing:
        hf_normswap.save_pretrained(model, out)
    before = _snapshot(tmp_path, dir_mtimes=False)

    def fail(config):
        raise interrupt("interrupted")

    monkeypatch.setattr(model_card, "render", fail)  # dies after the weights are written into the staging dir
    with pytest.raises(interrupt):
        hf_normswap.save_pretrained(model, out, overwrite=True)
    assert _snapshot(tmp_path, dir_mtimes=False) == before  # no partial dir, and not even the created parent when it was new


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The packaged SmolLM2-135M-Instruct (GGUF), converted to ELN and saved with its tokenizer (loaded once)."""
    from hf_normswap.checkpoint.packaged import PackagedModelMissing, packaged_path

    try:
        path = packaged_path("offline:smollm2")
    except PackagedModelMissing as missing:
        pytest.skip(str(missing))
    if not path.is_file():
        pytest.skip(f"packaged SmolLM2 file missing: {path}")
    model, tokenizer = hf_normswap.checkpoint.loading.load_model("offline:smollm2")
    hf_normswap.convert(model, to="eln", input_scale=1.0)  # the theory's start: what is saved, not its quality
    directory = tmp_path_factory.mktemp("smollm2") / "smollm2-eln"
    hf_normswap.save_pretrained(model, directory, tokenizer=tokenizer, base_model=model_card.hub_id("offline:smollm2"))
    return model, tokenizer, directory


@pytest.mark.packaged
def test_smollm2_eln_saves_reloads_bit_exact_and_generates(smollm2, capsys):
    model, tokenizer, directory = smollm2
    reloaded, saved_tokenizer = hf_normswap.checkpoint.loading.load_model(str(directory))
    assert "custom code" not in capsys.readouterr().out  # the tokenizer did not ask the remote-code question
    assert type(reloaded).__name__ == "NormSwapLlamaForCausalLM" and saved_tokenizer is not None
    prompt = "The capital of France is"
    encoded = tokenizer(prompt, return_tensors="pt")
    assert torch.equal(saved_tokenizer(prompt, return_tensors="pt")["input_ids"], encoded["input_ids"])
    with torch.no_grad():
        reference = model(**encoded).logits
        output = reloaded(**encoded).logits
    assert reference.dtype == torch.float32 and torch.isfinite(reference).all()
    assert torch.equal(output, reference)
    # Without calibration this model amplifies rounding chaotically (the KV-cache path and a full forward already
    # disagree within ONE model), so greedy decoding is compared on full forwards, which are bit-exact.
    exact = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(reloaded.generate(**encoded, **exact), model.generate(**encoded, **exact))
    generated = reloaded.generate(**encoded, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new_tokens = generated[0, encoded["input_ids"].shape[1]:]
    assert len(new_tokens) == 6 and new_tokens[0] == reference[0, -1].argmax()
    assert saved_tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config  # saved dense, loads without the GGUF file
    assert config["normswap"]["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert len(config["normswap"]["converted"]) == 61 == sum(isinstance(m, hf_normswap.ELN) for m in reloaded.modules())
    assert ModelCard.load(directory / "README.md").data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_an_empty_load_is_the_loaded_model_on_the_meta_device_with_its_buffers(model_type, tmp_path, monkeypatch):
    """``load_model(empty=True)`` (a sharded run's processes that receive their shards): the class, parameters
    (names, shapes, dtypes, ties) and buffers of the loaded model, no weight read, for an original and for a
    converted checkpoint."""
    original = tiny_model(model_type, tie_word_embeddings=True)
    original.save_pretrained(tmp_path / "original")
    model = tiny_model(model_type, tie_word_embeddings=True)
    hf_normswap.convert(model, to="eln")
    hf_normswap.save_pretrained(model, tmp_path / "converted")
    for directory in ("original", "converted"):
        loaded, _ = loading.load_model(str(tmp_path / directory), with_tokenizer=False)
        monkeypatch.setattr(transformers.PreTrainedModel, "_load_pretrained_model", None)  # any read would fail
        empty, _ = loading.load_model(str(tmp_path / directory), with_tokenizer=False, empty=True)
        monkeypatch.undo()
        assert type(empty) is type(loaded)
        params = {n: (p.shape, p.dtype) for n, p in loaded.named_parameters()}
        assert {n: (p.shape, p.dtype) for n, p in empty.named_parameters()} == params
        assert all(p.is_meta for p in empty.parameters())
        assert empty.get_output_embeddings().weight is empty.get_input_embeddings().weight
        buffers = dict(loaded.named_buffers())
        assert buffers.keys() == dict(empty.named_buffers()).keys()
        for name, buffer in empty.named_buffers():
            assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name
