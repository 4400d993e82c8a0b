"""What a training run reports while it runs: the loss history, throughput windows, the progress
bar, the heartbeat and the experiment trackers (TensorBoard, MLflow, ...: sfm.train.trackers)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, NamedTuple

import torch

from sfm.model.hardware import PeakFlops
from sfm.progress import DEFAULT_EVERY_S, Progress
from sfm.train.step import throughput


class StepCost(NamedTuple):
    """What one optimiser step is worth, for throughput and MFU: the samples of the whole step (every dp rank, every
    micro-batch), the voxels of one sample, the model FLOPs of one sample's training, and the device's peak."""

    samples_per_step: int
    voxels_per_sample: int
    flops_per_sample: float
    peak: PeakFlops


class MetricsLogger:
    """Collects each step's loss and, every ``log_every`` steps, logs loss, learning rate and
    throughput. ``history`` ({"step", "loss", and at logged steps the speed figures}) is what a
    checkpoint saves and the summary reports; a skipped (non-finite) step keeps its place with loss
    None. Time spent in checkpoints, snapshots and rollbacks (:meth:`paused`) does not count
    against throughput. A checkpoint part: its state is the history (the same on every rank).

    ``health`` (a :class:`sfm.train.health.RunHealth`): the heartbeat each log beats, with the guard's counts;
    ``trackers`` (a :class:`sfm.train.trackers.Trackers`): where each log's figures go.
    """

    def __init__(self, accelerator, health, trackers, cost: StepCost, *, max_steps: int,
                 every_s: float = DEFAULT_EVERY_S):
        self.accelerator, self.heartbeat, self.guard = accelerator, health.heartbeat, health.guard
        self.trackers = trackers
        self.history: list[dict] = []
        self.samples_per_step, self.voxels_per_sample, self.flops_per_sample, self.peak = cost
        self.pending: list[torch.Tensor] = []  # mean loss of each step since history was last written
        self.started = time.perf_counter()
        self._window_start, self._window_steps, self._paused = self.started, 0, 0.0
        self._run_samples, self._run_seconds = 0, 0.0  # every logged window of this attempt together
        # a bar on a terminal, a plain line every ``every_s`` seconds in a flow task or a Slurm log
        self.progress = Progress(max_steps, "pretrain", every_s=every_s, enabled=accelerator.is_main_process)

    def record(self, losses: torch.Tensor) -> None:
        """One applied or skipped step's per-micro-batch losses."""
        self.pending.append(losses.mean())
        self._window_steps += 1

    def flush(self, step: int) -> None:
        """Append every pending step's loss, averaged over ranks, to the history (a collective)."""
        losses = self.accelerator.reduce(torch.stack(self.pending), "mean").tolist()
        self.history.extend({"step": step - len(losses) + i + 1, "loss": v if math.isfinite(v) else None}
                            for i, v in enumerate(losses))
        self.pending.clear()

    def _speed(self, samples: int, seconds: float) -> dict[str, float]:
        speed = throughput(samples=samples, seconds=seconds, flops_per_sample=self.flops_per_sample,
                           voxels_per_sample=self.voxels_per_sample, peak_flops=self.peak.flops,
                           devices=self.accelerator.num_processes)
        mfu = self.peak.checked(speed.pop("mfu"))  # None: above the peak, a wrong number not to report
        speed.update({"mfu": mfu} if mfu is not None else {})
        return speed

    def log(self, step: int, lr: float) -> None:
        """Loss, learning rate and throughput of the window since the last log, everywhere."""
        samples = self._window_steps * self.samples_per_step
        seconds = time.perf_counter() - self._window_start - self._paused
        self._run_samples, self._run_seconds = self._run_samples + samples, self._run_seconds + seconds
        speed = self._speed(samples, seconds)
        mfu = speed.get("mfu")
        loss = self.history[-1]["loss"]
        metrics = {"loss": float("nan") if loss is None else loss, "lr": lr, **speed}
        self.history[-1].update({k: v for k, v in metrics.items() if k != "loss"})
        self.trackers.log(metrics, step)
        self.progress.set(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}",
                          **{"samples/s": f"{speed['samples_per_s']:.1f}",
                             "voxels/s": f"{speed['voxels_per_s'] / 1e6:.1f}M",
                             "MFU": f"{mfu:.1%}" if mfu is not None else "-"})
        self.heartbeat.beat(step, loss=metrics["loss"], samples_per_s=speed["samples_per_s"],
                            skipped_nonfinite=self.guard.skipped, rollbacks=self.guard.rollbacks)
        self._window_start, self._window_steps, self._paused = time.perf_counter(), 0, 0.0

    @contextlib.contextmanager
    def paused(self):
        """Time inside does not count as training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t0

    def state_dict(self) -> list[dict]:
        return self.history

    def load_state_dict(self, history: list[dict]) -> None:
        """Continue from a checkpoint's history (a resume or a rollback): the steps it holds are done."""
        self.pending.clear()
        self.history = list(history)
        self.progress.reset(history[-1]["step"] if history else 0)

    def overall(self) -> dict[str, Any]:
        """The speed of this attempt: every logged window together (their samples over their training seconds,
        MFU checked against the peak as it stands), what the summary reports; empty before the first log."""
        return self._speed(self._run_samples, self._run_seconds) if self._run_seconds > 0 else {}

    def close(self) -> None:
        self.progress.close()
