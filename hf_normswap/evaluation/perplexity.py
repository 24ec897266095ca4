"""Perplexity with lm-evaluation-harness conventions, and agreement of a converted model with its original.

Conventions, matched to lm-eval's ``loglikelihood_rolling`` (``get_rolling_token_windows`` + ``make_disjoint_window``
with ``context_len=1``, its default for perplexity tasks):

- every document is scored on its own; its tokens (no special tokens added) follow one prefix token, the tokenizer's
  BOS or else EOS, so the first token is predicted too;
- windows are ``max_length`` long and do not overlap: each token is scored exactly once; the first window predicts
  the first ``max_length`` tokens, each later one the next ``max_length`` (the last window is right-aligned to the
  end of the document, keeping a full context, and scores only its new tokens);
- ``stride=S`` scores only the last ``S`` tokens of each later window (lm-eval's ``context_len = max_length - S + 1``,
  the Hugging Face "strided perplexity"): more context per token, ``max_length / S`` times the compute;
- ``max_length`` defaults as lm-eval's: the config's ``n_positions`` / ``max_position_embeddings`` / ``n_ctx``,
  then the tokenizer's ``model_max_length``, then 2048;
- token perplexity ``exp(NLL / tokens)``, word perplexity ``exp(NLL / words)`` with ``words = len(re.split(r"\\s+",
  text))`` per document, byte perplexity ``exp(NLL / bytes)`` and bits per byte ``NLL / (bytes * ln 2)`` with UTF-8
  bytes. NLL is summed in nats over all scored tokens of all documents.

With a reference (``against=``) every model sees the same windows in the same pass, and the agreement metrics are
read from both models' next-token distributions at every scored position: ``KL(reference || model)`` averaged over
scored tokens (nats/token), and top-1 agreement, the fraction of scored positions where both argmaxes agree. Each
figure of the table is one file of ``metrics/``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data import BUILTIN
from ..data import fingerprint as content_fingerprint
from ..model_inputs import check_context, context_length, is_causal_lm, model_device
from .documents import Document, documents
from .metrics import AgreementMetric, ModelMetric, Perplexity, ScoredPositions, number, registered

DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when neither config nor tokenizer gives one
TOKENIZER_INFINITY = 1000000000000000019884624838656
REFERENCE = "original"
LOGIT_CHUNK = 1024  # positions per log-softmax chunk: bounds the extra memory to chunk x vocab floats


class EvaluationError(ValueError):
    """The evaluation request cannot be run; the message says what to change."""


def rolling_windows(n_tokens: int, max_length: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """``(start, length, scored)`` windows over the sequence ``[prefix] + tokens`` (``n_tokens`` tokens).

    The window feeds ``seq[start : start + length]``, predicts ``seq[start + 1 : start + length + 1]``, and counts its
    last ``scored`` predictions. Same windows as lm-eval's ``get_rolling_token_windows`` + ``make_disjoint_window``
    with ``context_len = max_length - stride + 1``.
    """
    stride = stride or max_length
    if not 1 <= stride <= max_length:
        raise EvaluationError(f"stride {stride} must be between 1 and the window length {max_length}")
    if n_tokens <= 0:
        return []
    first = min(max_length, n_tokens)
    windows = [(0, first, first)]
    predicted = first
    while predicted < n_tokens:
        scored = min(n_tokens - predicted, stride)
        end = predicted + scored
        windows.append((end - max_length, max_length, scored))
        predicted = end
    return windows


def check_window(length: int | None, models: Mapping[str, nn.Module], flag: str = "max_length") -> None:
    """A window longer than a model's context is refused before any work, naming the model (``check_context``)."""
    for name, model in models.items():
        try:
            check_context({flag: length}, model, name)
        except ValueError as error:
            raise EvaluationError(str(error)) from None


def default_max_length(model: nn.Module, tokenizer=None) -> int:
    """Context length the way lm-eval resolves it for ``--model hf``."""
    context = context_length(model)
    if context is not None:
        return context
    length = getattr(tokenizer, "model_max_length", None)
    if length is not None and length != TOKENIZER_INFINITY:
        return int(length)
    return DEFAULT_MAX_LENGTH


