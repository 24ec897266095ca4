"""Word perplexity: ``exp(NLL / words)``, lm-eval's, comparable across tokenizers (words as ``documents.py`` counts
them)."""

from .base import ModelMetric, Perplexity, exp_or_inf, register


@register
class WordPerplexity(ModelMetric):
    key, label, order = "word_perplexity", "word perplexity", 20

    def value(self, loss: Perplexity) -> float:
        return exp_or_inf(loss.nll / loss.words)
