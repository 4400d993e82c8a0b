"""What a trained model is worth: masked reconstruction on held-out surveys (:mod:`.reconstruction`),
fault segmentation fine-tuned and probed against random initialisation (:mod:`.downstream`) and the
evaluation card (:mod:`.card`)."""
