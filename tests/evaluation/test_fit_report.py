"""The fit-for-use report of ``normswap eval --against``: the tails and the ratio by position equal a by-hand
computation, a model against itself gives exactly 1 everywhere (lm-eval tasks from local JSON files included), and
a bad ``--tasks`` request is one line before any model loads."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf_normswap
from cli_runs import recipe_refusal, run_cli
from hf_normswap.checkpoint.record import ConversionRecord
from hf_normswap.checkpoint.model_card import _evaluation_section
from hf_normswap.cli import main
from hf_normswap.evaluation.perplexity import PerplexitySettings, evaluate
from hf_normswap.evaluation.positions import positions
from hf_normswap.evaluation.fit_for_use import context_report, fitted_length
from hf_normswap.evaluation.tails import repeated_share, tails
from hf_normswap.evaluation.token_losses import TokenLosses
from hf_normswap.training.config import FinalEvaluation
from hf_normswap.training.recipe_results import fit_for_use
from tiny_models import tiny_model, tiny_tokenizer

TEXT = ("the model of the norm and the data in the text. " * 12 + "a norm of the data. ") * 4
CONTEXT = 256


def _by_hand(model, ids: torch.Tensor, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token losses and positions over windows of ``length`` read one at a time, without the package."""
    losses, positions = [], []
    for start in range(0, len(ids) - 1, length):
        window = ids[start:start + length + 1]
        with torch.no_grad():
            logits = model(input_ids=window[None, :-1]).logits[0]
        losses.append(F.cross_entropy(logits.double(), window[1:], reduction="none").numpy())
        positions.append(np.arange(len(window) - 1))
    return np.concatenate(losses), np.concatenate(positions)


