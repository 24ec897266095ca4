"""The ``normswap`` block of config.json: one writer and reader (``ConversionRecord``), with a format version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import hf_normswap
from hf_normswap.checkpoint import loading
from hf_normswap.checkpoint.record import FORMAT_VERSION, ConversionRecord
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
