"""Fault injection: tampered checkpoints, bad options and corrupt inputs, and saves killed at random moments.

Each case asserts the one-line error (or the refusal), the exit code, and that nothing the user owned was lost or
executed. Tiny models only; the kills run in subprocesses with fixed seeds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch

import hf_normswap
from hf_normswap.checkpoint import directory as checkpoint_dir
from hf_normswap.checkpoint.record import converted_config
from hf_normswap.conversion import run as conversion_run
from hf_normswap.training import recipe_models, recipe_settings
from hf_normswap.validation import ValidationError
from cli_runs import file_tree, recipe_refusal, run_cli as _cli
from tiny_models import tiny_model

PAYLOAD = "LlamaConfig, LlamaForCausalLM #\n-__import__('os').system('touch PWNED')"


pytestmark = pytest.mark.usefixtures("one_thread")


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# ---------------------------------------------------------------------------------- code from a config.json


@pytest.mark.parametrize("key", ["config_class", "architecture", "model_type"])
def test_code_in_config_class_is_refused_and_never_runs(converted, tmp_path, monkeypatch, capsys, key):
    monkeypatch.chdir(tmp_path)
    tampered = _copy(converted, tmp_path / "tampered")
    _edit_config(tampered, lambda c: c["normswap"]["base"].__setitem__(key, PAYLOAD))
    with pytest.raises(ValidationError, match=f"normswap.base.{key}") as refused:
        hf_normswap.load(tampered).save_pretrained(tmp_path / "other")
    assert "\n" not in str(refused.value)
    code, line = _cli(["eval", tampered, "--max-tokens", "8"], capsys)
    assert code == 2 and f"normswap.base.{key}" in line
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "other").exists()


def test_code_in_a_loaded_models_block_is_refused_when_saving(converted, tmp_path, monkeypatch):
    """The block of a model already in memory (edited after load) is checked again before code is generated."""
    monkeypatch.chdir(tmp_path)
    model = hf_normswap.load(converted)
    model.config.normswap["base"]["config_class"] = PAYLOAD
    with pytest.raises(ValidationError, match="normswap.base.config_class"):
        model.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "other").exists()


# --------------------------------------------------------------------------------------- saving deletes nothing


def test_overwrite_of_a_directory_holding_other_files_is_refused(tmp_path, monkeypatch, capsys):
    """`convert MODEL --output . --overwrite` in a directory with the source model and other files."""
    monkeypatch.chdir(tmp_path)
    tiny_model("llama").save_pretrained(tmp_path / "source")
    (tmp_path / "notes.txt").write_text("mine")
    before = file_tree(tmp_path)
    code, line = _cli(["convert", "source", "--to", "eln", "--calib", "none", "--output", ".", "--overwrite"], capsys)
    assert code == 2 and "not empty and not a checkpoint saved by hf_normswap" in line and "new or empty" in line
    assert file_tree(tmp_path) == before


def test_trainer_save_model_leaves_sibling_checkpoints(tmp_path):
    """Trainer.save_model() -> model.save_pretrained(output_dir): checkpoint-N folders and other files stay."""
    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln")
    out = tmp_path / "out"
    for step in (1, 2):
        model.save_pretrained(out / f"checkpoint-{step}")  # what the Trainer's checkpointing does, into empty folders
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    before = file_tree(out)
    model.save_pretrained(out)  # Trainer.save_model()
    model.save_pretrained(out)  # again: replaces its own files in place
    after = file_tree(out)
    assert {k: v for k, v in after.items() if k in before} == before
    assert converted_config(out)["normswap"]["method"] == "eln"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    model.save_pretrained(out / "worker", is_main_process=False)  # other ranks write nothing
    assert not (out / "worker").exists()


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_unwritable_output_is_refused_before_loading(tmp_path, capsys, kind):
    if kind == "file":
        output = tmp_path / "taken"
        output.write_text("mine")
        expected = "not a directory"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        output = tmp_path / "ro" / "out"
        expected = "permission denied"
    code, line = _cli(["convert", tmp_path / "no-such-model", "--to", "eln", "--output", output], capsys)
    if kind == "read-only":
        (tmp_path / "ro").chmod(0o755)
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
    assert code == 2 and expected in line


# ---------------------------------------------------------------------------------------- saves killed midway


class _KillAt:
    """Count the filesystem steps of a save (mkdir, writes, renames, removals) and send a signal at step ``at``."""

    def __init__(self, at: int, signum: int):
        self.at, self.signum, self.count = at, signum, 0

    def step(self):
        self.count += 1
        if self.count == self.at:
            if self.signum == signal.SIGINT:  # Ctrl-C at exactly this step: Python runs a signal's handler later,
                raise KeyboardInterrupt      # which can land in a finalizer that swallows it and let the save finish
            os.kill(os.getpid(), self.signum)

    def install(self):
        import builtins
        import io

        def counted(function, writes_only=False):
            def wrapper(*args, **kwargs):
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
                if not writes_only or any(c in mode for c in "wax+"):
                    self.step()
                return function(*args, **kwargs)
            return wrapper

        for module, name in ((os, "rename"), (os, "replace"), (os, "mkdir"), (os, "unlink"), (os, "rmdir"),
                             (shutil, "rmtree")):
            setattr(module, name, counted(getattr(module, name)))
        builtins.open = io.open = counted(io.open, writes_only=True)


def _save_in_child(model, out: Path, at: int, signum: int) -> int:
    """Fork; the child saves ``model`` over ``out`` and is signalled at its ``at``-th step. Returns the wait status."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            _KillAt(at, signum).install()
            hf_normswap.save_pretrained(model, out, overwrite=True)
        except BaseException:
            code = 1
        os._exit(code)
    return os.waitpid(pid, 0)[1]


