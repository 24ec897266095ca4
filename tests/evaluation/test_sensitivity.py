"""Sensitivity map, greedy curve, budget search, progressive order from a map. Tiny models only."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from hf_normswap.model_inputs import ModelFacts
from hf_normswap.surgery import plan
from hf_normswap.training.hand_overs.progressive import schedule
from hf_normswap.evaluation.norm_sensitivity import (CurvePoint, Measurer, Reference, Score, doubling, largest_within, load_order,
                                     measure_map, plot, select_within_budget)

ANALYTIC = ("--calib", "none")  # the analytic start: quick, and enough for what these tests check

TEXT = ["the quick brown fox jumps over the lazy dog and keeps running through the field " * 40]


@pytest.fixture(scope="module")
def llama_map():
    model = tiny_model("llama")
    _, selected, _ = plan(model)
    reference = Reference(model, ModelFacts.read(model), tiny_tokenizer(), TEXT, windows=2, window_len=32)
    measurer = Measurer(model, reference, "eln", roles=("attention_input", "mlp_input", "final"))
    return model, selected, measurer, measure_map(measurer, selected, progress=False)


def test_map_has_one_entry_per_norm_ranked_by_damage_and_a_nested_curve(llama_map):
    model, selected, measurer, sensitivity = llama_map
    data = sensitivity.to_dict()
    assert [n["name"] for n in data["norms"]] == [i.name for i in selected]  # 2 layers x 2 + final
    assert sorted(n["rank"] for n in data["norms"]) == list(range(5))
    kls = [n["kl"] for n in sorted(data["norms"], key=lambda n: n["rank"])]
    assert kls == sorted(kls) and all(k >= 0 for k in kls)
    assert {n["role"] for n in data["norms"]} == {"attention_input", "mlp_input", "final"}
    assert [n["layer"] for n in data["norms"]] == [0, 0, 1, 1, None]
    assert [p["size"] for p in data["curve"]] == [1, 2, 4, 5]
    assert data["curve"][0]["kl"] == pytest.approx(kls[0], rel=1e-5)  # the first prefix is the cheapest norm alone
    assert data["curve"][-1]["last"] == data["order"][-1]
    # a measurement converts exactly the set asked for: all of them is the plain full conversion
    assert measurer([i.name for i in selected]).kl == pytest.approx(data["curve"][-1]["kl"], rel=1e-5)
    json.dumps(data)  # serializable as `--json` prints it


def test_reference_scores_the_original_as_lossless(llama_map):
    model, _, measurer, _ = llama_map
    score = measurer.reference.score(model)
    assert score.kl == pytest.approx(0.0, abs=1e-6) and score.ppl_ratio == pytest.approx(1.0, abs=1e-5)


def test_doubling_sizes():
    assert doubling(1) == [1] and doubling(5) == [1, 2, 4, 5] and doubling(8) == [1, 2, 4, 8]


def _curve(values: dict[int, float]) -> list[CurvePoint]:
    return [CurvePoint(size, Score(kl=kl, ppl_ratio=1 + kl), f"n{size - 1}") for size, kl in values.items()]


def test_budget_bisects_between_curve_points_for_the_largest_prefix():
    order = [f"n{i}" for i in range(16)]
    truth = lambda k: 0.01 * k  # noqa: E731  kl of the first k norms
    asked = []

    def measure(names):
        asked.append(len(names))
        return Score(kl=truth(len(names)), ppl_ratio=1 + truth(len(names)))

    curve = _curve({k: truth(k) for k in doubling(16)})
    size, curve = largest_within(order, curve, measure, "kl", 0.115)
    assert size == 11 and sorted(asked) == [10, 11, 12]  # between 8 (within) and 16 (over): 12, 10, 11
    size, _ = largest_within(order, _curve({k: truth(k) for k in doubling(16)}), measure, "ppl_ratio", 2.0)
    assert size == 16  # everything within: nothing to bisect
    size, _ = largest_within(order, _curve({k: truth(k) for k in doubling(16)}), measure, "kl", 0.001)
    assert size == 0


def test_budget_records_the_norms_kept_and_why(llama_map):
    model, selected, measurer, sensitivity = llama_map
    kls = sorted(n["kl"] for n in sensitivity.norms)
    limit = (sensitivity.curve[0].score.kl + sensitivity.curve[1].score.kl) / 2  # between 1 and 2 norms
    budget = select_within_budget(sensitivity, measurer, "kl", limit)
    assert budget.converted == sensitivity.order[:1]
    assert [k["name"] for k in budget.kept] == sensitivity.order[1:]
    assert budget.kept[0]["alone"]["kl"] == pytest.approx(kls[1]) and "largest greedy prefix" in budget.kept[0]["reason"]
    with pytest.raises(ValueError, match="does not apply"):
        select_within_budget(sensitivity, measurer, "cosine", 0.99)


def test_progressive_order_from_a_sensitivity_file(tmp_path, llama_map):
    _, selected, _, sensitivity = llama_map
    path = tmp_path / "map.json"
    path.write_text(json.dumps(sensitivity.to_dict()))
    assert load_order(path) == sensitivity.order
    roles = {i.name: i.role for i in selected[1:]}  # one norm left unconverted: the map may rank more
    stages = schedule(roles, order=str(path), group=2, every=5)
    assert [n for s in stages for n in s.names] == [n for n in sensitivity.order if n in roles]
    assert [len(s.names) for s in stages] == [2, 2] and [s.start for s in stages] == [0, 5]
    with pytest.raises(ValueError, match="does not rank"):
        schedule({"other.norm": "final", **roles}, order=str(path))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a sensitivity map"):
        schedule(roles, order=str(tmp_path / "bad.json"))


def test_plot_writes_a_png(tmp_path, llama_map):
    path = plot(llama_map[3], tmp_path / "map.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_encoder_map_scores_embedding_cosine():
    model = tiny_model("bert").bert  # hidden states out, no head: an encoder
    texts = ["a sentence of more than eight words for the tiny encoder here"] * 4
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    _, selected, _ = plan(model)
    measurer = Measurer(model, Reference(model, ModelFacts.read(model), tokenizer, texts, sentences=4), "dyt",
                        roles=("embedding", "post_norm"))
    sensitivity = measure_map(measurer, selected, progress=False)
    assert all(-1 <= n["cosine"] <= 1 and "kl" not in n for n in sensitivity.norms)
    assert sensitivity.to_dict()["metric"] == "cosine"
    ranked = sorted(sensitivity.norms, key=lambda n: n["rank"])
    assert [n["cosine"] for n in ranked] == sorted((n["cosine"] for n in ranked), reverse=True)


@pytest.mark.parametrize("argv, message", [
    (["convert", "m", "--to", "eln", "--budget-ppl-ratio", "0.9"], "--budget-ppl-ratio 0.9 is out of range"),
    (["convert", "m", "--to", "eln", "--budget-kl", "nan"], "--budget-kl nan is out of range"),  # after the search
    (["convert", "m", "--to", "eln", "--budget-ppl-ratio", "inf"], "--budget-ppl-ratio inf is out of range"),
    (["convert", "m", "--to", "eln", "--budget-kl", "0.1", "--budget-cosine", "0.9"], "not allowed with"),
    (["sensitivity", "m", "--to", "eln", "--windows", "0"], "--windows must be at least 1"),
    (["sensitivity", "m", "--to", "eln", "--plot", "/no/such/dir/map.png"], "its directory does not exist"),
])
def test_cli_refuses_bad_budgets_and_slices_before_loading(argv, message, capsys):
    from hf_normswap.cli import main

    with pytest.raises(SystemExit) if "not allowed" in message else nullcontext():  # argparse exits itself
        assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_calibration_text_is_tokenized_once_for_all_measurements(llama_map):
    from hf_normswap.calibration.calibrate import CalibrationConfig

    model, selected, measurer, _ = llama_map
    config = CalibrationConfig(data="builtin", num_blocks=2, block_len=32, strategy="fast", tokenizer=tiny_tokenizer(),
                               progress=False)
    calibrated = Measurer(model, measurer.reference, "eln", config, roles=measurer.roles)
    assert calibrated.calibration.data["input_ids"].shape == (2, 32) and calibrated.summary["data"] == "builtin"
    assert calibrated([selected[0].name]).kl >= 0


def test_convert_budget_converts_within_it_and_refuses_an_impossible_one(tmp_path, monkeypatch, capsys):
    import hf_normswap.cli as cli
    import hf_normswap.conversion.run as conversion_run

    def load(*args, **kwargs):  # a fresh tiny Llama with room for the 256-token slice windows
        return tiny_model("llama", randomize_norms=False, max_position_embeddings=512), tiny_tokenizer()

    monkeypatch.setattr(conversion_run, "load_model", load)
    text, report = tmp_path / "text.txt", tmp_path / "report.json"
    text.write_text(TEXT[0])
    argv = ["convert", "tiny", "--to", "eln", *ANALYTIC, "--budget-data", str(text), "--report", str(report),
            "--roles", "attention_input,mlp_input"]
    assert cli.main(argv + ["--budget-kl", "1e9"]) == 0
    recorded = json.loads(report.read_text())
    assert len(recorded["converted"]) == 4 and recorded["budget"]["kept"] == []
    assert recorded["skipped"][0]["reason"].startswith("role final not selected")
    assert cli.main(argv + ["--budget-kl", "1e-12"]) == 2
    assert "no norm converts within the budget" in capsys.readouterr().err
    assert cli.main(argv + ["--budget-cosine", "0.9"]) == 2
    assert "--budget-cosine does not apply" in capsys.readouterr().err


def test_sensitivity_leaves_the_blocks_weights_alone_unless_asked(tmp_path, monkeypatch):
    """The block strategy fits each block's weights by default; a sensitivity measurement (a few hundred tokens) does
    not, unless --block-weights-lr says so."""
    import hf_normswap.cli as cli

    class Measured(Exception):
        pass

    seen = []

    def measurer(job, model, facts, tokenizer, texts, calibration, **options):
        seen.append(calibration.block_weights_lr)
        raise Measured

    monkeypatch.setattr(cli.sensitivity, "load_model", lambda *a, **k: (tiny_model("llama"), tiny_tokenizer()))
    monkeypatch.setattr(cli.sensitivity, "measurer", measurer)
    text = tmp_path / "text.txt"
    text.write_text(TEXT[0])
    for extra in ([], ["--block-weights-lr", "1e-4"]):
        with pytest.raises(Measured):
            cli.main(["sensitivity", "tiny", "--to", "eln", "--calib", str(text), "--data", str(text), *extra])
    assert seen == [0.0, 1e-4]


def test_sensitivity_json_is_the_whole_of_stdout_with_the_default_calibration(tmp_path, capsys):
    """Without --calib the map calibrates on the original's samples and says so; --json's stdout stays one JSON
    document (the notices go to stderr)."""
    import hf_normswap.cli as cli

    folder = tmp_path / "llama"
    tiny_model("llama", max_position_embeddings=128).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text(TEXT[0])
    assert cli.main(["sensitivity", str(folder), "--to", "eln", "--data", str(text), "--windows", "1",
                     "--window-len", "32", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["norms"] and "calibrating on" in err


@pytest.mark.parametrize("scale", [1e37, float("inf")])
def test_an_original_whose_outputs_are_not_finite_is_not_comparable(scale):
    """``lm_head`` times 1e37: KL 5.9e35 and a perplexity ratio of 0 or 1e304 were printed as a map, exit 0."""
    from hf_normswap.surgery import ConversionError

    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    with pytest.raises(ConversionError, match="the sensitivity map is not comparable: the original model's own "
                                              r"perplexity on 62 evaluation tokens is (inf|nan)"):
        Reference(model, ModelFacts.read(model), tiny_tokenizer(), TEXT * 8, windows=2, window_len=32)
    finite = tiny_model("llama")  # a finite one is compared
    Reference(finite, ModelFacts.read(finite), tiny_tokenizer(), TEXT * 8, windows=2, window_len=32)
