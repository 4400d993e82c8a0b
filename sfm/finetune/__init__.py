"""Fine-tuning a registered encoder on your own labels (flows/finetune_flow.py), in the order work flows:

- :mod:`.samples`: labelled surveys read through :mod:`sfm.data` (crops drawn where labels are, their label
  crops cut alike), the held-out and validation lines, the parts predicted and scored;
- :mod:`.loop`: the fine-tuning loop (MAE's recipe: layer decay, warm-up and cosine, early stopping), the
  balanced losses; shared with the downstream evaluation (:mod:`sfm.eval.downstream`);
- :mod:`.job`: one rank of a run (``python -m sfm.finetune.job JOB.json`` under torchrun): LP-FT, DDP;
- :mod:`.scores`: AP, F1 and IoU on held-out labels, per class for several;
- :mod:`.run`: what each step of the flow does; :mod:`.card`: its Metaflow card.

The network is :class:`sfm.model.segmenter.Segmenter`; label stores come from :mod:`sfm.ingest.labels`.
"""
