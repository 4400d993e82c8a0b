"""Parallelism applied to a plain model from outside, decided in one place (:mod:`.parallelize`):
data-parallel strategies (:mod:`.strategies`, :mod:`.deepspeed_zero`),
context parallelism (:mod:`.context_parallel`, :mod:`.ring_attention`) and starting a node's
processes (:mod:`.launch`). ``sfm.model`` holds no process groups."""
