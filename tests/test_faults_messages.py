"""The messages a careful user meets: each names the problem and the real fix, in one line, and a result file stays
valid JSON whatever the scores."""

from __future__ import annotations

import json
import math
import re
import threading

import pytest
import torch

from cli_runs import recipe_refusal
from hf_normswap.data.generated import SamplingSettings, draw, sample_texts
from hf_normswap.data.sample_cache import SampleCache
from tiny_models import full_length_tokenizer, tiny_model, tiny_tokenizer

SETTINGS = SamplingSettings(length=12, batch_size=2, seed=1, precision="fp32")


def _strict(text: str):
    """JSON as a strict parser reads it: ``Infinity`` and ``NaN`` are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_scores_that_are_not_finite_are_written_as_null(tmp_path):
    """``eval --json`` and summary.json wrote ``Infinity`` / ``NaN``, which jq and JavaScript refuse."""
    from hf_normswap.evaluation import finite_json
    from hf_normswap.training.run_dir import write_json

    data = {"perplexity": math.inf, "history": [{"loss": math.nan}, {"loss": 1.5}], "ratio": (2.0, -math.inf)}
    expected = {"perplexity": None, "history": [{"loss": None}, {"loss": 1.5}], "ratio": [2.0, None]}
    assert _strict(finite_json.dumps(data)) == expected
    write_json(tmp_path / "summary.json", data)
    assert _strict((tmp_path / "summary.json").read_text()) == expected


def test_eval_json_is_valid_json_when_a_score_overflows(tmp_path, capsys):
    """A model whose logits reach 1e36: its perplexity is past what a float holds."""
    from hf_normswap import cli

    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(1e37)
    model.save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    (tmp_path / "text.txt").write_text("the model of the norm and the data in the text\n" * 20)
    assert cli.main(["eval", str(tmp_path / "llama"), "--data", str(tmp_path / "text.txt"), "--max-length", "32",
                     "--json"]) == 0
    out = capsys.readouterr().out
    results = list(_strict(out)["results"].values())
    assert "Infinity" not in out and results[0]["token_perplexity"] is None


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_lock_that_is_a_link_or_a_folder_is_named(tmp_path, kind):
    """``Too many levels of symbolic links``, naming neither the lock nor what to do."""
    model = tiny_model("llama")
    cache = SampleCache(model, SETTINGS, tmp_path / "cache")
    cache.prepare()
    lock = cache.directory / ".batch-000000.lock"
    (tmp_path / "mine.txt").write_text("mine")
    lock.symlink_to(tmp_path / "mine.txt") if kind == "link" else lock.mkdir()
    with pytest.raises(ValueError) as error:
        draw(model, tiny_tokenizer(), cache, [0], progress=False)
    assert str(error.value).startswith(f"generated: cannot write the sample cache {cache.directory} ({lock.name} is "
                                       f"a {kind}, not its lock file: ") and f"move {lock} away" in str(error.value)
    assert (tmp_path / "mine.txt").read_text() == "mine"


def test_no_bos_or_eos_names_the_flags_the_user_has():
    """The default convert told the user to "set prompt=SOURCE", a spec they never gave."""
    tokenizer = full_length_tokenizer()
    tokenizer.bos_token = None
    with pytest.raises(ValueError) as error:
        sample_texts(tiny_model("llama"), tokenizer, SETTINGS, 24, progress=False, cache_dir=None)
    assert "prompt=SOURCE" not in str(error.value) and "--calib FILE" in str(error.value)
    assert "calibration.data=FILE" in str(error.value)


def test_two_runs_sharing_a_draw_say_what_each_sampled(tmp_path, capsys):
    """Two runs drawing the same batches at once each printed the whole count as sampled."""
    import time

    tokenizer, models = full_length_tokenizer(), [tiny_model("llama") for _ in range(2)]
    for model in models:  # slow enough that each reaches a batch while the other draws it
        generate = model.generate
        model.generate = lambda generate=generate, **kw: time.sleep(0.3) or generate(**kw)
    start = threading.Barrier(2)

    def run(model):
        start.wait()
        sample_texts(model, tokenizer, SETTINGS, 4 * 24, cache_dir=tmp_path)

    threads = [threading.Thread(target=run, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[generated]")]
    sampled = [int(m.group(1).replace(",", "")) for m in map(re.compile(r"\[generated\] ([\d,]+) tokens sampled")
                                                              .match, lines) if m]
    assert len(lines) == 2 and sum(sampled) == 4 * 24, lines  # each batch sampled once, by one of them
    assert any("another run drew at the same time reused" in line for line in lines), lines


def test_an_untrained_original_is_named_not_the_start_without_text():
    """A random model whose original is as uniform: the check blamed "the start without text"."""
    from hf_normswap.evaluation.conversion_check import ConversionCheck
    from hf_normswap.model_inputs import ModelFacts

    model = tiny_model("llama")
    check = ConversionCheck(model, ModelFacts.read(model))
    check.original = 0.95 * check.vocabulary
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the converted model: uniform
    result = check.after(model)
    warning = result.warning()
    assert not result.failed and "start without text" not in warning and "it looks untrained" in warning


@pytest.mark.usefixtures("no_loading")
@pytest.mark.parametrize("setting, message", [
    ("calibration.batch_size=1e9", "setting calibration.batch_size: 1000000000.0 is not an integer (digits, e.g. 64)"),
    ("block_len=2.5", "setting block_len: 2.5 is not an integer (digits, e.g. 64)"),
    ("distill.weight=abc", "setting distill.weight: 'abc' is not a number (e.g. 0.5)"),
])
def test_a_value_of_another_type_is_the_projects_one_line(tmp_path, capsys, setting, message):
    """``calibration.batch_size=1e9``: OmegaConf's ``Value '1000000000.0' of type 'float' could not be converted to
    Integer``."""
    err = recipe_refusal([f"output_dir={tmp_path / 'run'}", setting], capsys)
    assert err.strip().endswith(message) and "could not be converted" not in err


def test_a_tokenizer_that_cannot_pad_is_refused_before_calibration(tmp_path, monkeypatch, capsys):
    """No pad, end-of-sequence or unknown token: refused "before anything loads", but after the calibration."""
    import contextlib
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    import hf_normswap
    from hf_normswap.training.recovery_run import resolve_run
    from hf_normswap.training import recipe_models, recipe_settings

    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    vocab = {word: i for i, word in enumerate("the model of norm and data".split())}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab))).save_pretrained(folder)
    monkeypatch.setattr(hf_normswap, "convert", lambda *a, **k: pytest.fail("calibration started"))
    config = recipe_settings.load_config([f"model={folder}", f"output_dir={tmp_path / 'run'}", "block_len=32",
                                          "calibration.block_len=32", "final_eval.max_length=32"])
    state = SimpleNamespace(is_main_process=True, main_process_first=contextlib.nullcontext,
                            device=torch.device("cpu"))
    with pytest.raises(SystemExit) as exit:
        recipe_models.load_models(resolve_run(config), state)
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().endswith("the tokenizer has no pad, end-of-sequence or unknown token to "
                                                    "pad with")
