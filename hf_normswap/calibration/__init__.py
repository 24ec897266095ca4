"""Calibration: fit the new modules' parameters to the model's own activations.

- ``calibrate.py``: :class:`CalibrationConfig`, the strategies, and the driver ``calibrate_and_replace``.
- ``capture.py``: sample each norm's inputs with forward hooks.
- ``fitting.py``: the per-norm least-squares fit and the saturating start.
- ``block_pass.py``: the sequential pass, one block at a time, tuning each block against the original's output.
- ``reconstruct.py``: block-wise reconstruction (the block's own weights in the tuning) and its error measure.
- ``end_to_end.py``: the final steps on the model's output (KL to the original's logits).
- ``activation_cache.py``: the hidden states kept between blocks, in memory or spilled to disk.
- ``report.py``: the per-norm fit table and the plots of each fit.
- ``defaults.py``: the calibration a conversion that names none gets (the original's samples, or builtin text).
- ``input_scales.py``: the start without text, each norm's inputs measured in one pass on random token ids.

The batches come from ``hf_normswap.data`` (``model_batches``), in one call.
"""
