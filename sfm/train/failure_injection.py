"""Failures injected on purpose (``SFM_INJECT_FAILURES``), to test how a run handles them."""

from __future__ import annotations

import logging
import threading

import torch

from sfm import storage
from sfm.errors import SFMError

log = logging.getLogger("sfm.train.trainer")
ENV = "SFM_INJECT_FAILURES"


class FailureInjection:
    """Failures injected on purpose, to test the run's health handling (``SFM_INJECT_FAILURES``).

    A comma list of ``nan@STEP`` (rank 0's batch of that step becomes NaN: the loss and the
    gradients turn non-finite) and ``hang@STEP`` (rank 0's data stops before that step, as a hung
    loader would). Steps count from 1. Each failure fires once per run: a marker under
    ``<run_root>/injected/`` keeps a rolled-back, retried or resumed attempt from meeting it again.
    """

    def __init__(self, spec: str, run_root: str, enabled: bool):
        self.pending: set[tuple[str, int]] = set()
        self.root = storage.join(run_root, "injected")
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            kind, _, step = item.partition("@")
            if kind not in ("nan", "hang") or not step.isdigit():
                raise SFMError(f"{ENV} item {item!r} is not nan@STEP or hang@STEP")
            self.pending.add((kind, int(step)))
        if not enabled:
            self.pending.clear()

    def _take(self, kind: str, step: int) -> bool:
        if (kind, step) not in self.pending:
            return False
        self.pending.discard((kind, step))
        marker = storage.join(self.root, f"{kind}@{step}")
        if storage.exists(marker):
            return False
        storage.write_bytes(marker, b"fired\n")
        return True

    def apply(self, step: int, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` for training step ``step`` (1-based), with the failure due then, if one is."""
        if self._take("hang", step):
            log.warning("injected failure: the data stops before step %d (hang)", step)
            threading.Event().wait()  # forever: the watchdog ends the process
        if self._take("nan", step):
            log.warning("injected failure: NaN batch at step %d", step)
            return torch.full(tuple(batch.shape), float("nan"))  # float32 whatever the batch's type
        return batch
