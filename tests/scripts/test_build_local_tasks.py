"""scripts/evaluation/build_local_tasks.py: two lm-eval tasks from held-out text, read by lm-eval itself from local files."""

from __future__ import annotations

import json
import random

import pytest

from file_modules import import_file

WORDS = ["river", "castle", "engine", "garden", "winter", "soldier", "market", "letter", "island", "machine",
         "painter", "harbour", "village", "season", "station", "teacher", "forest", "bridge", "theatre", "record"]


def _prose(paragraphs: int) -> str:
    rng = random.Random(0)
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + " ."  # noqa: E731
    return "\n\n".join(" ".join(sentence() for _ in range(4)) for _ in range(paragraphs))


def test_the_tasks_hold_whole_passages_and_lm_eval_indexes_them(tmp_path, capsys):
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    bench = import_file("scripts/evaluation/build_local_tasks.py")
    text = tmp_path / "held_out.txt"
    text.write_text(_prose(120))
    out = tmp_path / "tasks"
    assert bench.main([str(text), "--output", str(out)]) == 0
    counts = json.loads(capsys.readouterr().out)
    lastword = [json.loads(line) for line in (out / "normswap_lastword.jsonl").read_text().splitlines()]
    choices = [json.loads(line) for line in (out / "normswap_continuation.jsonl").read_text().splitlines()]
    assert len(lastword) == counts["normswap_lastword"] == 120 and len(choices) == counts["normswap_continuation"]
    assert all(row["text"].split(" ")[-1] in WORDS for row in lastword)  # a word, its final " ." dropped
    paragraphs = text.read_text().split("\n\n")
    for row in choices:
        true = row["choices"][row["label"]]
        source = next(p for p in paragraphs if p.startswith(row["query"]))
        assert source.startswith(f"{row['query']} {true}") and len(row["choices"]) == 4 == len(set(row["choices"]))
    manager = lm_eval_tasks.TaskManager(include_path=str(out), include_defaults=False)
    assert {"normswap_lastword", "normswap_continuation"} <= set(manager.all_tasks)


def test_the_tasks_are_not_written_into_the_repository(tmp_path, capsys):
    bench = import_file("scripts/evaluation/build_local_tasks.py")
    assert bench.main(["builtin:evaluation", "--output", str(bench.ROOT / "tasks")]) == 2
    assert "inside the repository" in capsys.readouterr().err and not (bench.ROOT / "tasks").exists()
