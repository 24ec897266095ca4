"""Evaluation: how close a converted model is to its original.

- ``documents.py``: the evaluation texts, and those texts as scored documents (tokens, words, bytes).
- ``perplexity.py``: every model scored on the same windows; the side-by-side table, its JSON and the model card's.
- ``embeddings.py``: a sentence encoder's embeddings against the original's; ``embedding_tails.py``: the
  per-sentence cosine's low tail, worst sentences and cosine by sentence length.
- ``metrics/``: the figures of those tables, one file each (token / word / byte perplexity, bits per byte, KL and
  top-1 agreement against the original; the encoder's embedding cosine, nearest-neighbour agreement and similarity
  rank correlation): a new metric is a new file there.
- ``norm_sensitivity.py``: the damage of each norm converted alone, and the greedy order (``normswap sensitivity``).
- ``fit_for_use.py``: the fit-for-use report of ``eval --against``, from ``token_losses.py`` (every token's loss under
  both models), ``tails.py`` (percentiles, worst windows), ``positions.py`` (the ratio by position),
  ``repetition.py`` (a repeated passage) and ``tasks.py`` (lm-eval tasks on both models, recovery).
- ``conversion_check.py``: original and converted scored on a small slice after a conversion, warning on failure.
- ``finite_json.py``: results as valid JSON (a score that is not finite as null).
"""
