"""Pretraining: the loop (:mod:`.trainer`, ``python -m sfm.train.trainer``), one optimisation step
(:mod:`.step`), checkpoints (:mod:`.checkpoint`) and training health (:mod:`.health`)."""
