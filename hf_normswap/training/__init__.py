"""Training: recovery of a converted model against its frozen original (``recipes/finetune.py``).

- ``distill.py``: :class:`NormSwapTrainer` (cross-entropy, logit KL, layer-wise and embedding terms) and helpers.
- ``head_loss.py``: the logit KL computed in chunks through the output head.
- ``layerwise.py``: every block's output pulled toward the original's.
- ``progressive.py``: converting norms a few at a time during training.
"""
