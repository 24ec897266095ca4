"""Token perplexity: ``exp(NLL / tokens)``, the figure every ratio in the project is of."""

from .base import ModelMetric, Perplexity, exp_or_inf, register


@register
class TokenPerplexity(ModelMetric):
    key, label, order = "token_perplexity", "token perplexity", 10

    def value(self, loss: Perplexity) -> float:
        return exp_or_inf(loss.nll / loss.tokens)
