"""Evaluation: how close a converted model is to its original.

- ``texts.py``: the evaluation texts, and those texts as scored documents (tokens, words, bytes).
- ``perplexity.py``: token / word / byte perplexity, KL and top-1 agreement against the original.
- ``embeddings.py``: a sentence encoder's embeddings against the original's.
- ``sensitivity.py``: the damage of each norm converted alone, and the greedy order (``normswap sensitivity``).
- ``report.py``: the fit-for-use report of ``eval --against``, from ``token_losses.py`` (every token's loss under
  both models), ``tails.py`` (percentiles, worst windows), ``positions.py`` (the ratio by position),
  ``repetition.py`` (a repeated passage) and ``tasks.py`` (lm-eval tasks on both models, recovery).
- ``conversion_check.py``: original and converted scored on a small slice after a conversion, warning on failure.
- ``finite_json.py``: results as valid JSON (a score that is not finite as null).
"""
