"""Evaluation: how close a converted model is to its original.

- ``perplexity.py``: token / word / byte perplexity, KL and top-1 agreement against the original.
- ``embeddings.py``: a sentence encoder's embeddings against the original's.
- ``sensitivity.py``: the damage of each norm converted alone, and the greedy order (``normswap sensitivity``).
"""
