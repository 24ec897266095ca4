"""The ``normswap`` block of config.json: one writer and reader (``ConversionRecord``), with a format version."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

import hf_normswap
from hf_normswap.checkpoint import loading
from hf_normswap.checkpoint.record import FORMAT_VERSION, PARTS, ConversionRecord, NormEntry, OriginalArchitecture
from hf_normswap.fold import fold
from hf_normswap.validation import ValidationError
from tiny_models import tiny_model

ROOT = Path(hf_normswap.__file__).parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")

# a write into the block: assigning it or one of its keys, updating or deleting in it, setattr on the config
WRITES = re.compile(r"""(\.normswap|\[\s*["']normswap["']\s*\])\s*(\[[^\]]*\]\s*)*"""
                    r"""(=(?!=)|\.(update|setdefault|pop)\(|\|=)"""
                    r"""|del\s+\S*normswap|setattr\([^)]*["']normswap["']""")


def test_no_other_writer_of_the_block():
    """Only checkpoint/record.py writes the block; every other stage hands it its part (``ConversionRecord.amend``).
    The recipe is read too: a stage that writes keys itself would bypass the format version."""
    writers = []
    for folder in ("hf_normswap", "recipes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "record.py" and path.parent.name == "checkpoint":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if WRITES.search(line.split("#")[0]):
                    writers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not writers, "\n".join(writers)


def test_the_writer_pattern_sees_writes():
    for line in ('model.config.normswap["training"] = training', "config['normswap'] = block",
                 'model.config.normswap = {"method": "eln"}', "block = model.config.normswap; x.normswap.update(a)",
                 'setattr(model.config, "normswap", {})'):
        assert WRITES.search(line), line
    for line in ('spec = converted["normswap"].get("base_model")', 'if config.normswap == other:'):
        assert not WRITES.search(line), line


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln")
    directory = tmp_path_factory.mktemp("record") / "ckpt"
    hf_normswap.save_pretrained(model, directory)
    return directory


def _rewrite(directory: Path, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config["normswap"])
    path.write_text(json.dumps(config))


def test_a_saved_block_carries_the_format_version(checkpoint):
    block = json.loads((checkpoint / "config.json").read_text())["normswap"]
    assert block["format_version"] == FORMAT_VERSION
    assert ConversionRecord.read(checkpoint).method == "eln"


def test_a_checkpoint_saved_before_the_version_loads_as_version_1(checkpoint, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    _rewrite(old, lambda block: block.pop("format_version"))
    reference = loading.load(checkpoint)
    model = loading.load(old)
    ids = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_later_format_version_is_one_line_naming_it(checkpoint, tmp_path):
    import shutil

    new = tmp_path / "new"
    shutil.copytree(checkpoint, new)
    _rewrite(new, lambda block: block.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(ValidationError, match=f"format version {FORMAT_VERSION + 1} is newer") as error:
        loading.load(new)
    assert "\n" not in str(error.value)
    with pytest.raises(loading.ModelLoadError, match="upgrade hf-normswap"):
        loading.load_model(str(new), with_tokenizer=False)


def test_later_stages_add_their_part_through_the_record():
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln")
    ConversionRecord.amend(model, evaluation={"dataset": "d", "metrics": {}})
    fold(model)
    record = ConversionRecord.of(model)
    assert record.evaluation == {"dataset": "d", "metrics": {}} and record.folded
    with pytest.raises(TypeError, match="no part bogus"):
        ConversionRecord.amend(model, bogus=1)
    assert ConversionRecord.amend(tiny_model("llama"), training={}) is None  # not converted: left alone


# ------------------------------------------------------------------------------- formats written before

SAVED = Path(__file__).parent / "saved_configs"  # config.json as 9de1ab1 (format 1) and d961173 (format 2) wrote it


@pytest.mark.parametrize("version", [1, 2])
def test_a_config_of_each_format_reads_and_loads_bit_exact(version, tmp_path):
    """A tiny Llama converted to ELN without text (format 1: the theory's start, one shape parameter a module;
    format 2: the measured start, per channel), its config.json replaced by the one the older package wrote."""
    stored = json.loads((SAVED / f"format{version}.json").read_text())
    assert ("format_version" in stored["normswap"]) == (version == 2)
    model = tiny_model("llama")
    hf_normswap.convert(model, "eln", calibration=None, **({"input_scale": 1.0} if version == 1 else {}))
    hf_normswap.save_pretrained(model, tmp_path / "new")
    reference = loading.load(tmp_path / "new")
    (tmp_path / "new" / "config.json").write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")

    record = ConversionRecord.read(tmp_path / "new")
    block = {**stored["normswap"], "format_version": FORMAT_VERSION}
    assert json.dumps(record.to_dict(), sort_keys=True) == json.dumps(block, sort_keys=True)
    ids = torch.arange(16).unsqueeze(0)
    for loaded in (loading.load(tmp_path / "new"),
                   transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "new", trust_remote_code=True).eval()):
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    hf_normswap.save_pretrained(loading.load(tmp_path / "new"), tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())["normswap"]
    assert {**again, "package": None} == {**block, "package": None}  # a save records the package that saved


# ----------------------------------------------------------------------------------- one reader of the block

# keys of the block and of an entry that other JSON of the package does not use (it has its own "method", "role",
# "converted", "calibration" ..., config.json its "model_type", and the parts later stages hand over)
SHARED = {"method", "role", "size", "bias", "converted", "calibration", "convert", "version", "package", "model_type",
          *PARTS}
RECORDS = (ConversionRecord, NormEntry, OriginalArchitecture)
OWN_KEYS = "|".join(sorted({f.name for record in RECORDS for f in dataclasses.fields(record)} - SHARED))
# a raw read of the block: subscripting or .get on normswap / the block's key, or one of its own keys (a name:
# not the package's name in an install line, 'hf-normswap[eval]')
RAW_READS = re.compile(rf"""(?<![\w-])normswap\s*(\[|\.get\()|\[\s*(KEY|["']normswap["'])\s*\]"""
                       rf"""|\.get\(\s*["']normswap["']"""
                       rf"""|(\.get\(|\[)\s*["']({OWN_KEYS})["']""")


def test_only_the_record_reads_the_block_raw():
    """Every reader goes through ``ConversionRecord`` / ``NormEntry``: a raw ``.get`` or subscript on the block or
    an entry outside checkpoint/record.py would read around the format version and the types."""
    reads = []
    for folder in ("hf_normswap", "recipes", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "record.py" and path.parent.name == "checkpoint":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if RAW_READS.search(line.split("#")[0]) and not line.strip().startswith(('"', "'", "``")):
                    reads.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not reads, "\n".join(reads)


def test_the_raw_read_pattern_sees_raw_reads():
    for line in ('block = config["normswap"]', 'model.config.normswap["converted"]', "entry.get('amplitude', 1)",
                 'shape = entry["normalized_shape"]', "config[KEY]", 'block.get("base_model")',
                 'e.get("per_channel", False)', 'name = base["architecture"]'):
        assert RAW_READS.search(line), line
    for line in ('record.converted[name].amplitude', 'row["role"]', 'summary["ratio"].get(k)'):
        assert not RAW_READS.search(line), line
