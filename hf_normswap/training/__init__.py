"""Training: recovery of a converted model against its frozen original.

- ``recipe.py``: the recovery recipe (``normswap recover``, ``recipes/finetune.py``), one
  :class:`~hf_normswap.training.recipe.RecoveryRecipe` whose methods run in order: set up, claim the run folder,
  load, evaluate the start, train, evaluate and save, from the pieces below.
- ``recovery_run.py``: the run resolved once from its settings and its launch (what the recipe, its memory plan and
  the benchmarks read).
- ``recipe_settings.py``, ``recipe_models.py``, ``recipe_data.py``, ``recipe_training.py``, ``recipe_results.py``:
  its settings checked before any load, its models, its training text, the trainer built and trained, its final
  evaluation and save.
- ``trainer.py``: :class:`NormSwapTrainer`; ``recovery_loss.py``: the loss, the sum of the terms of ``loss_terms/``
  (one file a term: the logit terms, hidden states, embedding, scale anchor), on the forwards of ``losses.py``;
  ``trainable.py``: what trains and its optimizer groups; ``step_precision.py``: fp32 or bf16 for the step;
  ``wall_clock.py``: a stop on the wall clock.
- ``head_loss.py``: the logit KL computed in chunks through the output head (Liger-Kernel's fused loss).
- ``compiled_blocks.py``: each repeated block compiled once for a GPU step (the step's tokens come from the memory plan).
- ``layerwise.py``: every block's output pulled toward the original's.
- ``progressive.py``: converting norms a few at a time during training.
- ``taper.py``: every norm blended with its original, the original's share falling to 0 over the run.
- ``hand_overs/``: the hand-overs (one file a kind: progressive, taper), ``hand_over.kind``, the run's chosen and
  checked against the norms and the run before calibration.
- ``saturation.py``: the share of each converted module's elements in the flat part of its function, along the run.
"""
