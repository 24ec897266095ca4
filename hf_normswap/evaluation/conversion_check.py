"""Know when a conversion failed: the original and the converted model scored on one small slice, seconds after
the conversion, with a warning that names the cause and the fix when the converted model is far off.

A conversion that ends "saved" can hold a model whose perplexity is 1e169: without a score nothing says so. The
original's score is taken before the conversion (a number, or the slice's embeddings), so no copy of the model is
kept. Language models are scored by perplexity on 512 tokens of the offline held-out text (``builtin``, the half
that default calibration never reads); other models by the cosine of their mean-pooled outputs (for a sentence
encoder, its embeddings) on 32 of its sentences. Without a tokenizer the slice is random token ids.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.record import ConversionRecord
from ..data import DataError, load_texts, token_blocks
from ..model_inputs import (
    ModelFacts, dummy_inputs, first_tensor, forward_without_cache, mean_pool, probe_ids, text_config,
)
from .embeddings import sentences

MAX_RATIO = 50.0  # perplexity ratio above which a conversion has failed
MIN_COSINE = 0.5  # output cosine below which it has
UNIFORM = 0.99  # share of the vocabulary's size at which a perplexity is a uniform guess's
UNTRAINED = 0.9  # share at which the original's own is all but a guess (a randomly initialized model)
WINDOWS, WINDOW_LEN, SENTENCES = 4, 128, 32
DATA = "builtin"


def perplexity(nll: float) -> float:
    """``exp(nll)``, infinite where it is past what a float holds (not capped: a capped 1e304 would read as a
    number to compare against)."""
    return math.exp(nll) if nll < math.log(sys.float_info.max) else math.inf


def not_comparable(original: float, data: str) -> str:
    """Why nothing can be compared to an original whose own perplexity (or output) on ``data`` is not finite, and
    the fix: convert's check and the sensitivity map say the same."""
    return (f"not comparable: the original model's own perplexity on {data} is {original:.4g} (its outputs are not "
            "finite). Fix: check the original's weights, or run it in float32 (--dtype float32)")


@dataclass
class CheckResult:
    """One check: the metric, both models' values, the comparison, and whether it failed."""

    metric: str  # "perplexity" or "cosine"
    data: str  # what was scored
    original: float | None
    converted: float
    value: float  # perplexity ratio, or mean cosine to the original
    failed: bool
    vocabulary: int | None = None  # tokens a perplexity guesses among: one of the original near it is untrained

    @property
    def comparable(self) -> bool:
        """False when the original's own perplexity is not finite: there is nothing to compare against."""
        return self.original is None or math.isfinite(self.original)

    @property
    def untrained(self) -> bool:
        """The converted model guesses uniformly, and so, nearly, does the original (within :data:`MAX_RATIO`):
        the uniform output is the original's, not the conversion's."""
        return (self.metric == "perplexity" and self.comparable and self.vocabulary is not None
                and self.converted >= UNIFORM * self.vocabulary and self.original >= UNTRAINED * self.vocabulary
                and math.isfinite(self.value) and self.value <= MAX_RATIO)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        if self.metric == "perplexity" and not self.comparable:
            return (f"check: perplexity {self.original:.4g} -> {self.converted:.4g} on {self.data}: not comparable, "
                    "the original's own is not finite")
        if self.metric == "perplexity":
            return (f"check: perplexity {self.original:.4g} -> {self.converted:.4g} ({self.value:.4g}x the "
                    f"original's) on {self.data}")
        return f"check: output cosine to the original {self.value:.4g} on {self.data}"

    def warning(self, record: ConversionRecord | None = None) -> str | None:
        """None when the check passed; else the warning, with the cause and the fix read from the converted model's
        record."""
        if not self.comparable:
            return f"the check cannot compare, {not_comparable(self.original, self.data)}"
        if self.untrained:
            return (f"the check cannot judge: the original model's own perplexity on {self.data} is "
                    f"{self.original:.4g}, a uniform guess over its {self.vocabulary} tokens (it looks untrained), "
                    f"and the converted model's is {self.converted:.4g}. Fix: convert a trained model")
        if not self.failed:
            return None
        what = (f"perplexity is {self.value:.3g}x the original's" if self.metric == "perplexity"
                else f"outputs have cosine {self.value:.3g} to the original's")
        if self.metric == "perplexity" and self.value <= MAX_RATIO and math.isfinite(self.value):
            what = (f"output is uniform over its vocabulary (perplexity {self.converted:.4g}, no better than a "
                    f"guess; {self.value:.3g}x the original's)")
        cause, fix = advice(record.calibration if record else None, (record.convert if record else None) or {})
        return f"the conversion failed: the converted model's {what} on {self.data}. Cause: {cause}. Fix: {fix}"