def _prefix_token(model: nn.Module, tokenizer) -> int:
    for source in (tokenizer, getattr(model, "config", None)):
        for attr in ("bos_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    raise EvaluationError("the tokenizer has neither a BOS nor an EOS token to start documents with")


def _check_causal(name: str, model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise EvaluationError(f"{name}: perplexity needs a decoder-only causal language model, not encoder-decoder")
    if not is_causal_lm(model):
        raise EvaluationError(f"{name}: {type(model).__name__} is not a causal language model; perplexity needs one")


@dataclass
class Evaluation:
    """Perplexities of one or more models on the same windows; with a reference, the agreement metrics too (KL,
    top-1, ...: ``agreement[key][name]``). Its rows are the registered metrics (``metrics/``)."""

    results: dict[str, Perplexity]
    reference: str | None = None
    agreement: dict[str, dict[str, float]] = field(default_factory=dict)
    data: str | None = None
    fingerprint: str | None = None
    max_length: int = 0
    stride: int | None = None
    documents: int = 0

    @property
    def tokens(self) -> int:
        return next(iter(self.results.values())).tokens

    @property
    def kl(self) -> dict[str, float]:
        """``KL(original || model)`` of each model, nats/token: the agreement figure the benchmarks read by name."""
        return self.agreement.get("kl", {})

    @property
    def top1(self) -> dict[str, float]:
        """Top-1 agreement of each model with the original, as the benchmarks read it."""
        return self.agreement.get("top1_agreement", {})

    def candidates(self) -> list[str]:
        return [name for name in self.results if name != self.reference]

    def ratio(self, name: str) -> float | None:
        """Token perplexity of ``name`` over the reference's (1.0 = no loss)."""
        if self.reference is None:
            return None
        return self.results[name].token_perplexity / self.results[self.reference].token_perplexity

    def describe(self) -> str:
        stride = f", stride {self.stride}" if self.stride else ", non-overlapping windows"
        data = f"{self.data} " if self.data else ""
        return (f"{data}({self.tokens} tokens in {self.documents} documents; window {self.max_length}{stride}; "
                f"fingerprint {self.fingerprint or '-'})")

    def table(self) -> str:
        """Markdown table: metrics as rows; reference, each model and its ratio to the reference as columns."""
        names = list(self.results)
        header = ["metric"]
        for name in names:
            header.append(name)
            if self.reference is not None and name != self.reference:
                header.append("ratio" if len(names) == 2 else f"{name} / {self.reference}")
        rows = []
        for metric in registered(ModelMetric):
            row = [metric.label]
            for name in names:
                value = metric.value(self.results[name])
                row.append(metric.format(value))
                if self.reference is not None and name != self.reference:
                    row.append(number(value / metric.value(self.results[self.reference])))
            rows.append(row)
        for metric in registered(AgreementMetric) if self.reference is not None else ():
            row = [metric.table_label]
            for name in names:
                row.append(metric.format(self.agreement[metric.key].get(name)))
                if name != self.reference:
                    row.append("")
            rows.append(row)
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        # the agreement metrics against a reference only: without one there is nothing to agree with
        return {
            "data": self.data, "fingerprint": self.fingerprint, "documents": self.documents, "tokens": self.tokens,
            "max_length": self.max_length, "stride": self.stride, "reference": self.reference,
            "results": {name: r.to_dict() for name, r in self.results.items()},
            **{m.key: self.agreement.get(m.key, {}) for m in registered(AgreementMetric)},
            "ratio": {name: self.ratio(name) for name in self.candidates()} if self.reference else {},
        }

    def card(self, converted: str) -> dict:
        """The ``config.normswap["evaluation"]`` block for one converted model (read by ``model_card``)."""
        if self.reference is None:
            raise EvaluationError("a model-card evaluation needs the original as reference")
        original, model = self.results[self.reference], self.results[converted]
        metrics = {m.label: {"original": m.value(original), "converted": m.value(model)}
                   for m in registered(ModelMetric)}
        metrics.update({m.label: {"original": "-", "converted": self.agreement[m.key][converted]}
                        for m in registered(AgreementMetric)})
        return {
            "dataset": f"{self.data or 'text'}, lm-eval rolling windows of {self.max_length} tokens"
                       + (f", stride {self.stride}" if self.stride else ", non-overlapping"),
            "data": self.data, "fingerprint": self.fingerprint, "tokens": self.tokens,
            "max_length": self.max_length, "stride": self.stride, "metrics": metrics,
            "table": self._pair(converted).table(),
        }

    def _pair(self, converted: str) -> Evaluation:
        keep = {self.reference: self.results[self.reference], "converted": self.results[converted]}
        agreement = {key: {"converted": values[converted]} for key, values in self.agreement.items()}
        return Evaluation(keep, self.reference, agreement, self.data, self.fingerprint, self.max_length,
                          self.stride, self.documents)


class _Scorer:
    """Accumulates NLL per model and, against the reference, each agreement metric's total, over scored
    positions."""

    def __init__(self, names: list[str], reference: str | None):
        self.names, self.reference = names, reference
        self.nll = {n: 0.0 for n in names}
        self.metrics = registered(AgreementMetric) if reference is not None else []
        self.totals = {m.key: {n: 0.0 for n in names if n != reference} for m in self.metrics}

    def add(self, logits: dict[str, torch.Tensor], targets: torch.Tensor) -> None:
        """``logits[name]``: (positions, vocab) for the scored positions; ``targets``: (positions,)."""
        for start in range(0, len(targets), LOGIT_CHUNK):
            part = slice(start, start + LOGIT_CHUNK)
            target = targets[part]
            logp = {n: torch.log_softmax(logits[n][part].float(), dim=-1) for n in self.names}
            for n in self.names:
                self.nll[n] -= logp[n].gather(-1, target[:, None].to(logp[n].device)).double().sum().item()
            if self.reference is None:
                continue
            ref = logp[self.reference]
            for n in self.names:
                if n == self.reference:
                    continue
                scored = ScoredPositions(ref, logp[n].to(ref.device), target.to(ref.device))
                for metric in self.metrics:
                    self.totals[metric.key][n] += metric.total(scored)


def _models_to_score(model, against: nn.Module | None, max_length: int | None) -> dict[str, nn.Module]:
    """Names and checks the models up front, so a mismatch fails before any text is tokenized or scored."""
    models = dict(model) if isinstance(model, Mapping) else {"model" if against is None else "converted": model}
    if against is not None:
        if REFERENCE in models:
            raise EvaluationError(f"the name {REFERENCE!r} is reserved for the reference model")
        models = {REFERENCE: against, **models}
    if not models:
        raise EvaluationError("no model to evaluate")
    for name, m in models.items():
        _check_causal(name, m)
        m.eval()
    check_window(max_length, models)
    vocab_sizes = {name: m.get_output_embeddings().weight.shape[0] for name, m in models.items()
                   if getattr(m, "get_output_embeddings", None) and m.get_output_embeddings() is not None}
    if len(set(vocab_sizes.values())) > 1:
        raise EvaluationError(f"the models have different vocabularies ({vocab_sizes}): compare a converted model "
                              "only with the original it came from")
    return models


def _score_windows(models: dict[str, nn.Module], docs: list[Document], max_length: int, stride: int | None,
                   batch_size: int, prefix: int, reference: str | None, progress: bool) -> tuple[_Scorer, int]:
    """Runs every model on the same windows in one pass, so KL and top-1 compare identical inputs."""
    # All windows of all documents, grouped by length so batches need no padding (padding would change nothing in
    # exact arithmetic but does in floating point, and some models mishandle it).
    windows = [(d, *w) for d, doc in enumerate(docs) for w in rolling_windows(len(doc.tokens), max_length, stride)]
    windows.sort(key=lambda w: -w[2])
    sequences = [torch.tensor([prefix] + doc.tokens, dtype=torch.long) for doc in docs]
    scorer = _Scorer(list(models), reference)
    total = sum(w[3] for w in windows)
    bar = tqdm(total=total, unit="tok", desc="perplexity", disable=not progress, dynamic_ncols=True)
    i = 0
    while i < len(windows):
        length = windows[i][2]
        batch = [windows[i]]
        while len(batch) < batch_size and i + len(batch) < len(windows) and windows[i + len(batch)][2] == length:
            batch.append(windows[i + len(batch)])
        i += len(batch)
        inputs = torch.stack([sequences[d][s : s + n] for d, s, n, _ in batch])
        targets = torch.cat([sequences[d][s + n - k + 1 : s + n + 1] for d, s, n, k in batch])
        logits = {}
        for name, m in models.items():
            out = m(input_ids=inputs.to(model_device(m)), use_cache=False).logits
            rows = [out[b, n - k:] for b, (_, _, n, k) in enumerate(batch)]
            logits[name] = rows[0] if len(rows) == 1 else torch.cat(rows)  # a view when it can: logits are big
            del out
        scorer.add(logits, targets)
        bar.update(sum(k for *_, k in batch))
    bar.close()
    return scorer, total


@dataclass(frozen=True)
class PerplexitySettings:
    """How :func:`evaluate` cuts the text into windows and scores them (the conventions are the module's)."""

    max_length: int | None = None  # window length; default: the model's context, as lm-eval resolves it
    stride: int | None = None  # score only the last ``stride`` tokens of each later window; default: non-overlapping
    max_tokens: int | None = None  # cap on the tokens of ``texts`` scored (for CPU use)
    batch_size: int = 1  # windows a forward pass
    prefix_token: int | None = None  # the token each document follows; default: the tokenizer's BOS, else EOS
    progress: bool = True  # a progress bar over the scored tokens


@torch.no_grad()
def evaluate(
    model: nn.Module | Mapping[str, nn.Module],
    tokenizer=None,
    texts: Iterable[str] | None = None,
    *,
    against: nn.Module | None = None,
    docs: list[Document] | None = None,
    settings: PerplexitySettings = PerplexitySettings(),
    data: str | None = None,
) -> Evaluation:
    """Perplexity of ``model`` (or of each model in a ``{name: model}`` mapping) over ``texts`` or ``docs``, cut and
    scored as ``settings`` say.

    ``against``: the original model; the result then holds it under ``"original"`` with KL and top-1 agreement of
    every other model to it, all computed on the same windows in one pass. ``data`` is the spec recorded with the
    result.
    """
    max_length, stride, max_tokens = settings.max_length, settings.stride, settings.max_tokens
    models = _models_to_score(model, against, max_length)
    first = next(iter(models.values()))
    fingerprint = None
    if docs is None:
        if tokenizer is None or texts is None:
            raise EvaluationError("pass texts with a tokenizer, or pre-tokenized docs")
        texts = list(texts)
        fingerprint = content_fingerprint(texts)
        docs = documents(tokenizer, texts, max_tokens)
    elif max_tokens is not None:
        raise EvaluationError("max_tokens applies to texts; cut pre-tokenized docs yourself")
    if not docs:
        raise EvaluationError("the evaluation text gives no tokens")
    max_length = max_length or min(default_max_length(m, tokenizer) for m in models.values())
    if max_length < 1:
        raise EvaluationError(f"window length must be positive, got {max_length}")
    prefix = _prefix_token(first, tokenizer) if settings.prefix_token is None else settings.prefix_token
    scorer, total = _score_windows(models, docs, max_length, stride, settings.batch_size, prefix,
                                   REFERENCE if against is not None else None, settings.progress)

    tokens = sum(len(d.tokens) for d in docs)
    words, nbytes = sum(d.words for d in docs), sum(d.bytes for d in docs)
    assert total == tokens, "rolling windows must score every token exactly once"
    return Evaluation(
        results={n: Perplexity(scorer.nll[n], tokens, words, nbytes) for n in scorer.names},
        reference=scorer.reference,
        agreement={key: {n: v / tokens for n, v in totals.items()} for key, totals in scorer.totals.items()},
        data=data, fingerprint=fingerprint, max_length=max_length, stride=stride, documents=len(docs),
    )


def overlap_warning(calib_spec: str | None, calib_texts: list[str] | None,
                    eval_spec: str | None, eval_texts: list[str] | None,
                    calib_fingerprint: str | None = None) -> str | None:
    """One line saying how calibration and evaluation data overlap, or None when they are disjoint.

    Compares the resolved specs (``builtin`` means ``builtin:calibration`` for calibration and ``builtin:evaluation``
    for evaluation) and the documents' content hashes, so the same file under two names is caught too.
    ``calib_fingerprint`` (``data.fingerprint`` of the calibration texts, as a checkpoint may record it) stands in
    for calibration texts that are not at hand.
    """
    def resolved(spec, default):
        spec = spec or BUILTIN
        return f"{BUILTIN}:{default}" if spec == BUILTIN else spec

    a, b = resolved(calib_spec, "calibration"), resolved(eval_spec, "evaluation")
    if calib_fingerprint and eval_texts is not None and calib_fingerprint == content_fingerprint(eval_texts):
        return (f"evaluation data {b} has the same content (fingerprint {calib_fingerprint}) as the calibration "
                f"data: the evaluation is not on held-out text")
    if a == b:
        return (f"calibration and evaluation both use {a}: the evaluation is not on held-out text "
                f"(use builtin:evaluation, a test split, or a different file for evaluation)")
    if calib_texts is None or eval_texts is None:
        return None
    digest = lambda t: hashlib.sha256(t.strip().encode()).hexdigest()  # noqa: E731
    shared = {digest(t) for t in calib_texts if t.strip()} & {digest(t) for t in eval_texts if t.strip()}
    if shared:
        return (f"calibration data {a} and evaluation data {b} share {len(shared)} of {len(eval_texts)} evaluation "
                f"documents: the evaluation is not on held-out text")
    return None
