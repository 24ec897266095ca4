"""Checkpoints: models in and out.

- ``loading.py``: load an original or a converted model from a Hub id, a directory, a ``.gguf`` file or a packaged
  offline model (``packaged.py``).
- ``save_load.py``: the converted checkpoint on disk: save (atomically), load, and the ``normswap`` config block.
- ``remote_code.py``: the ``modeling_normswap.py`` that lets plain transformers load a checkpoint.
- ``model_card.py``: the README.md model card, rendered from the saved config.
- ``hub.py``: push a saved checkpoint to the Hub.
- ``config_checks.py``: checks of a checkpoint's config.json, before anything in it is used.
"""
