"""Fault injection on the recipe's text: a source without one whole block, a byte that is not UTF-8 far into a
streamed file, a JSON or parquet row without the text column. Each is one line naming the key and the file, exit
code 2, before any model loads; the check reads every byte but keeps none (``data.file_scan``)."""

from __future__ import annotations

import json

import pytest

from cli_runs import recipe_refusal
from hf_normswap.data import DataError
from hf_normswap.data.file_scan import scan
from hf_normswap.data.texts import read_local

pytestmark = pytest.mark.usefixtures("no_loading")
WORDS = "the norm of the model reads the data in blocks of tokens and the run trains on them\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\t\n")
    (tmp_path / "short.txt").write_text("short text")
    (tmp_path / "prose.txt").write_text(WORDS * 50)
    return tmp_path


def _refusal(tmp_path, capsys, *overrides) -> str:
    return recipe_refusal([f"output_dir={tmp_path / 'run'}", "block_len=32", "calibration.block_len=32", *overrides],
                          capsys)


@pytest.mark.parametrize("key, name, message", [
    ("train_data", "empty.txt", "holds no text (empty or blank) (train_data=PATH)"),
    ("train_data", "blank.txt", "holds no text (empty or blank) (train_data=PATH)"),
    ("train_data", "short.txt", "holds 10 bytes of text, fewer tokens than one block of 32 (give more text: "
                                "train_data=PATH, or a smaller block_len)"),
    ("eval_data", "empty.txt", "holds no text (empty or blank) (eval_data=PATH)"),
    ("eval_data", "short.txt", "fewer tokens than one block of 32 (give more text: eval_data=PATH, or a smaller "
                               "block_len)"),
    ("calibration.data", "blank.txt", "holds no text (empty or blank) (calibration.data=PATH)"),
    ("calibration.data", "short.txt", "or a smaller calibration.block_len)"),
])
def test_a_source_without_a_whole_block_is_refused_before_loading(files, capsys, key, name, message):
    """train_data trained 0 steps and saved the start as ``final`` (exit 0); eval_data failed after calibration,
    calibration.data after loading (exit 1)."""
    err = _refusal(files, capsys, f"{key}={files / name}")
    assert err.startswith(f"normswap recover: error: {key}: {files / name} ") or \
        err.startswith(f"finetune: error: {key}: {files / name} "), err
    assert message in err and not (files / "run").exists()


def test_a_mix_with_an_empty_source_is_refused_naming_it(files, capsys):
    """The run trained on the other source alone while the log named the mix."""
    err = _refusal(files, capsys, f"train_data=[{files / 'prose.txt'},{files / 'empty.txt'}]")
    assert f"train_data: {files / 'empty.txt'} holds no text" in err


def test_a_bad_byte_far_into_a_streamed_text_file_is_refused_before_loading(files, capsys):
    """0xff at 1.2 MB of a 4.6 MB file: the check read a 32-character prefix of files above 4 MB, and the stream
    crashed with a UnicodeDecodeError after 250 steps, on every relaunch."""
    data = bytearray((WORDS * (4_600_000 // len(WORDS))).encode())
    data[1_200_000] = 0xFF
    (files / "corpus.txt").write_bytes(bytes(data))
    err = _refusal(files, capsys, f"train_data={files / 'corpus.txt'}")
    assert f"train_data: {files / 'corpus.txt'} is not UTF-8 text (byte 0xff at offset 1200000)" in err


def test_a_character_split_across_the_scans_chunks_is_read_whole(tmp_path, monkeypatch):
    from hf_normswap.data import file_scan

    monkeypatch.setattr(file_scan, "CHUNK", 5)
    (tmp_path / "text.txt").write_text("abcdé" * 3 + "\u20ac")  # 'é' and '€' cross a chunk's end
    assert scan([tmp_path / "text.txt"]).text_bytes == len(("abcdé" * 3 + "\u20ac").encode())
    (tmp_path / "bad.txt").write_bytes(b"abcd\xc3" + b"(ok")  # a lead byte, then no continuation
    with pytest.raises(DataError, match=r"byte 0xc3 at offset 4\)"):
        scan([tmp_path / "bad.txt"])


def _jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("rows, message", [
    ([{"text": WORDS}] * 3 + [{"body": WORDS}], "corpus.jsonl line 4: no 'text' field (the text column)"),
    ([{"text": WORDS}, {"text": 3}], "corpus.jsonl line 2: the text column 'text' holds int, not a string"),
    ([{"id": 1}], "corpus.jsonl line 1: no text column among ['id']"),
    ([{"text": ""}, {"text": None}], "corpus.jsonl holds no text (empty or blank)"),
])
def test_a_jsonl_row_without_its_text_is_one_line(files, capsys, rows, message):
    _jsonl(files / "corpus.jsonl", rows)
    err = _refusal(files, capsys, f"train_data={files / 'corpus.jsonl'}")
    assert message in err and "train_data: " in err


def test_a_bad_byte_or_line_in_jsonl_is_named_by_offset_and_line(tmp_path):
    good = (json.dumps({"text": WORDS}) + "\n").encode()
    (tmp_path / "bad.jsonl").write_bytes(good * 2 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"bad.jsonl is not UTF-8 text \(byte 0xe9 at offset {2 * len(good) + 13}\)"):
        scan([tmp_path / "bad.jsonl"])
    (tmp_path / "cut.jsonl").write_bytes(good + b'{"text": "cut\n')
    with pytest.raises(DataError, match="cut.jsonl line 2: not a JSON object"):
        scan([tmp_path / "cut.jsonl"])


def test_a_json_list_is_read_as_datasets_reads_it(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"text": "a b c"}, {"text": "  "}, {"text": "d e"}], indent=1))
    assert (scan([tmp_path / "rows.json"]).documents, read_local([tmp_path / "rows.json"], 100)) == \
        (2, ["a b c", "d e"])
    (tmp_path / "line.json").write_text(json.dumps([{"text": "a b c"}, {"text": "d e"}]))  # on one line
    assert (scan([tmp_path / "line.json"]).documents, read_local([tmp_path / "line.json"], 100)) == \
        (2, ["a b c", "d e"])


