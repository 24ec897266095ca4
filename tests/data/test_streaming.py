"""A streamed Hub dataset (several parquet shards on the local Hub mirror): the blocks of the dataset read whole,
a resumed stream continuing where it stopped, and an empty stream refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hub_mirror import HubMirror, write_text_dataset
from tiny_models import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # where tiny_models lives
DATASET = "someone/shards"
CHECK = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tiny_models import tiny_tokenizer
from hf_normswap.data import DataError, load_texts, token_blocks
from hf_normswap.data import streaming
from hf_normswap.data.streaming import packed_stream

streaming.PIECE_CHARS = 40  # a dataset of lines cut into pieces many times over
tokenizer, spec = tiny_tokenizer(), sys.argv[2]
stream = packed_stream(spec, tokenizer, 16)
streamed = [row["input_ids"] for row in stream]
whole = token_blocks(tokenizer, load_texts(spec, "train"), None, 16).tolist()
first = iter(stream)
head = [next(first)["input_ids"] for _ in range(5)]
state = stream.state_dict()
resumed = packed_stream(spec, tokenizer, 16)
resumed.load_state_dict(state)
try:
    packed_stream("someone/shards:default:empty", tokenizer, 16)
    empty = "accepted"
except DataError as error:
    empty = str(error)
print(json.dumps({"streamed": streamed, "whole": whole, "head": head,
                  "rest": [row["input_ids"] for row in resumed], "empty": empty}))
"""


def rows(shard: int) -> list[str]:
    words = "norm scale token model layer block channel weight bias data".split()
    return [" ".join(words[(shard * 7 + i + j) % len(words)] for j in range(5 + 3 * i)) + f" ({shard}.{i})"
            for i in range(6)]


def lines(shard: int) -> list[str]:
    """One line a row with blank lines kept, as WikiText: headings, paragraphs and empty rows."""
    return [row for i, text in enumerate(rows(shard)) for row in ("", f" = {i} = \n" if i % 3 == 0 else f" {text} \n")]


@pytest.mark.parametrize("split, documents", [("train", 18), ("lines", 1)])
def test_a_streamed_dataset_packs_as_read_whole_and_resumes_where_it_stopped(tmp_path, split, documents):
    """Rows of documents are joined by EOS; rows of lines are one text, as the split reads whole."""
    folder = write_text_dataset(tmp_path / "shards", {"train": [rows(shard) for shard in range(3)], "empty": [[]],
                                                      "lines": [lines(shard) for shard in range(3)]})
    with HubMirror() as mirror:
        mirror.add_folder(DATASET, folder, repo_type="dataset")
        env = mirror.process_env(tmp_path / "home", PYTHONPATH=str(ROOT))
        result = subprocess.run([sys.executable, "-c", CHECK, str(TESTS), f"{DATASET}:default:{split}"],
                                env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["streamed"] == seen["whole"] and len(seen["whole"]) > 8
    eos = tiny_tokenizer().eos_token_id  # after each document; the last one's falls in the remainder
    assert sum(block.count(eos) for block in seen["whole"]) == documents - 1
    assert seen["head"] == seen["streamed"][:5] and seen["rest"] == seen["streamed"][5:]
    assert "is empty" in seen["empty"]


def test_the_recipe_trains_on_a_stream_and_resumes_it(tmp_path):
    """``streaming: true``: the recipe opens the stream (one row) before loading, trains on packed blocks read on
    the fly, and a second launch resumes at the step it stopped."""
    import yaml
    from tiny_models import tiny_model

    folder = write_text_dataset(tmp_path / "shards", {"train": [rows(shard) * 4 for shard in range(3)]})
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    (tmp_path / "eval.txt").write_text("\n".join(rows(7)))
    config = {"model": str(model_dir), "method": "eln", "streaming": True, "train_data": DATASET,
              "calibration": {"data": str(tmp_path / "eval.txt"), "num_blocks": 2, "block_len": 16,
                              "progress": False, "strategy": "fast"},
              "eval_data": str(tmp_path / "eval.txt"), "block_len": 16, "eval_blocks": 1,
              "final_eval": {"max_tokens": 64, "max_length": 16}, "output_dir": str(tmp_path / "run"), "threads": 1,
              "training": {"max_steps": 2, "per_device_train_batch_size": 2, "save_steps": 2, "eval_strategy": "no",
                           "logging_steps": 1, "report_to": "none", "disable_tqdm": True}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with HubMirror() as mirror:
        mirror.add_folder(DATASET, folder, repo_type="dataset")
        env = mirror.process_env(tmp_path / "home", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                                 TOKENIZERS_PARALLELISM="false")
        for steps in (2, 4):
            result = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune.py"), "--config",
                                     str(tmp_path / "c.yaml"), f"training.max_steps={steps}"], env=env, cwd=ROOT,
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "streamed in blocks of 16 tokens" in result.stdout and "resuming from" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["training"]["steps"] == 4 and summary["training"]["tokens_seen"] == 4 * 2 * 16


def test_a_mix_of_blocks_read_whole_and_streamed_aligns(tmp_path):
    """The original's samples stream and ``builtin:calibration`` is read whole: ``datasets`` typed the rows read
    whole as int32 and refused to interleave them with a stream's."""
    from hf_normswap.data import streaming
    from hf_normswap.training.recipe_data import block_dataset, mixed

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three four five six seven eight nine ten\n" * 20)
    tokenizer = tiny_tokenizer()
    whole = block_dataset(tokenizer, "builtin:calibration", "calibration", 16, max_blocks=3)
    streamed = streaming.file_stream([corpus], tokenizer, 16)
    rows = list(mixed([whole.to_iterable_dataset(), streamed]).take(6))
    assert [len(row["input_ids"]) for row in rows] == [16] * 6
    assert rows[0]["input_ids"] == whole[0]["input_ids"] and rows[1]["input_ids"] == next(iter(streamed))["input_ids"]
