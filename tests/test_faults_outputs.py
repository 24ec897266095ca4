"""Fault injection on what the command line writes and reads: a finished conversion is never lost, user folders
beside an output are never touched, weights are checked where transformers reads them, links are followed.

Each case asserts the one-line error and exit code 2, and that the converted model was kept (and loads) or that
every file the user had is byte-for-byte as before. Tiny models only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from safetensors import SafetensorError

import hf_normswap
from hf_normswap import cli
from hf_normswap.checkpoint import directory as checkpoint_dir
from hf_normswap.checkpoint.publish import keep
from hf_normswap.checkpoint.record import converted_config
from hf_normswap.conversion import evaluation as conversion_evaluation
from cli_runs import file_tree, run_cli as _cli
from hub_mirror import TOKEN, HubMirror
from tiny_models import tiny_model, tiny_tokenizer

ANALYTIC = ("--calib", "none")  # the analytic start: quick, and enough for what these tests check

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The model reads the text. The norm of the data is the scale of the model.\n" * 40


def check_settled(config):
    """``recipe_data.check_data`` as the recipe calls it, once the run is resolved."""
    from hf_normswap.training.recovery_run import converted_checkpoint
    from hf_normswap.training import recipe_data

    recipe_data.check_data(config, converted_checkpoint(config.model) is None)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama (64 positions) with a tokenizer, and a text file."""
    root = tmp_path_factory.mktemp("source")
    tiny_model("llama").save_pretrained(root / "llama")
    tiny_tokenizer().save_pretrained(root / "llama")
    (root / "text.txt").write_text(TEXT)
    return root


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """TMPDIR of the command: what it keeps there, or leaves behind, is seen."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ------------------------------------------------------------------------------------ nothing finished is lost


def test_a_full_disk_keeps_the_conversion(source, tmp_path, temp_dir, monkeypatch, capsys):
    """safetensors' writer fails on a full disk with its own error, not an OSError."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_save_file

    def full_disk(tensors, filename, **kwargs):
        if Path(filename).parent.parent == tmp_path:  # the staging folder beside --output
            Path(filename).write_bytes(b"\0" * 100)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    code, line = _cli(["convert", source / "llama", "--to", "eln", *ANALYTIC, "--output", tmp_path / "out"], capsys)
    assert code == 2 and "cannot save to" in line and "No space left on device" in line, line
    kept = Path(line.split("kept in ")[1].split(": move")[0])
    assert kept.parent.parent == temp_dir and hf_normswap.load(kept).config.normswap["method"] == "eln"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # no staging folder, no half-written output


def test_a_report_that_cannot_be_written_does_not_cost_the_checkpoint(source, tmp_path, capsys):
    """/dev/full passes the check (a writable file) and fails the write with ENOSPC."""
    code, line = _cli(["convert", source / "llama", "--to", "eln", *ANALYTIC, "--output", tmp_path / "out", "--report",
                       "/dev/full"], capsys)
    assert code == 2 and "cannot write --report /dev/full" in line and f"saved in {tmp_path / 'out'}" in line
    assert hf_normswap.load(tmp_path / "out").config.normswap["method"] == "eln"


def test_a_blank_eval_file_is_refused_before_loading(source, tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n   \n\t\n")
    code, line = _cli(["convert", source / "llama", "--to", "eln", *ANALYTIC, "--output", tmp_path / "out", "--eval",
                       tmp_path / "blank.txt"], capsys)
    assert code == 2 and "--eval" in line and "no text (the files are empty or blank)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt"]


@pytest.mark.parametrize("command, flag", [
    (["convert", "{model}", "--to", "eln", *ANALYTIC,
      "--output", "{out}", "--eval", "{text}", "--eval-max-length", "65"],
     "--eval-max-length"),
    (["eval", "{model}", "--data", "{text}", "--max-length", "65"], "--max-length"),
    (["sensitivity", "{model}", "--to", "eln", "--data", "{text}", "--window-len", "65"], "--window-len"),
    (["convert", "{model}", "--to", "eln", "--output", "{out}", "--calib", "{text}", "--calib-len", "65"],
     "--calib-len"),  # calibration cut it to the context silently
    (["sensitivity", "{model}", "--to", "eln", "--data", "{text}", "--calib", "{text}", "--calib-len", "65"],
     "--calib-len"),
    (["convert", "{model}", "--to", "eln", "--output", "{out}", "--eval", "generated:length=65"],
     "--eval generated: length"),  # sampled after the conversion
])
def test_windows_longer_than_the_context_are_refused_before_any_work(source, tmp_path, capsys, command, flag):
    filled = [a.format(model=source / "llama", out=tmp_path / "out", text=source / "text.txt") for a in command]
    code, line = _cli(filled, capsys)
    assert code == 2 and f"{flag} 65 is longer than the context of" in line and "(64 tokens)" in line, line
    assert list(tmp_path.iterdir()) == []


