"""Training: recovery of a converted model against its frozen original.

- ``recipe.py``: the recovery recipe (``normswap recover``, ``recipes/finetune.py``), one
  :class:`~hf_normswap.training.recipe.RecoveryRecipe` whose methods run in order: set up, claim the run folder,
  load, evaluate the start, train, evaluate and save, from the pieces below.
- ``recovery_run.py``: the run resolved once from its settings and its launch (what the recipe, its memory plan and
  the benchmarks read).
- ``config.py``: the recipe's settings, typed; ``recipe_settings.py``, ``recipe_models.py``, ``recipe_data.py``,
  ``recipe_training.py``, ``recipe_results.py``: its settings read and checked before any load, its models, its
  training text, the pieces of its training step, its final evaluation and save.
- ``run_dir.py``, ``run_lock.py``: the run folder the recipe owns and resumes from, one launch at a time in it.
- ``trainer.py``: :class:`NormSwapTrainer`; ``recovery_loss.py``: the loss, the sum of the terms of ``loss_terms/``
  (one file a term: the logit terms, hidden states, embedding, attention, scale anchor), on the forwards of
  ``losses.py``; ``scale_anchor.py``: the scale anchor (its error and its hooks); ``trainable.py``: what trains and its
  optimizer groups; ``step_precision.py``: fp32 or bf16 for the step; ``wall_clock.py``: a stop on the wall clock;
  ``divergence.py``: a diverged model never evaluated, saved or pushed.
- ``head_loss.py``: the logit KL computed in chunks through the output head (Liger-Kernel's fused loss).
- ``compiled_blocks.py``: each repeated block compiled once for a GPU step (the step's tokens come from the memory plan).
- ``layerwise.py``: every block's output pulled toward the original's.
- ``hand_overs/``: the hand-overs, one file a kind (``progressive.py``: a few norms at a time; ``taper.py``: every
  norm blended with its original, the original's share falling to 0), through the blend of ``blend.py``;
  ``hand_over.kind`` names one, checked against the norms and the run before calibration. ``first_scale.py``: the
  first position's own scale handed over to the common one at the end of a run.
- ``sharding.py``: sharded recovery with FSDP2.
- ``saturation.py``: the share of each converted module's elements in the flat part of its function, along the run.
"""