def advice(calibration: dict | None, settings: dict) -> tuple[str, str]:
    """(cause, fix) for a failed check, from how the model was converted (the record's calibration summary and
    convert settings)."""
    if calibration:
        data, strategy = calibration.get("data"), calibration.get("strategy")
        return (f"calibration on {calibration.get('tokens', '?')} tokens of {data} ({strategy}) was too short for "
                "this model",
                "calibrate on more text or more steps (--calib-blocks, --calib-len, --block-steps, --calib DATA), "
                "then recover with recipes/finetune.py")
    if settings.get("input_scale") is not None:
        return (f"the analytic start assumes inputs of RMS {settings['input_scale']:g}, not this model's",
                "leave --input-scale out (each norm's scale is then measured), or better, calibrate (drop "
                "--calib none, or --calib DATA)")
    return ("the start without text (measured on random token ids) is too rough for this model",
            "calibrate: drop --calib none, or --calib DATA")


class ConversionCheck:
    """The original's scores on the check's slice, taken before the conversion; :meth:`after` compares."""

    def __init__(self, model: nn.Module, facts: ModelFacts, tokenizer=None):
        self.perplexity = facts.causal_lm and hasattr(model, "get_output_embeddings") and (
            model.get_output_embeddings() is not None)  # a causal LM is never encoder-decoder (``is_causal_lm``)
        self.batches, self.data = self._slice(model, facts.device, tokenizer)
        self.original = self._score(model)

    def _slice(self, model: nn.Module, device: torch.device, tokenizer) -> tuple[list[dict], str]:
        main = getattr(model, "main_input_name", "input_ids")
        if main != "input_ids":
            return [dummy_inputs(model, batch=WINDOWS, seed=1)], "random inputs"
        if tokenizer is None:
            return [probe_ids(model, WINDOWS, WINDOW_LEN, seed=1)], "random token ids"
        texts = load_texts(DATA, "evaluation")
        if self.perplexity:
            length = min(WINDOW_LEN, getattr(text_config(model), "max_position_embeddings", None) or WINDOW_LEN)
            try:
                ids = token_blocks(tokenizer, texts, WINDOWS, length)
            except DataError:  # a tokenizer that makes too few tokens of the text: the check still runs
                return [probe_ids(model, WINDOWS, WINDOW_LEN, seed=1)], "random token ids"
            inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
            return [inputs], f"{ids.numel()} tokens of the offline held-out text"
        rows = sentences(texts, tokenizer, max_sentences=SENTENCES)
        length = min(WINDOW_LEN, (getattr(text_config(model), "max_position_embeddings", None) or 256) // 2)
        groups = [rows] if tokenizer.pad_token is not None else [[row] for row in rows]  # no padding: one by one
        batches = []
        for group in groups:
            encoded = tokenizer(group, truncation=True, max_length=length, padding=len(group) > 1,
                                return_tensors="pt")
            inputs = {k: v.to(device) for k, v in encoded.items()}
            if getattr(model.config, "is_encoder_decoder", False):
                inputs["decoder_input_ids"] = inputs["input_ids"]
            batches.append(inputs)
        return batches, f"{len(rows)} sentences of the offline held-out text"

    @torch.no_grad()
    def _score(self, model: nn.Module):
        was_training = model.training
        model.eval()
        try:
            outputs = [first_tensor(forward_without_cache(model, inputs)).float() for inputs in self.batches]
        finally:
            model.train(was_training)
        if self.perplexity:
            out, ids = outputs[0], self.batches[0]["input_ids"]
            self.vocabulary = out.shape[-1]
            loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
            return perplexity(float(loss)) if math.isfinite(float(loss)) else math.inf
        pooled = []
        for out, inputs in zip(outputs, self.batches):
            mask = inputs.get("attention_mask")
            pooled.append(mean_pool(out, mask if mask is not None and mask.shape == out.shape[:2] else None).cpu())
        return torch.cat(pooled)

    def after(self, model: nn.Module) -> CheckResult:
        """Score the converted model on the same slice and compare."""
        converted = self._score(model)
        if self.perplexity:
            if not math.isfinite(self.original):  # nothing to compare against (CheckResult.warning says so)
                return CheckResult("perplexity", self.data, self.original, converted, math.nan, failed=False)
            ratio = converted / self.original if self.original else math.inf
            # no better than a uniform guess over the vocabulary is a failure whatever the ratio (a tiny original)
            uniform = converted >= UNIFORM * self.vocabulary > self.original
            result = CheckResult("perplexity", self.data, self.original, converted, ratio,
                                 failed=not math.isfinite(ratio) or ratio > MAX_RATIO or uniform,
                                 vocabulary=self.vocabulary)
            return dataclasses.replace(result, failed=result.failed and not result.untrained)
        cosine = float(F.cosine_similarity(converted, self.original, dim=-1).mean())
        return CheckResult("cosine", self.data, None, cosine, cosine,
                           failed=not math.isfinite(cosine) or cosine < MIN_COSINE)