def test_eval_against_a_longer_context_scores_within_the_shorter_one(source, tmp_path, capsys):
    """The default window came from the reference (--against): 128 positions against the model's 64."""
    tiny_model("llama", max_position_embeddings=128).save_pretrained(tmp_path / "long")
    code = cli.main(["eval", str(source / "llama"), "--against", str(tmp_path / "long"), "--data",
                     str(source / "text.txt"), "--max-tokens", "200", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["max_length"] == 64


def test_an_evaluation_failing_after_the_conversion_keeps_it(source, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(conversion_evaluation, "evaluate", broken)
    code, line = _cli(["convert", source / "llama", "--to", "dyt", *ANALYTIC, "--output", tmp_path / "out", "--eval",
                       source / "text.txt"], capsys)
    assert code == 2 and "--eval failed (out of memory)" in line and f"without its evaluation, in {tmp_path / 'out'}" in line
    assert hf_normswap.load(tmp_path / "out").config.normswap["method"] == "dyt"


# -------------------------------------------------------------------------------- a converted model converted


def test_converting_a_converted_checkpoint_is_refused_before_calibration(converted, tmp_path, temp_dir, capsys):
    code, line = _cli(["convert", converted, "--to", "dyt", "--output", tmp_path / "out", "--calib", "builtin",
                       "--calib-blocks", "1", "--calib-len", "8"], capsys)
    assert code == 2 and "the model is converted already" in line and "convert its original" in line
    assert list(temp_dir.iterdir()) == [] and not (tmp_path / "out").exists()


def test_a_failed_keep_leaves_no_temporary_folder(tmp_path, temp_dir):
    def unsavable(directory):
        raise OSError(28, "No space left on device")

    with pytest.raises(checkpoint_dir.CheckpointError, match="not even to a temporary directory"):
        keep(unsavable, "checkpoint")
    assert list(temp_dir.iterdir()) == []


# ------------------------------------------------------------------------------ cleanup touches only its own


def test_folders_named_like_a_saves_leftovers_are_the_users(converted, source, tmp_path, capsys):
    """Only ``.NAME.KIND-PID-HEX8`` is this package's; and a refused command touches nothing at all."""
    for name in (".ckpt.old-20250101", ".ckpt.partial-backup_1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    before = file_tree(tmp_path)
    code, line = _cli(["convert", tmp_path / "no-such-model", "--to", "eln", *ANALYTIC,
                       "--output", tmp_path / "ckpt"], capsys)
    assert code == 2 and "model not found" in line
    assert file_tree(tmp_path) == before and not (tmp_path / "ckpt").exists()
    dead = tmp_path / f".ckpt.old-{2 ** 22 + 1}-0a1b2c3d"  # an overwrite killed between renames (no such pid)
    shutil.copytree(converted, dead)
    (tmp_path / "ckpt").write_text("a file in the way")
    code, line = _cli(["convert", source / "llama", "--to", "eln", *ANALYTIC, "--output", tmp_path / "ckpt"], capsys)
    assert code == 2 and "exists and is not a directory" in line
    assert dead.is_dir() and (tmp_path / "ckpt").read_text() == "a file in the way"  # refused: not restored
    (tmp_path / "ckpt").unlink()
    code, _ = _cli(["convert", source / "llama", "--to", "dyt", *ANALYTIC,
                    "--output", tmp_path / "ckpt", "--overwrite"], capsys)
    assert code == 0 and not dead.exists()  # put back, then replaced by the new checkpoint
    assert converted_config(tmp_path / "ckpt")["normswap"]["method"] == "dyt"
    assert {k: v for k, v in file_tree(tmp_path).items() if k in before} == before


# ---------------------------------------------------------------------------------- weights and symlinks


def test_weights_beside_an_index_are_refused(converted, tmp_path, capsys):
    """transformers loads model.safetensors when an index sits beside it: the check read the index's shards."""
    model = hf_normswap.load(converted)
    sharded = tmp_path / "sharded"
    hf_normswap.save_pretrained(model, sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    plain = tiny_model("llama")
    plain.save_pretrained(tmp_path / "plain")  # no log_beta: would load with uninitialized parameters
    shutil.copy(tmp_path / "plain" / "model.safetensors", sharded / "model.safetensors")
    before = file_tree(sharded)
    with pytest.raises(checkpoint_dir.CheckpointError, match="holds both model.safetensors and model.safetensors.index"):
        hf_normswap.load(sharded)
    code, line = _cli(["eval", sharded, "--max-tokens", "8"], capsys)
    assert code == 2 and "holds both model.safetensors" in line
    assert file_tree(sharded) == before


def test_an_output_that_is_a_symlink_is_written_through(converted, source, tmp_path, capsys):
    """A link to a checkpoint stays a link, to the new checkpoint; a link to an empty folder gets it."""
    shutil.copytree(converted, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    code, _ = _cli(["convert", source / "llama", "--to", "dyt", *ANALYTIC,
                    "--output", tmp_path / "link", "--overwrite"], capsys)
    assert code == 0 and (tmp_path / "link").is_symlink()
    assert converted_config(tmp_path / "real")["normswap"]["method"] == "dyt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no dangling .link.old-*
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    code, _ = _cli(["convert", source / "llama", "--to", "eln", *ANALYTIC, "--output", tmp_path / "to-empty"], capsys)
    assert code == 0 and (tmp_path / "to-empty").is_symlink()
    assert converted_config(tmp_path / "empty")["normswap"]["method"] == "eln"


def test_push_of_a_symlinked_checkpoint_uploads_its_files(converted, tmp_path, monkeypatch, capsys):
    """The Hub cache's snapshots are links into its blobs."""
    repo = tmp_path / "models--me--converted"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in converted.iterdir():
        shutil.copyfile(file, blobs / f"blob-{file.name}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob-{file.name}")
    (tmp_path / "empty").mkdir()
    shutil.copyfile(converted / "config.json", tmp_path / "empty" / "config.json")
    with HubMirror() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert cli.main(["push", str(snapshot), "me/linked"]) == 0
        uploaded = hub.files("me/linked")
        assert uploaded == {p.name: p.read_bytes() for p in converted.iterdir()}
        code, line = _cli(["push", tmp_path / "empty", "me/nothing"], capsys)
        assert code == 2 and "holds no weights to push" in line and "me/nothing" not in hub.created



# --------------------------------------------------------------------------------------- a stopped calibration

STOPPED_IN_THE_BLOCK_PASS = """
import os, signal, torch
import hf_normswap
from hf_normswap.calibration import activation_cache
from hf_normswap.calibration.calibrate import CalibrationConfig
from tiny_models import tiny_model

keep = activation_cache.ActivationCache._keep

def keep_then_stop(self, tensor):  # a job scheduler stops the run once hidden states are on disk
    entry = keep(self, tensor)
    if self._files == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return entry

activation_cache.ActivationCache._keep = keep_then_stop
ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
hf_normswap.convert(tiny_model("llama"), "eln", calibration=CalibrationConfig(
    data=ids, batch_size=4, strategy="block", block_steps=2, tune_steps=0, progress=False, cache_memory_mb=0))
print("finished")
"""


def test_sigterm_in_the_block_pass_removes_its_spill_folder(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    run = subprocess.run([sys.executable, "-c", STOPPED_IN_THE_BLOCK_PASS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 128 + signal.SIGTERM and "finished" not in run.stdout, run.stderr[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == []


# ------------------------------------------------------------------------------------ one line, not a traceback


def _truncated_gguf(path: Path) -> Path:
    """A GGUF header whose metadata ends before the bytes it announces (a download cut at 100 bytes)."""
    import struct

    key = b"general.architecture"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, 5)
    path.write_bytes((header + b"llama" + struct.pack("<Q", 40) + b"general.name")[:100])
    return path


@pytest.mark.parametrize("case, message", [
    ("truncated gguf", "the files are damaged"),
    ("heads not dividing the hidden size", "is not a multiple of the number of attention heads"),
    ("negative rms_norm_eps", "rms_norm_eps"),
])
def test_files_transformers_refuses_are_one_line(source, tmp_path, capsys, case, message):
    if case == "truncated gguf":
        model = _truncated_gguf(tmp_path / "model.gguf")
    else:
        model = tmp_path / "model"
        shutil.copytree(source / "llama", model)
        config = json.loads((model / "config.json").read_text())
        config.update({"num_attention_heads": 3} if "heads" in case else {"rms_norm_eps": -1})
        (model / "config.json").write_text(json.dumps(config))
    before = file_tree(tmp_path)
    for command in (["inspect", model], ["convert", model, "--to", "eln", *ANALYTIC, "--output", tmp_path / "out"]):
        code, line = _cli(command, capsys)
        assert code == 2 and message in line, line
    assert file_tree(tmp_path) == before


def test_an_unwritable_plots_folder_is_refused_before_loading(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for plots in ("/proc/plots", tmp_path / "file" / "plots"):
        code, line = _cli(["convert", tmp_path / "no-such-model", "--to", "eln", "--calib", "builtin", "--plots",
                           plots], capsys)
        assert code == 2 and f"--plots {plots}: cannot create it" in line, line
    code, _ = _cli(["convert", tmp_path / "no-such-model", "--to", "eln", "--calib", "builtin", "--plots",
                    tmp_path / "new" / "plots"], capsys)
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe made nothing that stays


def test_a_block_without_kind_or_size_is_refused_when_loading(converted, tmp_path, capsys):
    """It loaded, and failed on the next save (the card counts the kinds)."""
    for key in ("kind", "size"):
        tampered = tmp_path / key
        shutil.copytree(converted, tampered)
        config = json.loads((tampered / "config.json").read_text())
        for entry in config["normswap"]["converted"].values():
            entry.pop(key)
        (tampered / "config.json").write_text(json.dumps(config))
        code, line = _cli(["inspect", tampered], capsys)
        assert code == 2 and f"normswap.converted.model.layers.0.input_layernorm.{key}" in line, line


def test_eval_of_an_encoder_against_itself_keeps_sentences_within_its_positions(tmp_path, capsys):
    """BERT with 64 positions: sentences were cut at 256 tokens, past its position table."""
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    tiny_tokenizer().save_pretrained(tmp_path / "bert")
    long = " ".join(["the model of the norm and the data in the text"] * 5) + ".\n"
    (tmp_path / "long.txt").write_text(long * 6)
    code = cli.main(["eval", str(tmp_path / "bert"), "--against", str(tmp_path / "bert"), "--data",
                     str(tmp_path / "long.txt"), "--json"])
    seen = json.loads(capsys.readouterr().out)
    assert code == 0 and seen["results"]["converted"]["cosine"] == pytest.approx(1.0)
    assert seen["sentences"] == 6 and seen["tokens"] <= 6 * 64  # each sentence cut at the 64 positions


@pytest.mark.parametrize("value", ["1e309", "-1e-5", "0.0"])
def test_a_norm_epsilon_that_is_not_a_small_positive_number_is_refused(source, tmp_path, capsys, value):
    """1e309 reads as inf: every RMSNorm then outputs 0, and the norm was classified a LayerNorm and converted."""
    model = tmp_path / "model"
    shutil.copytree(source / "llama", model)
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', f'"rms_norm_eps": {value}'))
    assert value in (model / "config.json").read_text()
    code, line = _cli(["convert", model, "--to", "eln", *ANALYTIC, "--output", tmp_path / "out"], capsys)
    assert code == 2 and "config.json rms_norm_eps is" in line and "small positive number" in line, line
    assert not (tmp_path / "out").exists()


def test_a_large_text_file_is_read_only_up_to_the_token_budget(tmp_path, monkeypatch):
    """Case: calibration asking for 32 tokens of a large file read and tokenized all of it (104 s, 8.2 GB on 32 MB).
    Now a text file above data.LAZY_BYTES is read up to CHARS_PER_TOKEN characters a token of the budget."""
    import datasets

    from hf_normswap import CalibrationConfig
    from hf_normswap.data import texts as data

    big = tmp_path / "big.txt"
    line = "the norm of the data is the scale of the model and the text reads the block\n"
    big.write_text(line * (data.LAZY_BYTES // len(line) + 1000))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the whole file was loaded"))
    texts = hf_normswap.data.load_texts(str(big), max_tokens=64)
    assert len(texts) == 1 and len(texts[0]) <= 64 * data.CHARS_PER_TOKEN and texts[0].endswith("\n")
    model = tiny_model("llama")
    report = hf_normswap.convert(model, "eln", calibration=CalibrationConfig(
        data=str(big), tokenizer=tiny_tokenizer(), num_blocks=2, block_len=16, strategy="fast", progress=False))
    assert report.calibration["tokens"] == 32


def test_the_recipe_checks_a_large_text_file_without_reading_it_whole(tmp_path, monkeypatch):
    """The recipe's pre-check of its text sources opens a large file up to a token, as the run reads it up to its
    budget; before, the check itself read and tokenized all of it."""
    import datasets

    from hf_normswap.data import texts as data
    from hf_normswap.training import recipe_settings

    big = tmp_path / "big.txt"
    line = "the norm of the data is the scale of the model and the text reads the block\n"
    big.write_text(line * (data.LAZY_BYTES // len(line) + 1000))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the whole file was loaded"))
    check_settled(recipe_settings.load_config([f"calibration.data={big}", f"train_data={big}", f"eval_data={big}",
                                          f"output_dir={tmp_path / 'run'}"]))


def test_a_report_that_fails_midway_leaves_no_part_of_itself(source, tmp_path, monkeypatch, capsys):
    """A full disk while --report is written: it left a 0-byte (or cut) report.json; an earlier report stays."""
    import os

    real = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if self.name == "report.json" or self.name.startswith(f".report.json.partial-{os.getpid()}-"):
            real(self, text[:10], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, text, *args, **kwargs)

    report = tmp_path / "report.json"
    for earlier in (None, '{"earlier": 1}'):
        if earlier:
            report.write_text(earlier)
        monkeypatch.setattr(Path, "write_text", full_disk)
        code, line = _cli(["convert", source / "llama", "--to", "eln", "--calib", "none", "--no-check", "--output",
                           tmp_path / "out", "--overwrite", "--report", report], capsys)
        monkeypatch.undo()
        assert code == 2 and "cannot write --report" in line and "No space left on device" in line, line
        assert (report.read_text() if earlier else report.exists()) == (earlier or False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "report.json"] if earlier else ["out"]


def test_a_null_text_row_reads_as_a_blank_line_streamed_or_whole(monkeypatch):
    """A Hub dataset of lines with a null row: a TypeError in the stream's packing and in the whole read."""
    import datasets

    from hf_normswap.data import streaming, texts as data

    rows = datasets.Dataset.from_dict({"text": [" = Title = ", "", " the model of the norm", None, " the data", ""]})
    monkeypatch.setattr(data, "hub_dataset", lambda spec, split, streaming=False: (rows, "text"))
    [whole] = hf_normswap.data.load_texts("someone/lines")
    assert whole == " = Title = \n\n the model of the norm\n\n the data\n"
    streamed = list(streaming._documents(rows.to_iterable_dataset(), "text"))
    assert "".join(text for text, _ in streamed) == whole and streamed[-1][1]


@pytest.mark.parametrize("against", ["bert", "other vocabulary", "other tokenizer"])
def test_eval_against_an_unrelated_model_is_refused(source, tmp_path, capsys, against):
    """`eval bert --against llama` printed numbers for two unrelated models."""
    from tokenizers import Tokenizer, models as vocabularies
    from transformers import PreTrainedTokenizerFast

    model, scored = tmp_path / "against", source / "llama"
    if against == "bert":  # scored: bert, against the llama
        tiny_model("bert").save_pretrained(tmp_path / "bert")
        tiny_tokenizer().save_pretrained(tmp_path / "bert")
        model, scored = scored, tmp_path / "bert"
        expected = "bert is an encoder"
    elif against == "other vocabulary":
        tiny_model("llama", vocab_size=96).save_pretrained(model)
        expected = "has a vocabulary of 128 tokens"
    else:
        tiny_model("llama").save_pretrained(model)
        words = {f"w{i}": i for i in range(128)}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocabularies.WordLevel(words, unk_token="w0")),
                                unk_token="w0").save_pretrained(model)
        expected = "read text into other ids"
    code, line = _cli(["eval", scored, "--against", model, "--data", source / "text.txt"], capsys)
    assert code == 2 and "--against names another model" in line and expected in line, line
