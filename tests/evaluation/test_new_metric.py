"""A metric of the side-by-side evaluation is one file: a copy of the package whose ``evaluation/metrics/`` alone
gains a file (a figure of each model from its loss, one against the original from both models' next-token
distributions, one of a sentence encoder's embeddings) shows it in ``normswap eval``'s table and ``--json``, in the
recipe's final evaluation (its ``summary.json`` entry and the model card), with the figure computed by hand, while
the rows that were there stay in their order."""

from __future__ import annotations

import json
import textwrap

import pytest

from hf_normswap.evaluation.metrics import ModelMetric, register
from package_copy import PACKAGE, copy_package, run_python

NEW = {
    "evaluation/metrics/nats_per_token.py": '''
"""Nats per token: the mean loss, a figure only this test's copy has."""

from .base import ModelMetric, Perplexity, register


@register
class NatsPerToken(ModelMetric):
    key, label, order = "nats_per_token", "nats per token", 15

    def value(self, loss: Perplexity) -> float:
        return loss.nll / loss.tokens
''',
    "evaluation/metrics/top5_agreement.py": '''
"""Top-5 agreement: the original's most likely next token is among the model's five most likely."""

from .base import AgreementMetric, ScoredPositions, register


@register
class Top5Agreement(AgreementMetric):
    key, label, order = "top5_agreement", "top-5 agreement", 70

    def total(self, scored: ScoredPositions) -> float:
        best = scored.reference.argmax(-1, keepdim=True)
        return int((scored.model.topk(5, dim=-1).indices == best).any(-1).sum())
''',
    "evaluation/metrics/pair_cosine_error.py": '''
"""Mean pair-cosine error: how far the model's sentence similarities are from the original's, 0 for a copy."""

from .base import EmbeddingMetric, Similarities, register


@register
class PairCosineError(EmbeddingMetric):
    key, label, order, perfect = "pair_cosine_error", "mean pair-cosine error", 40, 0.0

    def value(self, reference: Similarities, model: Similarities) -> float:
        return float((reference.pairs - model.pairs).abs().mean())
''',
}

TEXT = "the model of the norm and the data in the text. The norm of the data is a model."
SENTENCES = ("the model of the norm and the data in the text. The norm of the data is a model of the text. "
             "A text of the model and the norm is the data. The data of the norm is in the model and the text.")

USE = textwrap.dedent("""
    import contextlib, io, json, sys
    from pathlib import Path
    import torch
    import hf_normswap
    from hf_normswap.cli import main
    from hf_normswap.training.config import FinalEvaluation
    from hf_normswap.training.recipe_results import final_evaluation
    from tiny_models import tiny_model, tiny_tokenizer
    assert Path(hf_normswap.__file__).parent == Path(sys.argv[1]), hf_normswap.__file__
    out, tokenizer = Path(sys.argv[2]), tiny_tokenizer()
    (out / "text.txt").write_text(sys.argv[3])
    (out / "sentences.txt").write_text(sys.argv[4])
    models = {}
    for kind in ("llama", "bert"):
        original = tiny_model(kind)
        original.save_pretrained(out / f"{kind}-original")
        tokenizer.save_pretrained(out / f"{kind}-original")
        converted = tiny_model(kind)
        hf_normswap.convert(converted, to="eln", input_scale=1.0)
        hf_normswap.save_pretrained(converted, out / f"{kind}-eln", tokenizer=tokenizer)
        models[kind] = converted, original

    def cli(*args):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([str(a) for a in args]) == 0
        return printed.getvalue()

    lm = ["eval", out / "llama-eln", "--against", out / "llama-original", "--data", out / "text.txt",
          "--max-length", "64"]
    encoder = ["eval", out / "bert-eln", "--against", out / "bert-original", "--data", out / "sentences.txt"]
    itself = ["eval", out / "llama-original", "--against", out / "llama-original", "--data", out / "text.txt",
              "--max-length", "64", "--json", "--no-tails"]
    model, original = models["llama"]
    with torch.no_grad():  # one window: the prefix and the text, every token predicted
        ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(sys.argv[3], add_special_tokens=False)["input_ids"]])
        best = original(input_ids=ids[:, :-1]).logits[0].argmax(-1, keepdim=True)
        top5 = (model(input_ids=ids[:, :-1]).logits[0].topk(5, dim=-1).indices == best).any(-1).double().mean()
    after = final_evaluation(model, original, tokenizer, [sys.argv[3]], "text", FinalEvaluation(max_length=64),
                             "finetuned")
    hf_normswap.save_pretrained(model, out / "card", evaluation=after.card("finetuned"))
    print(json.dumps({"table": cli(*lm), "json": json.loads(cli(*lm, "--json")), "itself": json.loads(cli(*itself)),
                      "encoder": cli(*encoder), "encoder_json": json.loads(cli(*encoder, "--json")),
                      "tokens": ids.shape[1] - 1, "top5": float(top5), "summary": after.to_dict(),
                      "card": (out / "card" / "README.md").read_text()}))
""")