def _computes_like(directory: Path, model) -> bool:
    """Whether the checkpoint at ``directory`` computes the logits ``model`` computes."""
    inputs = {"input_ids": torch.arange(8)[None]}
    with torch.no_grad():
        return torch.equal(hf_normswap.load(directory)(**inputs).logits, model(**inputs).logits)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_save_killed_at_every_step_leaves_old_or_new_and_is_cleaned_up(tmp_path):
    """An overwrite of an ELN checkpoint by a DyT one, killed (SIGKILL / SIGTERM / SIGINT, chosen by a fixed seed)
    at each of its filesystem steps in turn: the name holds the whole old or the whole new checkpoint once the next
    save into the same place has run its recovery, and nothing is left beside it."""
    old, new = tiny_model("llama"), tiny_model("llama")
    hf_normswap.convert(old, to="eln")
    hf_normswap.convert(new, to="dyt")
    trees = {}
    for method, model in (("eln", old), ("dyt", new)):
        hf_normswap.save_pretrained(model, tmp_path / method)
        trees[method] = file_tree(tmp_path / method)
    out = tmp_path / "ckpt"
    steps = _count_steps(new, tmp_path / "count")
    assert steps >= 8  # mkdir, weights, config, remote code, card, two renames, removal of the old copy
    rng = random.Random(15)
    seen = set()
    for at in range(1, steps + 2):  # steps + 1: never reached, the save completes
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp_path / "eln", out)
        signum = rng.choice([signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
        status = _save_in_child(new, out, at, signum)
        completed = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert completed if at > steps else not completed, (at, status)  # killed at each step, the last one saves
        checkpoint_dir.recover_interrupted(out)  # what the next save into the same place runs first
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == [], at
        method = converted_config(out)["normswap"]["method"]
        assert file_tree(out) == trees[method], (at, method)  # the whole old or the whole new checkpoint, byte for byte
        seen.add(method)
    assert seen == {"eln", "dyt"}
    assert _computes_like(out, new)  # the survivor loads and computes what the saved model computed


def _count_steps(model, directory: Path) -> int:
    """Steps of one complete overwrite, counted in a child that is never signalled."""
    counter = _KillAt(0, 0)
    hf_normswap.save_pretrained(model, directory)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        counter.install()
        hf_normswap.save_pretrained(model, directory, overwrite=True)
        os.write(write, str(counter.count).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    return int(os.read(read, 32))


# ------------------------------------------------------------------------------------- tampered normswap block

LAYER = "model.layers.0.input_layernorm"


def _entry(config):
    return config["normswap"]["converted"][LAYER]


TAMPERED = {
    "bias on a module without one": (lambda c: _entry(c).update(bias=True), f"{LAYER}.bias"),
    "method changed on one module": (lambda c: _entry(c).update(method="dyt"), f"{LAYER}.method"),
    "unknown method": (lambda c: c["normswap"].update(method="batchnorm"), "normswap.method"),
    "entry dropped": (lambda c: c["normswap"]["converted"].pop(LAYER), f"{LAYER} is missing"),
    "entry on a non-norm module": (lambda c: c["normswap"]["converted"].__setitem__("model.layers.0.mlp", _entry(c)),
                                   "normswap.converted.model.layers.0.mlp: the weights hold no norm"),
    "unknown module": (lambda c: c["normswap"]["converted"].__setitem__("model.nothing", _entry(c)),
                       "normswap.converted.model.nothing"),
    "shape changed": (lambda c: _entry(c).update(normalized_shape=[16]), f"{LAYER}.normalized_shape"),
    "per-channel flipped": (lambda c: _entry(c).update(per_channel=True), f"{LAYER}.per_channel"),
    "amplitude NaN": (lambda c: _entry(c).update(amplitude=float("nan")), f"{LAYER}.amplitude"),
    "entry not an object": (lambda c: c["normswap"]["converted"].__setitem__(LAYER, 3), LAYER),
    "block not an object": (lambda c: c["normswap"].update(base=[]), "normswap.base"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_block_is_one_line_naming_the_key(converted, tmp_path, capsys, case):
    edit, key = TAMPERED[case]
    tampered = _copy(converted, tmp_path / "tampered")
    _edit_config(tampered, edit)
    before = file_tree(tampered)
    code, line = _cli(["inspect", tampered], capsys)
    assert code == 2 and key in line, line
    with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
        hf_normswap.load(tampered)
    assert file_tree(tampered) == before


def test_tampered_block_fails_eval_too(converted, tmp_path, capsys):
    tampered = _copy(converted, tmp_path / "tampered")
    _edit_config(tampered, TAMPERED["bias on a module without one"][0])
    code, line = _cli(["eval", tampered, "--max-tokens", "8"], capsys)
    assert code == 2 and f"{LAYER}.bias" in line


@pytest.mark.parametrize("name, message", [("model.layers.0.mlp", "is a LlamaMLP, not a LayerNorm or RMSNorm"),
                                           ("model.nothing", "has no module of that name")])
def test_block_names_must_be_norms_of_the_architecture(name, message):
    from hf_normswap.checkpoint.config_checks import check_block_against_model
    from hf_normswap.checkpoint.record import ConversionRecord, NormEntry

    record = ConversionRecord("eln", {name: NormEntry(kind="rmsnorm", size=32, amplitude=1.0, normalized_shape=[32])})
    with pytest.raises(ValidationError, match=message):
        check_block_against_model(tiny_model("llama"), record)


# ------------------------------------------------------------------------- options checked before any work

MISSING = "/nonexistent/model/dir"  # if an option passed its check, the error would be "model not found"


@pytest.mark.parametrize("flags, message", [
    (["--input-scale", "nan"], "--input-scale must be a finite number"),
    (["--input-scale", "inf"], "--input-scale must be a finite number"),
    (["--input-scale", "1e200"], "--input-scale must be at most 1e+06"),
    (["--input-scale", "-1"], "--input-scale must be positive"),
    (["--calib-blocks", "0"], "--calib-blocks must be a whole number of at least 1"),  # checked even without --calib
    (["--calib-len", "-5"], "--calib-len must be a whole number of at least 1"),
    (["--max-tokens-per-norm", "0"], "--max-tokens-per-norm must be a whole number of at least 1"),
    (["--eval", "builtin", "--eval-batch-size", "0"], "--eval-batch-size must be at least 1"),
    (["--roles", "attention"], "unknown role"),
    (["--include", "("], "not a valid regular expression"),
    (["--exclude", "[a-"], "not a valid regular expression"),
])
def test_bad_numbers_and_patterns_fail_before_the_model_loads(capsys, flags, message):
    code, line = _cli(["convert", MISSING, "--to", "dyt", *flags], capsys)
    assert code == 2 and message in line, line


def test_inspect_checks_roles_before_loading(capsys):
    code, line = _cli(["inspect", MISSING, "--roles", "attention"], capsys)
    assert code == 2 and "unknown role" in line


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, 1e200])
def test_api_input_scale_is_checked(value):
    model = tiny_model("llama")
    with pytest.raises(ValidationError, match="input_scale"):
        hf_normswap.convert(model, "dyt", input_scale=value)
    assert not hasattr(model.config, "normswap")  # nothing was converted


def test_output_paths_are_checked_before_loading(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_text("")
    cases = [
        (["--report", tmp_path], "is a directory"),
        (["--report", tmp_path / "missing" / "r.json"], "directory does not exist"),
        (["--eval", tmp_path / "empty.txt"], "--eval"),
        (["--calib", tmp_path / "empty.txt"], "--calib"),
        (["--calib", "builtin", "--plots", tmp_path / "empty.txt"], "--plots"),
    ]
    for flags, message in cases:
        code, line = _cli(["convert", MISSING, "--to", "eln", *flags], capsys)
        assert code == 2 and message in line, line
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, line = _cli(["convert", MISSING, "--to", "eln", "--push-to-hub", "me/model"], capsys)
    assert code == 2 and "HF_HUB_OFFLINE is set" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_failed_save_keeps_the_converted_model_and_says_where(tmp_path, monkeypatch, capsys):
    """The output vanishes under the run (here: the save into it fails); the converted model lands elsewhere."""
    tiny_model("llama").save_pretrained(tmp_path / "source")
    real_save = conversion_run.save_pretrained

    def failing(model, directory, **kwargs):
        if Path(directory) == tmp_path / "out":
            raise OSError(28, "No space left on device")
        return real_save(model, directory, **kwargs)

    monkeypatch.setattr(conversion_run, "save_pretrained", failing)
    code, line = _cli(["convert", tmp_path / "source", "--to", "eln", "--calib", "none", "--output", tmp_path / "out"],
                      capsys)
    assert code == 2 and "No space left on device" in line
    kept = Path(line.split("kept in ")[1].split(":")[0])
    assert converted_config(kept)["normswap"]["method"] == "eln"
    hf_normswap.load(kept)
    shutil.rmtree(kept.parent)


def test_failed_push_without_output_keeps_the_converted_model(tmp_path, monkeypatch, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "source")
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    code, line = _cli(["convert", tmp_path / "source", "--to", "dyt", "--calib", "none", "--push-to-hub", "me/model"],
                      capsys)
    assert code == 2 and "cannot reach the Hub" in line and "normswap push" in line
    kept = Path(line.split("kept in ")[1].split(": push it")[0])
    assert converted_config(kept)["normswap"]["method"] == "dyt"
    shutil.rmtree(kept.parent)


# -------------------------------------------------------------------------------------------- corrupt inputs


def _corrupt(directory: Path, case: str) -> str:
    weights = directory / "model.safetensors"
    config = directory / "config.json"
    if case == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return "incomplete metadata"
    if case == "garbage safetensors":
        weights.write_bytes(random.Random(15).randbytes(4096))
        return "Error while deserializing header"
    if case == "config.json a list":
        config.write_text("[1, 2]")
        return "config.json holds a JSON list"
    if case == "config.json not JSON":
        config.write_text("{not json")
        return "config.json is not readable JSON"
    edited = json.loads(config.read_text())
    edited["hidden_size"] = -32
    config.write_text(json.dumps(edited))
    return "config.json hidden_size is -32"


CORRUPTIONS = ["truncated safetensors", "garbage safetensors", "config.json a list", "config.json not JSON",
               "negative hidden_size"]


@pytest.mark.parametrize("case", CORRUPTIONS)
@pytest.mark.parametrize("kind", ["original", "converted"])
def test_corrupt_model_files_are_one_line(converted, tmp_path, capsys, case, kind):
    directory = tmp_path / "model"
    if kind == "converted":
        _copy(converted, directory)
    else:
        tiny_model("llama").save_pretrained(directory)
    message = _corrupt(directory, case)
    before = file_tree(directory)
    for command in (["inspect", directory],
                    ["convert", directory, "--to", "eln", "--calib", "none", "--output", tmp_path / "out"]):
        code, line = _cli(command, capsys)
        assert code == 2 and message in line, line
    assert file_tree(directory) == before and not (tmp_path / "out").exists()


def test_non_utf8_data_names_the_encoding(tmp_path):
    from hf_normswap.data import DataError, load_texts

    (tmp_path / "latin1.txt").write_bytes("caf\xe9 na\xefve".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_texts(str(tmp_path / "latin1.txt"))


# ------------------------------------------------------------------------------------------ the finetune recipe


@pytest.mark.parametrize("argv, message", [
    (["lr.bse=0.5"], "unknown setting lr.bse: did you mean lr.base?"),
    (["distill.wieght=0"], "unknown setting distill.wieght: did you mean distill.weight?"),
    (["training.max_stepz=3"], "unknown setting training.max_stepz: did you mean training.max_steps?"),
    (["modle=offline:smollm2"], "unknown setting modle: did you mean model?"),
    (["method=foo"], "method 'foo' is unknown"),
    (["trainable=some"], "setting trainable: Invalid value 'some', expected one of ['norms', 'all', 'lora']"),
    (["calibration.num_blocks=0"], "calibration: num_blocks must be a whole number of at least 1, got 0"),
    (["calibration.strategy=blok"], "calibration: unknown calibration strategy 'blok'"),
    (["calibration.device=nonsense"], "calibration: calibration device 'nonsense' is not a torch device"),
    (["calibration.cache_memory_mb=-1"], "calibration: cache_memory_mb must be at least 0"),
    (["block_len=-5"], "block_len must be at least 1"),
    (["lr.base=.nan"], "lr.base must be a finite number"),
    (["distill.temperature=0"], "distill.temperature must be at least"),
    (["max_minutes=-1"], "max_minutes must be at least 0"),
    (["lr=0.5"], "setting lr must be a section of settings"),
    (["progressive.enabled=true", "trainable=lora"], "progressive conversion works with trainable: norms or all"),
    (["--config", "/nonexistent/config.yaml"], "--config /nonexistent/config.yaml"),
    (["noequals"], "is not KEY=VALUE"),
])
def test_recipe_refuses_bad_settings_in_one_line_before_loading(capsys, argv, message):
    assert message in recipe_refusal(argv, capsys)


def _alias_bomb(levels: int = 6, width: int = 6) -> str:
    """YAML whose last anchor expands to width ** levels strings (9 of 9 ends in a MemoryError)."""
    lines = ["a0: &a0 [x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["train_data: *a5", "progressive: {role_order: *a5}", "training: {fsdp_config: *a5}"])
def test_a_yaml_alias_is_refused_in_one_line_before_anything(tmp_path, where):
    from hf_normswap.training.config import read_recipe_config

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb() + where + "\n")
    with pytest.raises(ValidationError, match=r"anchors and aliases \(&name, \*name\) are not read \(line 1\)") as error:
        read_recipe_config(str(path), [])
    assert str(error.value).startswith(f"--config {path}") and "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"]


@pytest.mark.parametrize("text, overrides, message", [
    ("lr: {base: 1e-4}\nlr: {base: 1e-3}\n", [], "'lr' is given twice (line 2); keep one"),
    ("distill:\n  weight: 0.1\n  weight: 0.2\n", [], "'weight' is given twice (line 3); keep one"),
    ("", ["output_dir=${oc.env:HF_TOKEN}"], "interpolations (${...}) are not read"),
    ("push_to_hub: ${oc.env:HF_TOKEN}\n", [], "interpolations (${...}) are not read"),
    ("", ["lr=0.5"], "setting lr must be a section of settings, got 0.5"),
])
def test_a_key_given_twice_or_an_interpolation_is_one_line(tmp_path, text, overrides, message):
    from hf_normswap.training.config import read_recipe_config

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValidationError) as error:
        read_recipe_config(str(path), overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_learning_rate_users_type_is_a_float_and_the_last_override_wins():
    from hf_normswap.training.config import read_recipe_config

    assert read_recipe_config(None, ["lr.base=1e-3"]).lr.base == pytest.approx(1e-3)
    assert read_recipe_config(None, ["lr.base=1e-4", "lr.base=1e-3"]).lr.base == pytest.approx(1e-3)


def test_a_config_file_not_utf8_or_too_large_is_one_line(tmp_path):
    from hf_normswap.settings import MAX_SETTINGS_BYTES
    from hf_normswap.training.config import read_recipe_config

    (tmp_path / "latin1.yaml").write_bytes("model: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValidationError, match=r"latin1.yaml: not UTF-8 text \(byte 0xe9 at offset 10\)"):
        read_recipe_config(str(tmp_path / "latin1.yaml"), [])
    (tmp_path / "big.yaml").write_text("model: x\n" + "#" * MAX_SETTINGS_BYTES)
    with pytest.raises(ValidationError, match="is not a settings file"):
        read_recipe_config(str(tmp_path / "big.yaml"), [])


def test_recipe_refuses_a_save_dir_holding_other_files_before_loading(tmp_path, capsys):
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(SystemExit) as exit:
        recipe_settings.load_config([f"save_dir={tmp_path}"])
    assert exit.value.code == 2 and "not a checkpoint saved by hf_normswap" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]


def test_recipe_config_file_must_be_a_mapping(tmp_path, capsys):
    (tmp_path / "list.yaml").write_text("- model\n- method\n")
    with pytest.raises(SystemExit) as exit:
        recipe_settings.load_config(["--config", str(tmp_path / "list.yaml")])
    assert exit.value.code == 2 and "expected a mapping of settings" in capsys.readouterr().err


def test_recipe_accepts_its_shipped_configs():
    for config in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("configs/*.yaml")):
        assert recipe_settings.load_config(["--config", str(config)]).method in ("eln", "dyt")


def test_recipe_sets_a_pad_token_when_the_tokenizer_has_none():
    """Like GPT-2's and Llama's tokenizers: EOS, no pad; the Trainer's collator then pads with EOS."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "a": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                        eos_token="<eos>")
    assert tokenizer.pad_token is None
    recipe_models.ensure_pad_token(tokenizer)
    assert tokenizer.pad_token == "<eos>"
    assert tokenizer.pad([{"input_ids": [2]}, {"input_ids": [2, 2]}])["input_ids"] == [[2, 1], [2, 2]]


def test_loading_never_asks_to_run_custom_code(converted, tmp_path, monkeypatch, capsys):
    """A checkpoint naming remote code (here: a converted one whose normswap block was removed) is refused, never
    met with transformers' interactive "run custom code?" question."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    tampered = _copy(converted, tmp_path / "tampered")
    _edit_config(tampered, lambda c: c.pop("normswap"))
    code, line = _cli(["eval", tampered, "--max-tokens", "8"], capsys)
    assert code == 2 and "custom code" in line and asked == []


def test_leftovers_of_dead_saves_go_and_those_of_running_saves_stay(converted, tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getppid()
    out = tmp_path / "ckpt"
    for pid, kind in ((dead_pid, "partial"), (live_pid, "partial")):
        (tmp_path / f".ckpt.{kind}-{pid}-0a1b2c3d").mkdir()
    shutil.copytree(converted, tmp_path / f".ckpt.old-{dead_pid}-0a1b2c3d")  # an overwrite killed between renames
    users = [".ckpt.old-backup", ".ckpt.partial-mine", f".ckpt.old-{dead_pid}-notes",  # named alike, not a save's
             ".ckpt.old-20250101", ".ckpt.partial-backup_1"]
    for name in users:
        (tmp_path / name).mkdir()
    checkpoint_dir.recover_interrupted(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".ckpt.partial-{live_pid}-0a1b2c3d", "ckpt", *users])
    assert file_tree(out) == file_tree(converted)  # the checkpoint an interrupted overwrite had moved aside is back


@pytest.mark.parametrize("command", [["inspect", MISSING], ["eval", MISSING]])
def test_a_cpu_index_past_the_one_cpu_device_is_refused(capsys, command):
    code, line = _cli([*command, "--device", "cpu:99"], capsys)
    assert code == 2 and "--device 'cpu:99': the CPU is one device" in line, line


# ----------------------------------------------------------------------------------- the original's samples


@pytest.mark.parametrize("spec, message", [
    ("generated:length=1", "length must be at least 2 (the start token and one sampled), got 1"),
    ("generated:batch_size=1000000000", "batch_size must be at most 4096"),
    ("generated:length=16,seed=1,length=32", "length is given twice"),
    ("generated:prompt=/nonexistent/p.txt,length=32", "data file not found: /nonexistent/p.txt"),
])
def test_sampling_settings_are_refused_in_one_line_before_loading(capsys, spec, message):
    """length=1 failed after loading ("max_new_tokens must be greater than 0"), a billion-row batch in its first
    allocation, a key given twice took its last value, and a missing prompt file was found only once sampling."""
    code, line = _cli(["convert", MISSING, "--to", "eln", "--calib", spec], capsys)
    assert code == 2 and message in line, line


def test_a_prompt_before_other_keys_leaves_them_their_own(tmp_path):
    from hf_normswap.data import generation_settings

    files = f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}"
    settings = generation_settings(f"generated:prompt={files},length=32,batch_size=4")
    assert (settings.prompt, settings.length, settings.batch_size) == (files, 32, 4)


@pytest.mark.parametrize("method, held", [("derf", ("log_alpha",)), ("dyt", ("log_alpha", "shift"))])
def test_derf_and_dyt_weights_are_told_apart_by_the_shift(method, held):
    """DyT and Derf both store log_alpha: a block that names one for the other's weights is refused by the shift."""
    from hf_normswap.checkpoint.config_checks import check_block_against_weights
    from hf_normswap.checkpoint.record import ConversionRecord, NormEntry

    record = ConversionRecord(method, {"norm": NormEntry(kind="rmsnorm", size=4, amplitude=2.0, normalized_shape=[4],
                                                         bias=False)})
    shapes = {"norm.weight": (4,), **{f"norm.{name}": () for name in held}}
    with pytest.raises(ValidationError, match=rf"normswap\.converted\.norm\.method: {method}, but the weights hold"):
        check_block_against_weights(record, shapes)
    check_block_against_weights(dataclasses.replace(record, method="dyt" if method == "derf" else "derf"), shapes)
