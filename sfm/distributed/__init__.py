"""Parallelism applied to a plain model from outside: data-parallel strategies (:mod:`.strategies`),
context parallelism (:mod:`.context_parallel`, :mod:`.ring_attention`) and starting a node's
processes (:mod:`.launch`). ``sfm.model`` holds no process groups."""
