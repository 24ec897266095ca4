"""Bits per byte: ``NLL / (bytes * ln 2)``, lm-eval's, the compression view of the byte perplexity."""

import math

from .base import ModelMetric, Perplexity, register


@register
class BitsPerByte(ModelMetric):
    key, label, order = "bits_per_byte", "bits per byte", 40

    def value(self, loss: Perplexity) -> float:
        return loss.nll / (loss.bytes * math.log(2))