def test_tails_and_position_ratios_equal_a_by_hand_computation(one_thread):
    tokenizer = tiny_tokenizer()
    original = tiny_model("llama", max_position_embeddings=CONTEXT)
    converted = tiny_model("llama", seed=1, max_position_embeddings=CONTEXT)
    tails, positions, repetition = context_report({"original": original, "converted": converted}, tokenizer,
                                                  [TEXT], max_length=200, batch_size=2)
    ids = torch.tensor([tokenizer.bos_token_id] + tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    a, where = _by_hand(original, ids, 200)
    b, _ = _by_hand(converted, ids, 200)
    assert len(a) == len(ids) - 1 and len(ids) > 400  # three windows, the last one short
    for values, found in ((a, tails.original), (b, tails.converted), (b - a, tails.difference)):
        assert found["p50"] == pytest.approx(np.median(values), rel=1e-5)
        assert found["p99_9"] == pytest.approx(np.percentile(values, 99.9), rel=1e-5)
        assert found["max"] == pytest.approx(values.max(), rel=1e-5)
    spans = [(b[s:s + 128] - a[s:s + 128]).mean() for s in range(0, len(a), 128)]
    assert tails.worst[0].difference == pytest.approx(max(spans), rel=1e-5)
    assert [(r.start, r.end) for r in positions.ranges] == [(0, 64), (64, 128), (128, 200)]
    for r in positions.ranges:
        inside = (where >= r.start) & (where < r.end)
        assert r.tokens == inside.sum()
        assert r.ratio == pytest.approx(math.exp(b[inside].mean() - a[inside].mean()), rel=1e-5)
    assert positions.first["ratio"] == pytest.approx(math.exp(b.mean() - a.mean()), rel=1e-5)  # all below 512
    copies = ids[1:1 + repetition.passage].repeat(repetition.copies)
    looped = torch.cat([ids[:1], copies])
    with torch.no_grad():
        last = F.cross_entropy(original(input_ids=looped[None, :-1]).logits[0, -repetition.passage:].double(),
                               looped[-repetition.passage:])
    assert repetition.passage == 100 and repetition.copies == 2
    assert repetition.original_last == pytest.approx(math.exp(last), rel=1e-5)


MC_ROWS = [{"query": f"the norm of the {w}", "choices": ["data.", "text.", "model.", "norm."], "label": i % 4}
           for i, w in enumerate(["data", "text", "model", "norm", "the data", "a text"])]
LL_ROWS = [{"text": f"the model of the norm and the {w}"} for w in ["data", "text", "model", "norm", "norm", "data"]]
MC_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
LL_TASK = """task: tiny_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture
def saved(tmp_path):
    """A tiny Llama with its tokenizer, a text, and a folder of two local tasks read by lm-eval from JSON lines."""
    model = tmp_path / "model"
    tiny_model("llama", max_position_embeddings=CONTEXT).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, rows, template in (("choice", MC_ROWS, MC_TASK), ("lastword", LL_ROWS, LL_TASK)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(template.format(data=tasks / f"{name}.jsonl"))
    return model, text, tasks


def test_a_model_against_itself_recovers_exactly_one(saved, capsys, one_thread):
    model, text, tasks = saved
    pytest.importorskip("lm_eval")
    assert main([str(a) for a in ["eval", model, "--against", model, "--data", text, "--tasks", tasks,
                                  "--limit", 5, "--json"]]) == 0
    found = json.loads(capsys.readouterr().out)
    metrics = {(task, name): m for task, t in found["tasks"]["tasks"].items() for name, m in t["metrics"].items()}
    assert {"acc", "acc_norm"} <= {name for task, name in metrics if task == "tiny_choice"}
    assert {"perplexity", "acc"} <= {name for task, name in metrics if task == "tiny_lastword"}
    assert all(m["recovery"] == 1.0 and m["original"] == m["converted"] for m in metrics.values())
    assert found["tasks"]["tasks"]["tiny_choice"]["examples"] == 5
    ranges = found["positions"]["ranges"]
    assert len(ranges) == 3 and all(r["ratio"] == 1.0 for r in ranges)
    assert found["repetition"]["ratio"] == 1.0
    assert found["tails"]["difference"]["max"] == 0.0 and found["tails"]["original"] == found["tails"]["converted"]
    assert {"p50", "p90", "p99", "p99_9", "max"} <= set(found["tails"]["original"])


def test_no_tails_leaves_the_perplexity_table_alone(saved, capsys, one_thread):
    model, text, _ = saved
    assert main([str(a) for a in ["eval", model, "--against", model, "--data", text, "--no-tails", "--json"]]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["ratio"]["converted"] == 1.0
    assert found["tails"] is found["positions"] is found["repetition"] is found["tasks"] is None


@pytest.fixture
def no_load(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("hf_normswap.cli.evaluate.load_model", loaded)


def _refused(argv, capsys) -> str:
    code, line = run_cli(argv, capsys)
    assert code == 2 and line.startswith("normswap: error:"), line
    return line


def test_a_bad_task_request_is_one_line_before_any_model_loads(saved, tmp_path, capsys, monkeypatch, no_load):
    model, text, tasks = saved
    pytest.importorskip("lm_eval")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: broken\ndoc_to_text: [unclosed\n")
    assert "not a task file lm-eval can read" in _refused(["eval", model, "--against", model, "--tasks", bad], capsys)
    assert "--limit must be positive" in _refused(["eval", model, "--against", model, "--tasks", tasks,
                                                   "--limit", 0], capsys)
    encoder = tmp_path / "encoder"
    tiny_model("bert").save_pretrained(encoder)
    assert "is an encoder" in _refused(["eval", encoder, "--against", encoder, "--tasks", tasks], capsys)
    inside = model / "tasks"
    inside.mkdir()
    (inside / "choice.yaml").write_text((tasks / "choice.yaml").read_text())
    assert "inside the checkpoint folder" in _refused(["eval", model, "--against", model, "--tasks", inside], capsys)
    with pytest.raises(AssertionError, match="a model was loaded"):  # trusted: the request passes its checks
        run_cli(["eval", model, "--against", model, "--tasks", inside, "--trust-remote-code"], capsys)
    assert "--against" in _refused(["eval", model, "--tasks", tasks], capsys)
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert "hf-normswap[eval]" in _refused(["eval", model, "--against", model, "--tasks", tasks], capsys)


def test_an_unknown_task_name_is_one_line_before_any_model_loads(saved, capsys, no_load):
    model, _, tasks = saved
    pytest.importorskip("lm_eval")
    line = _refused(["eval", model, "--against", model, "--tasks", f"{tasks},no_such_task_anywhere"], capsys)
    assert "no task no_such_task_anywhere" in line


@pytest.mark.parametrize("argv, message", [
    (["final_eval.limit=0"], "final_eval.limit must be positive"),
    (["final_eval.num_fewshot=-1"], "final_eval.num_fewshot must be at least 0"),
    (["final_eval.tasks=/nonexistent/task.yaml"], "final_eval.tasks: /nonexistent/task.yaml: no such task file"),
])
def test_the_recipes_final_tasks_are_checked_before_any_model_loads(argv, message, tmp_path, capsys, no_loading):
    pytest.importorskip("lm_eval")
    assert message in recipe_refusal([f"output_dir={tmp_path / 'run'}", *argv], capsys)


def test_the_recipes_final_evaluation_carries_the_tails_and_tasks_to_the_card(saved, one_thread):
    _, _, tasks = saved
    pytest.importorskip("lm_eval")
    tokenizer = tiny_tokenizer()
    original = tiny_model("llama", max_position_embeddings=CONTEXT)
    model = tiny_model("llama", seed=1, max_position_embeddings=CONTEXT)
    after = evaluate({"finetuned": model}, tokenizer, [TEXT], against=original,
                     settings=PerplexitySettings(max_length=200, progress=False))
    settings = FinalEvaluation(max_length=200, tails=True, limit=3, tasks=[str(tasks / "choice.yaml")])
    fit = fit_for_use(after, model, original, tokenizer, [TEXT], settings)
    assert [r.end for r in fit.positions.ranges] == [64, 128, 200] and fit.repetition is not None
    assert [m.metric for m in fit.tasks.metrics] == ["acc", "acc_norm"] and fit.tasks.samples["tiny_choice"] == 3
    section = _evaluation_section(dict(after.card("finetuned"), fit_for_use=fit.parts_table()))
    assert "| per-token loss, nats |" in section and "| tiny_choice | acc | 3 |" in section
    assert "| positions (window 200) |" in fit.parts_table()
    assert fit_for_use(after, model, original, tokenizer, [TEXT], FinalEvaluation()) is None  # nothing asked


def test_a_range_where_the_original_fails_too_is_said_so_not_blamed_on_the_conversion():
    """Positions 1,024-2,048: the original's own loss rises (a context beyond its own) and is named; 512-1,024: the
    conversion alone degrades and is marked."""
    where = torch.arange(2048)
    original = torch.where(where >= 1024, 3.0, 2.0).double()
    converted = original + torch.where((where >= 512) & (where < 1024), 1.0, 0.5).double()
    found = positions(TokenLosses({"original": original, "converted": converted}, where, where, 2048))
    by_range = {(r.start, r.end): r for r in found.ranges}
    assert found.first["ratio"] == pytest.approx(math.exp(0.5))
    assert by_range[512, 1024].marked and by_range[512, 1024].relative == pytest.approx(math.exp(0.5))
    assert by_range[1024, 2048].original_fails and not by_range[1024, 2048].marked
    assert not any(r.marked or r.original_fails for r in found.ranges if r.end <= 512)
    assert "the original fails here too" in found.table() and "**over 1.2**" in found.table()


def test_a_worst_window_says_whether_it_lies_past_the_fitted_length_or_repeats_its_window(one_thread):
    """Two windows of 8 predictions, the second repeating 1 2 3: a span of 4 past the 4 tokens the model was fitted
    on is said so, a span of repeated runs is said so (with its share counted by hand), a span with neither says
    where it lies and that nothing there repeats."""
    targets = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 1, 2, 3, 1, 2])
    where = torch.arange(8).repeat(2)
    original = torch.zeros(16, dtype=torch.float64)
    converted = original + torch.tensor([0.1] * 4 + [2.0] * 4 + [0.5] * 4 + [3.0] * 4, dtype=torch.float64)
    losses = TokenLosses({"original": original, "converted": converted}, where, targets, 8)
    assert repeated_share(losses, 8, 16, ngram=2) == 4 / 8  # pairs (1,2) (2,3) (3,1) again at 12-15
    assert repeated_share(losses, 8, 16) == 2 / 8  # runs of four: (1,2,3,1) at 11, again at 14; (2,3,1,2) at 15
    assert repeated_share(losses, 0, 8) == 0 and repeated_share(losses, 12, 16, ngram=2) == 1
    found = tails(losses, tiny_tokenizer(), span=4, worst=4, fitted_length=4)
    by_start = {w.start: w.reason for w in found.worst}
    assert [w.start for w in found.worst] == [12, 4, 8, 0]
    assert by_start[12] == ("positions 4-7, past the 4 tokens it was fitted on; repeated text (50% of its tokens "
                            "end a run of 4 seen earlier in the window)")
    assert by_start[4] == "positions 4-7, past the 4 tokens it was fitted on"
    assert by_start[0] == "positions 0-3, within the 4 tokens it was fitted on; 0% repeated"
    assert found.over_margin == 1 and "| why |" in found.table() and by_start[12] in found.table()
    assert found.to_dict()["worst_windows"][0]["reason"] == by_start[12]
    unknown = tails(losses, tiny_tokenizer(), span=4, worst=1)
    assert unknown.worst[0].reason.startswith("repeated text")  # no fitted length: position alone says nothing


def test_the_fitted_length_is_the_records_training_then_calibration_length():
    model = tiny_model("llama")
    assert fitted_length(model) is None  # not converted here
    hf_normswap.convert(model, to="dyt", calibration=None)
    assert fitted_length(model) is None  # the analytic start: no sequence seen
    dataclasses.replace(ConversionRecord.of(model), calibration={"block_len": 32}).attach(model)
    assert fitted_length(model) == 32
    ConversionRecord.amend(model, training={"block_len": 64})
    assert fitted_length(model) == 64
