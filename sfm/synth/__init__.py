"""Generated surveys for demos, evaluation and tests: FaultSeg3D-like geology (:mod:`.geology`) and synthetic
post-stack SEG-Y surveys with their fault labels (:mod:`.survey`)."""