ROWS = ["token perplexity", "nats per token", "word perplexity", "byte perplexity", "bits per byte",
        "KL(original ‖ model), nats/token", "top-1 agreement", "top-5 agreement"]
ENCODER_ROWS = ["embedding cosine to original (mean)", "nearest-neighbour agreement",
                "similarity rank correlation (Spearman, all pairs)", "mean pair-cosine error"]


def _rows(table: str, first: str) -> list[list[str]]:
    """The cells of the Markdown table whose header starts with ``first``, row by row (the header left out)."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_a_metric_added_in_one_file_is_in_the_table_the_json_the_summary_and_the_card(tmp_path):
    copy, env = copy_package(tmp_path)
    for path, text in NEW.items():
        (copy / path).write_text(text.lstrip())
    changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.py")
                     if not (PACKAGE / p.relative_to(copy)).is_file()
                     or p.read_bytes() != (PACKAGE / p.relative_to(copy)).read_bytes())
    assert changed == sorted(NEW)
    seen = json.loads(run_python(["-c", USE, str(copy), str(tmp_path), TEXT, SENTENCES], tmp_path, env)
                      .strip().splitlines()[-1])
    found = seen["json"]
    assert found["results"]["original"]["tokens"] == seen["tokens"] < 64  # one window, as computed by hand
    assert found["top5_agreement"]["converted"] == pytest.approx(seen["top5"], abs=1e-12)
    assert found["top1_agreement"]["converted"] <= found["top5_agreement"]["converted"] < 1
    for name in ("original", "converted"):
        result = found["results"][name]
        assert result["nats_per_token"] == pytest.approx(result["nll"] / result["tokens"], rel=1e-12)
    assert seen["itself"]["top5_agreement"] == {"converted": 1.0}

    rows = _rows(seen["table"], "metric")
    assert [row[0] for row in rows] == ROWS  # the new rows where their order puts them, the others as they were
    nats, top5 = rows[1], rows[-1]
    assert nats[1:3] == [f"{found['results'][n]['nats_per_token']:.4g}" for n in ("original", "converted")]
    assert top5 == ["top-5 agreement", "-", f"{seen['top5']:.4g}", ""]
    assert "| per-token loss, nats |" in seen["table"]  # the fit-for-use parts follow as before

    summary = seen["summary"]  # what the recipe writes as summary.json's "finetuned"
    assert summary["top5_agreement"]["finetuned"] > 0 and summary["results"]["finetuned"]["nats_per_token"] > 0
    assert [row[0] for row in _rows(seen["card"], "metric")] == [label.replace("model),", "converted),")
                                                                  for label in ROWS]

    encoder = _rows(seen["encoder"], "metric")
    assert [row[0] for row in encoder] == ENCODER_ROWS
    error = seen["encoder_json"]["results"]["converted"]["pair_cosine_error"]
    assert 0 < error <= 2 and encoder[-1] == ["mean pair-cosine error", "0", f"{error:.4g}"]


def test_a_metric_needs_a_kind_and_a_key_of_its_own():
    class Another(ModelMetric):
        key, label, order = "token_perplexity", "token perplexity again", 99

    with pytest.raises(ValueError, match="two evaluation metrics are named 'token_perplexity'"):
        register(Another)
    with pytest.raises(TypeError, match="is not a ModelMetric"):
        register(dict)
