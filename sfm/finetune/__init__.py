"""Fine-tuning a registered encoder on your own labels (``sfm flow finetune``), against the baselines, in the
order work flows:

- :mod:`.samples`: labelled surveys read through :mod:`sfm.data` (crops drawn where labels are, their label
  crops cut alike), the held-out and validation lines, the parts predicted (through :mod:`sfm.predict.windows`,
  as ``sfm predict`` predicts) and scored;
- :mod:`.loop`: the fine-tuning loop (MAE's recipe: LP-FT, layer decay, warm-up and cosine, early stopping, a
  time budget), the steps that grow with the labels, the balanced losses; shared with the downstream evaluation
  (:mod:`sfm.eval.downstream`);
- :mod:`.job`: one rank of a run (``python -m sfm.finetune.job JOB.json`` under torchrun): the arms (pretrained,
  random, U-Net), paired seeds, each arm's grid of rates, DDP;
- :mod:`.scores` and :mod:`.fault_scores`: AP, F1, F1 at a 2-voxel tolerance and IoU on held-out labels, per
  class for several;
- :mod:`.run`: what each step of the flow does (the arms resolved, scored, compared, registered); :mod:`.card`:
  its Metaflow card.

The network is :class:`sfm.model.segmenter.Segmenter` (a head of its ``HEADS`` over the encoder, or the U-Net);
label stores come from :mod:`sfm.ingest.labels`.
"""
