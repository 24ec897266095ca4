"""Discovery: which modules of a model are norms, and what each one does.

- ``norms.py``: find LayerNorm / RMSNorm modules by behaviour and read their weights (:func:`find_norms`).
- ``roles.py``: label each norm's role in its block (pre-attention, pre-MLP, final, QK, ...) and its layer.
"""
