"""Byte perplexity: ``exp(NLL / bytes)`` over the text's UTF-8 bytes, lm-eval's."""

from .base import ModelMetric, Perplexity, exp_or_inf, register


@register
class BytePerplexity(ModelMetric):
    key, label, order = "byte_perplexity", "byte perplexity", 30

    def value(self, loss: Perplexity) -> float:
        return exp_or_inf(loss.nll / loss.bytes)
