"""Checkpoints: models in and out.

- ``loading.py``: load an original or a converted model from a Hub id, a directory, a ``.gguf`` file or a packaged
  offline model (``packaged.py``).
- ``record.py``: the ``normswap`` block of config.json, typed (``ConversionRecord``, ``NormEntry``).
- ``saving.py``: save a converted model as a checkpoint; ``directory.py``: what in a checkpoint directory is a
  save's and what the user's, and the transaction that puts a new checkpoint in place; ``publish.py``: where a
  finished model goes (saved, pushed, checked to reload), and a save that failed, kept in a temporary directory.
- ``remote_code.py``: the ``modeling_normswap.py`` that lets plain transformers load a checkpoint.
- ``model_card.py``: the README.md model card, rendered from the saved config.
- ``hub.py``: push a saved checkpoint to the Hub.
- ``config_checks.py``: checks of a checkpoint's config.json, before anything in it is used.
"""