def test_parquet_is_read_by_batches_and_its_column_checked(tmp_path, monkeypatch):
    import pyarrow
    import pyarrow.parquet as parquet

    from hf_normswap.data import file_scan

    monkeypatch.setattr(file_scan, "ROWS", 2)
    parquet.write_table(pyarrow.table({"text": [WORDS, None, " ", WORDS, "x"]}), tmp_path / "a.parquet",
                        row_group_size=2)
    found = scan([tmp_path / "a.parquet"])
    assert (found.documents, found.text_bytes) == (3, 2 * len(WORDS) + 1)
    parquet.write_table(pyarrow.table({"body": [WORDS]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: no 'text' column of strings \(the text column\)"):
        scan([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    parquet.write_table(pyarrow.table({"id": [1]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet: no text column among \['id'\]"):
        scan([tmp_path / "c.parquet"])


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_reading_a_table_within_a_budget_stops_after_it(tmp_path, suffix):
    """The json / parquet branch of read_local ignored max_tokens and listed the whole column (2.6 GB of memory a
    GB of jsonl): within a budget it reads the rows up to it, and never reaches a bad row past it."""
    import pyarrow
    import pyarrow.parquet as parquet

    path = tmp_path / f"corpus.{suffix}"
    rows = [f"row {i} " + WORDS for i in range(200)]
    if suffix == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows) + "not json\n")
    else:
        parquet.write_table(pyarrow.table({"text": rows}), path, row_group_size=10)
    budget = 8  # tokens: 8 x 32 characters, the first three rows
    assert read_local([path], budget) == rows[:3]


def test_a_stream_that_gives_no_block_stops_the_run(files):
    """Text within the check's bound (35 bytes may be 35 tokens) that the tokenizer makes fewer than a block of:
    the stream trained 0 steps and the run saved its start."""
    from hf_normswap.data.sources import NoWholeBlock, source
    from tiny_models import tiny_tokenizer

    (files / "few.txt").write_text("the model of the norm and the data\n")
    source(str(files / "few.txt")).preflight("calibration", 32)  # within the bound
    with pytest.raises(NoWholeBlock, match="few.txt gives fewer tokens than one block of 32"):
        source(str(files / "few.txt")).stream(tiny_tokenizer(), 32)
    assert next(iter(source(str(files / "prose.txt")).stream(tiny_tokenizer(), 32)))["input_ids"]


def test_a_whole_block_is_asked_only_of_a_run_that_packs_blocks(files, tmp_path):
    """A sentence encoder (MiniLM's bare BertModel) reads sentences of any length: a short file is its text."""
    from hf_normswap.training import recipe_data, recipe_settings
    from tiny_models import tiny_model

    tiny_model("bert").bert.save_pretrained(tmp_path / "encoder")
    tiny_model("llama").save_pretrained(tmp_path / "decoder")
    assert not recipe_data.packs_blocks(str(tmp_path / "encoder")) and recipe_data.packs_blocks(str(tmp_path / "decoder"))
    config = recipe_settings.load_config([f"output_dir={tmp_path / 'run'}", f"train_data={files / 'short.txt'}"])
    recipe_data.check_data(config, True, packs=False)
    with pytest.raises(SystemExit):
        recipe_data.check_data(config, True, packs=True)
