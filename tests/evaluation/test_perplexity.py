"""Perplexity conventions (lm-eval rolling windows), word / byte normalisation, KL and top-1, overlap warnings, CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hf_normswap import convert
from hf_normswap.cli import main
from hf_normswap.data import fingerprint, load_texts
from hf_normswap.evaluation.embeddings import evaluate_embeddings
from hf_normswap.evaluation.metrics.similarity_rank_correlation import spearman
from hf_normswap.evaluation.perplexity import (EvaluationError, PerplexitySettings, evaluate, overlap_warning,
                                              rolling_windows)
from hf_normswap.evaluation.documents import Document, count_bytes, count_words, documents, evaluation_texts
from tiny_models import tiny_model

TEXTS = [
    "the cat sat on the mat .\nthe dog sat on the log .",
    "a café is a small place  where people drink coffee and the cat sleeps on the mat",
    "the " * 50 + "end",
]
WINDOW_32 = PerplexitySettings(max_length=32, progress=False)  # the longest text takes two windows


def word_tokenizer():
    """A word-level fast tokenizer over the test texts (ids < 128 so tiny models accept them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in TEXTS for w in t.split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    assert len(vocab) < 128
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Document(torch.randint(3, 128, (n,), generator=g).tolist(), words=n // 2 + 1, bytes=3 * n) for n in lengths]


def direct_nll(model, tokens, prefix, max_length):
    """Sum of -log p(token) computed position by position from full-window logits, without ``rolling_windows``."""
    seq = torch.tensor([prefix] + tokens)
    n, total = len(tokens), 0.0
    for i in range(n):  # token i is seq[i + 1]
        if i < max_length:
            start = 0  # first window: [prefix] + tokens[: max_length - 1]
        elif (i // max_length + 1) * max_length <= n:
            start = (i // max_length) * max_length  # a full non-overlapping chunk of max_length predictions
        else:
            start = n - max_length  # the last, partial chunk: window right-aligned to the document end
        window = seq[start : start + min(max_length, n)]
        with torch.no_grad():
            logits = model(input_ids=window[None]).logits[0].double()
        total -= torch.log_softmax(logits[i - start], -1)[seq[i + 1]].item()
    return total


@pytest.mark.parametrize("n,length,stride", [(1, 8, None), (8, 8, None), (9, 8, None), (30, 8, None), (30, 8, 3),
                                             (30, 8, 8), (17, 8, 1), (100, 16, 5)])
def test_windows_score_each_token_once_and_match_lm_eval(n, length, stride):
    windows = rolling_windows(n, length, stride)
    scored = []
    for start, size, k in windows:
        assert size <= length and start >= 0 and start + size <= n  # inputs stay inside [prefix] + tokens[:-1]
        scored += list(range(start + size - k, start + size))  # predicted token index = input position
    assert scored == list(range(n))
    lm_utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 100 + n))
    seq = [-1] + tokens
    expected = [lm_utils.make_disjoint_window(w) for w in
                lm_utils.get_rolling_token_windows(tokens, -1, length, length - (stride or length) + 1)]
    assert len(expected) == len(windows)
    for (context, continuation), (start, size, k) in zip(expected, windows):
        full = (context + continuation)[-(length + 1):]  # what lm-eval's HFLM feeds: last max_length+1, minus 1
        assert full[:-1] == seq[start : start + size]
        assert continuation == seq[start + size - k + 1 : start + size + 1]


def test_perplexity_matches_direct_computation_from_logits():
    model = tiny_model("gpt2")
    docs = random_docs([5, 16, 37])
    windows = dict(max_length=16, prefix_token=1, progress=False)
    result = evaluate(model, docs=docs, settings=PerplexitySettings(**windows, batch_size=3))
    nll = sum(direct_nll(model, d.tokens, 1, 16) for d in docs)
    r = result.results["model"]
    assert r.tokens == 58 and result.documents == 3
    assert r.nll == pytest.approx(nll, rel=1e-5)
    assert r.token_perplexity == pytest.approx(math.exp(nll / 58), rel=1e-5)
    # strided windows see more context: a different, still finite total over the same tokens
    strided = evaluate(model, docs=docs, settings=PerplexitySettings(**windows, stride=4))
    assert strided.results["model"].tokens == 58 and math.isfinite(strided.results["model"].nll)


def test_word_and_byte_perplexity_follow_definitions():
    tokenizer = word_tokenizer()
    model = tiny_model("llama")
    result = evaluate(model, tokenizer, TEXTS, settings=WINDOW_32, data="test")
    r = result.results["model"]
    words = sum(len(__import__("re").split(r"\s+", t)) for t in TEXTS)
    nbytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert nbytes > sum(len(t) for t in TEXTS)  # the café makes bytes differ from characters
    assert (r.words, r.bytes, r.tokens) == (words, nbytes, sum(len(t.split()) for t in TEXTS))
    assert r.word_perplexity == pytest.approx(math.exp(r.nll / words))
    assert r.byte_perplexity == pytest.approx(math.exp(r.nll / nbytes))
    assert r.bits_per_byte == pytest.approx(r.nll / (nbytes * math.log(2)))
    assert r.byte_perplexity == pytest.approx(2 ** r.bits_per_byte)
    # the documents start from BOS, and match a direct computation
    prefix = tokenizer.bos_token_id
    nll = sum(direct_nll(model, tokenizer(t, add_special_tokens=False)["input_ids"], prefix, 32) for t in TEXTS)
    assert r.nll == pytest.approx(nll, rel=1e-5)
    assert result.fingerprint == fingerprint(TEXTS)


def test_token_budget_counts_only_the_covered_text():
    tokenizer = word_tokenizer()
    docs = documents(tokenizer, TEXTS, max_tokens=18)
    assert [len(d.tokens) for d in docs] == [14, 4]
    covered = "a café is a"
    assert (docs[1].words, docs[1].bytes) == (count_words(covered), count_bytes(covered))


def test_kl_is_zero_against_itself_and_positive_after_conversion():
    tokenizer = word_tokenizer()
    original = tiny_model("llama")
    same = evaluate(copy.deepcopy(original), tokenizer, TEXTS, against=original, settings=WINDOW_32)
    assert same.kl["converted"] == pytest.approx(0.0, abs=1e-6)
    assert same.top1["converted"] == 1.0
    assert same.ratio("converted") == pytest.approx(1.0)
    converted = copy.deepcopy(original)
    convert(converted, to="eln")
    result = evaluate(converted, tokenizer, TEXTS, against=original, settings=WINDOW_32)
    assert result.kl["converted"] > 1e-4
    assert 0.0 <= result.top1["converted"] <= 1.0
    # KL on the first document, directly from the logits
    one = evaluate(converted, tokenizer, TEXTS[:1], against=original, settings=WINDOW_32)
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        p = torch.log_softmax(original(ids[:, :-1]).logits[0].double(), -1)
        q = torch.log_softmax(converted(ids[:, :-1]).logits[0].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert one.kl["converted"] == pytest.approx(kl, rel=1e-4)
    top1 = (p.argmax(-1) == q.argmax(-1)).double().mean().item()
    assert one.top1["converted"] == pytest.approx(top1)
    card = result.card("converted")
    assert card["metrics"]["token perplexity"]["original"] == result.results["original"].token_perplexity
    assert "| token perplexity |" in card["table"] and "ratio" in card["table"]


def test_not_a_causal_lm_is_a_user_error():
    with pytest.raises(EvaluationError, match="causal"):
        evaluate(tiny_model("t5"), docs=random_docs([4]), settings=PerplexitySettings(prefix_token=1, progress=False))


def test_a_window_beyond_either_models_context_is_refused_naming_that_model():
    long_context, short_context = tiny_model("llama"), tiny_model("llama", max_position_embeddings=16)
    settings = PerplexitySettings(max_length=32, prefix_token=1, progress=False)
    with pytest.raises(EvaluationError, match=r"^max_length 32 is longer than the context of original \(16 tokens\)"):
        evaluate(long_context, docs=random_docs([40]), against=short_context, settings=settings)
    with pytest.raises(EvaluationError, match="causal"):  # what the model is, before the window it is asked for
        evaluate(tiny_model("t5"), docs=random_docs([40]), settings=settings)


def test_the_evaluation_texts_are_the_held_out_half_unless_the_spec_names_a_split():
    held_out = evaluation_texts("builtin", None, None, None)
    assert held_out == load_texts("builtin", "evaluation") != load_texts("builtin", "calibration")
    assert evaluation_texts("builtin:calibration", None, None, None) == load_texts("builtin", "calibration")


def test_overlap_warning(tmp_path):
    calib, held_out = load_texts("builtin", "calibration"), load_texts("builtin", "evaluation")
    assert overlap_warning("builtin", calib, "builtin", held_out) is None  # the two builtin halves are disjoint
    assert "builtin:calibration" in overlap_warning("builtin", calib, "builtin:calibration", calib)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXTS[0])
    b.write_text(TEXTS[0])
    assert overlap_warning(str(a), None, str(a), None)  # same spec
    assert "share 1" in overlap_warning(str(a), load_texts(str(a)), str(b), load_texts(str(b)))  # same content
    assert overlap_warning(None, None, str(b), [TEXTS[0]], calib_fingerprint=fingerprint([TEXTS[0]]))
    assert overlap_warning(None, None, str(b), [TEXTS[1]], calib_fingerprint=fingerprint([TEXTS[0]])) is None


@pytest.fixture
def saved_model(tmp_path):
    model, tokenizer = tiny_model("llama"), word_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "text.txt"
    data.write_text(TEXTS[1])
    return tmp_path / "model", data


def test_cli_eval_json_against_itself_and_overlap_warning(saved_model, capsys):
    model, data = saved_model
    assert main(["eval", str(model), "--against", str(model), "--data", str(data), "--json", "--calib", str(data)]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["kl"]["converted"] == pytest.approx(0.0, abs=1e-6) and result["top1_agreement"]["converted"] == 1.0
    assert result["results"]["original"]["tokens"] == len(TEXTS[1].split())
    assert err.count("normswap: warning:") == 1 and "not on held-out text" in err


def test_cli_eval_table_and_user_errors(saved_model, capsys, tmp_path):
    model, data = saved_model
    assert main(["eval", str(model), "--data", str(data), "--max-length", "8", "--stride", "4"]) == 0
    out, err = capsys.readouterr()
    assert "| token perplexity |" in out and "stride 4" in out
    assert main(["eval", str(model), "--data", str(tmp_path / "missing.txt")]) == 2
    assert main(["eval", str(model), "--data", str(data), "--max-length", "8", "--stride", "9"]) == 2
    assert main(["eval", str(model), "--max-tokens", "0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 3 and all(line.startswith("normswap: error:") for line in err)
    assert "--stride 9 is longer than --max-length 8" in err[1]


def test_cli_convert_eval_prints_and_stores_the_table(saved_model, capsys, monkeypatch):
    model, data = saved_model
    stored = {}
    real = __import__("hf_normswap.conversion.run", fromlist=["evaluate_conversion"]).evaluate_conversion

    def spy(*args):
        card = real(*args)
        stored.update(card)
        return card

    monkeypatch.setattr("hf_normswap.conversion.run.evaluate_conversion", spy)
    assert main(["convert", str(model), "--to", "dyt", "--eval", str(data)]) == 0
    out = capsys.readouterr().out
    assert "| metric | original | converted | ratio |" in out
    assert stored["tokens"] == len(TEXTS[1].split()) and stored["table"] in out
    assert set(stored["metrics"]["word perplexity"]) == {"original", "converted"}


def test_converted_checkpoint_runs_in_lm_eval_with_the_same_perplexity(tmp_path):
    """``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`` on a local rolling-loglikelihood task
    gives the word / byte perplexity that ``evaluate`` gives for the same checkpoint and text."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    import hf_normswap

    model, tokenizer = tiny_model("llama"), word_tokenizer()
    convert(model, to="eln")
    directory = tmp_path / "ckpt"
    hf_normswap.save_pretrained(model, directory, tokenizer=tokenizer)
    texts = TEXTS + ["the cat " * 70 + "end"]  # 141 tokens: three windows of the 64-token context
    rows = tmp_path / "docs.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_ppl.yaml").write_text(f"""task: normswap_local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={directory},trust_remote_code=True",
                                  tasks=["normswap_local_ppl"], task_manager=TaskManager(include_path=str(tasks)),
                                  batch_size=1, device="cpu")
    theirs = out["results"]["normswap_local_ppl"]
    reloaded = hf_normswap.load(directory)
    ours = evaluate(reloaded, tokenizer, texts, settings=PerplexitySettings(progress=False)).results["model"]  # default window: 64, as lm-eval
    assert theirs["word_perplexity,none"] == pytest.approx(ours.word_perplexity, rel=1e-4)
    assert theirs["byte_perplexity,none"] == pytest.approx(ours.byte_perplexity, rel=1e-4)
    assert theirs["bits_per_byte,none"] == pytest.approx(ours.bits_per_byte, rel=1e-4)


def test_recorded_calibration_of_a_checkpoint_is_checked(tmp_path):
    from hf_normswap.conversion.evaluation import calibration_overlap as _calibration_overlap

    data = tmp_path / "t.txt"
    data.write_text(TEXTS[0])
    texts = load_texts(str(data), "evaluation")
    same = {"data": str(data), "fingerprint": fingerprint(texts)}
    assert "not on held-out text" in _calibration_overlap(None, same, str(data), texts)
    renamed = {"data": "/elsewhere/copy.txt", "fingerprint": fingerprint(texts)}  # same content, other name
    assert "same content" in _calibration_overlap(None, renamed, str(data), texts)
    builtin = {"data": "builtin", "fingerprint": fingerprint(load_texts("builtin", "calibration"))}
    assert _calibration_overlap(None, builtin, "builtin", load_texts("builtin", "evaluation")) is None
    assert _calibration_overlap(None, None, str(data), texts) is None  # analytic conversion: nothing to compare


SENTENCES = ("the cat sat on the mat . the dog sat on the log .\n\na small café where people drink coffee .\n"
             "the cat sleeps on the log . the dog sat on the mat and the cat sat on the log .")


def test_encoder_embeddings_agree_with_themselves_and_drift_after_conversion():
    original, tokenizer = tiny_model("bert"), word_tokenizer()
    same = evaluate_embeddings(copy.deepcopy(original), original, tokenizer, [SENTENCES])
    assert same.sentences == 5 and same.tokens == len(SENTENCES.split())  # this tokenizer adds no special tokens
    assert same.results["converted"]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert same.results["converted"]["nearest_neighbour_agreement"] == 1.0
    assert same.results["converted"]["spearman"] == pytest.approx(1.0)
    converted = copy.deepcopy(original)
    convert(converted, to="dyt", input_scale=30.0)
    drift = evaluate_embeddings(converted, original, tokenizer, [SENTENCES]).results["converted"]
    assert -1 <= drift["cosine"] < 0.999 and 0 <= drift["nearest_neighbour_agreement"] <= 1
    assert -1 <= drift["spearman"] < 1


def test_spearman_matches_scipy():
    from scipy.stats import spearmanr

    a, b = torch.randn(200, generator=torch.Generator().manual_seed(0)), torch.randn(200)
    b = a + b
    assert spearman(a, b) == pytest.approx(spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-12)


def test_cli_eval_of_an_encoder_prints_embedding_agreement(tmp_path, capsys):
    model, tokenizer = tiny_model("bert"), word_tokenizer()
    model.save_pretrained(tmp_path / "encoder")
    tokenizer.save_pretrained(tmp_path / "encoder")
    data = tmp_path / "sentences.txt"
    data.write_text(SENTENCES)
    assert main(["eval", str(tmp_path / "encoder"), "--against", str(tmp_path / "encoder"), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "5 sentences" in out and "| embedding cosine to original (mean) | 1 | 1 |" in out
    assert main(["eval", str(tmp_path / "encoder"), "--data", str(data)]) == 2
    assert "pass --against ORIGINAL" in capsys.readouterr().err


def test_cli_eval_of_a_converted_checkpoint_asks_nothing_and_warns_of_nothing(tmp_path, capsys, monkeypatch):
    import hf_normswap

    model = tiny_model("llama")
    convert(model, to="eln")
    hf_normswap.save_pretrained(model, tmp_path / "converted", tokenizer=word_tokenizer())
    data = tmp_path / "text.txt"
    data.write_text(TEXTS[1])

    prompts = []
    monkeypatch.setattr("builtins.input", lambda *args: prompts.append(args) or "")  # transformers' y/N question
    assert main(["eval", str(tmp_path / "converted"), "--data", str(data)]) == 0
    out, err = capsys.readouterr()
    assert "| token perplexity |" in out and not prompts
    assert "custom code" not in out + err and "model of type" not in out + err
