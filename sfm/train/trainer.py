"""MAE pretraining on Hugging Face Accelerate; one process per device, launched by torchrun or
``accelerate launch`` (:mod:`sfm.distributed.launch`).

:class:`Trainer` is the loop (build, resume, step, log, checkpoint, export); its components are
:class:`sfm.train.step.TrainStep` (one optimiser step), :class:`sfm.train.checkpoint.Checkpointer` (which
saves and restores every stateful part registered with it), :class:`sfm.train.metrics.MetricsLogger` and
the health parts of :mod:`sfm.train.health`.

``python -m sfm.train.trainer JOB.json`` (under ``torchrun`` or ``accelerate launch``, or alone for one process) trains on the surveys named in the job file and
writes under its ``run_root``::

    job_config.json        the resolved JobConfig (written first)
    ckpt/step-NNNNNN/      checkpoints (see sfm.train.checkpoint); a restarted job continues from the newest
    final/                 the exported model (model.safetensors + config.json)
    snapshots/step-NNNNNN/ the model exported part-way, at ``train.snapshots`` fractions of the steps
    summary.json           loss history and throughput (written last)
    tensorboard/           the trackers' files (TensorBoard's event files), copied there while the run runs
                           (sfm.train.trackers: every [train] tracker_sync_s, and when it ends or fails)

The job file is a :class:`sfm.distributed.job.TrainJob` as JSON: {"config": JobConfig dict, "surveys": [store
URLs], "run_root": URL} (:func:`sfm.distributed.job.node_job` builds it), read once at the process's entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from sfm import storage
from sfm.config import JobConfig
from sfm.data import BatchStream, training_stream
from sfm.distributed.accelerate_launch import check_environment, precision_of
from sfm.distributed.job import TrainJob
from sfm.distributed.launch import environment_for_workers, job_file_main
from sfm.distributed.layout import Layout, replica_digests
from sfm.distributed.parallelize import parallelize
from sfm.errors import SFMError
from sfm.model import build_model, model_config_for, train_flops_per_sample
from sfm.model import load as load_model
from sfm.model import save as save_model
from sfm.model.hardware import PeakFlops
from sfm.train import checkpoint
from sfm.train import failure_injection
from sfm.train.failure_injection import FailureInjection
from sfm.train.health import ROLLBACK, SKIP, Heartbeat, NonFiniteGuard, RunHealth, Watchdog, all_ranks_finite
from sfm.train.metrics import MetricsLogger, StepCost
from sfm.train.trackers import Trackers, run_params
from sfm.train.step import TrainStep, apply_training_options, build_optimizer, lr_at

log = logging.getLogger("sfm.train.trainer")


def schedule(cfg: JobConfig) -> Callable[[int], float]:
    """Learning rate of each optimiser step for this job (warmup + cosine, see train.step.lr_at)."""
    t = cfg.train
    return functools.partial(lr_at, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps)


@dataclasses.dataclass
class TrainSummary:
    """What a finished run reports (``summary.json`` under the run root; the flow reads it)."""

    steps: int
    steps_this_attempt: int
    resumed_from_step: int
    world_size: int
    strategy: str
    dp: int
    cp: int
    initial_loss: float | None
    final_loss: float | None
    history: list[dict[str, Any]]
    samples_per_s: float | None
    voxels_per_s: float | None
    mfu: float | None
    mfu_peak_flops: float
    model_url: str
    seconds: float
    flops_per_sample: float
    snapshots: dict[str, str]  # step -> exported model, part-way through
    health: dict[str, int]  # skipped_nonfinite, rollbacks
    rank_weight_digests: list[str] | None  # replicated strategies: one per rank, all equal
    finished_at: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StreamPosition:
    """The trainer's data stream position as a checkpoint part. A position saved by another number of
    dp ranks (a sharded run resumed on another world size) does not fit this layout's stream: it
    starts instead where the restored step's batches of this layout begin."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def state_dict(self) -> dict[str, int]:
        return self.trainer.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        t = self.trainer
        if state["world_size"] != t.layout.dp:
            state = {"epoch": 0, "batch": t.step * t.micro_batches}
        t.stream.load_state_dict(state)


class Trainer:
    """One process's part of a training job, built whole here: the model and what the step runs on it
    (:func:`sfm.distributed.parallelize.parallelize`, the one owner of the parallelism), the checkpointer, the
    data stream and the metrics. ``train()`` reads as the loop; the pieces it calls resume, handle a non-finite
    step, and export at the end. The checkpointer saves and restores every stateful part (:meth:`track_state`);
    the trainer itself is one of them: its state is the step.

    ``health``: this process's watchdog, heartbeat and non-finite guard; ``injected``: the failures
    to inject (tests of the health handling)."""

    def __init__(self, job: TrainJob, cfg: JobConfig, accelerator, health: RunHealth,
                 injected: FailureInjection):
        self.job, self.cfg, self.accelerator, self.injected = job, cfg, accelerator, injected
        self.watchdog, self.heartbeat, self.guard = health
        self.health = health
        self.run_root = job.run_root
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.layout = Layout.of(self.rank, self.world, cfg.dist.cp)
        self.main = accelerator.is_main_process
        self.micro_batches = max(1, cfg.train.grad_accum)
        self.step = 0  # optimiser steps done
        self.start_step = 0  # the step this attempt started from
        self.batch = 0  # this rank's batch number in the data stream (mask noise is keyed on it)
        self.mcfg = model_config_for(cfg)
        self.model = self.plain_model()
        run = parallelize(self.model, self.optimization, cfg, self.layout, accelerator, self.check_finite)
        self.strategy = run.strategy  # what runs: the config's strategy, or "single" on one process
        self.shards = run.shards  # a sharded strategy's weights and optimiser state
        self.replicated = run.replicated  # every rank holds the full weights
        self.scheduler = run.scheduler
        torch.manual_seed(cfg.data.seed * 1000 + 17 + self.rank)
        self.checkpointer = checkpoint.Checkpointer(
            storage.join(self.run_root, "ckpt"), accelerator,
            checkpoint.StepState(self.model, run.model, run.optimizer, run.scheduler, run.shards), cfg.train)
        self.noise_gen = torch.Generator(device=accelerator.device)
        self.train_step = TrainStep(run.model, run.optimizer, run.scheduler, grad_clip=cfg.train.grad_clip,
                                    hooks=run.hooks, mask_noise=self.mask_noise)
        self.stream = self.open_data(run.slab)
        self._batches = self._feed()
        self.trackers = Trackers(cfg, self.run_root, "sfm-pretrain", enabled=self.main)  # started by resume()
        self.metrics = self.start_metrics()
        self.track_state()

    # ---- the loop ---------------------------------------------------------------------------------

    def train(self) -> TrainSummary | None:
        cfg = self.cfg.train
        self.resume()
        snapshot_steps = self.snapshot_steps()
        try:
            while self.step < cfg.max_steps:
                result = self.train_step(self._batches, self.micro_batches)
                verdict = self.guard.observe(result.applied)
                if verdict == ROLLBACK:
                    self.roll_back()
                    continue
                if verdict == SKIP:
                    log.warning("step %d: non-finite loss or gradient norm (losses %s, grad norm %s); update skipped "
                                "(%d in a row, %d in this run)", self.step + 1, result.losses.tolist(),
                                float(result.grad_norm), self.guard.consecutive, self.guard.skipped)
                self.step += 1
                self.watchdog.progress(self.step)
                self.metrics.record(result.losses)
                last = self.step == cfg.max_steps
                log_now = self.step % cfg.log_every == 0 or last
                save_now = self.checkpointer.due(self.step, last)
                if log_now or save_now:  # a checkpoint holds the loss of every step before it
                    self.metrics.flush(self.step)
                if log_now:
                    self.metrics.log(self.step, self.scheduler.get_last_lr()[0])
                self.metrics.progress.update(1)
                if self.step in snapshot_steps and not last:
                    with self.metrics.paused():
                        self.export(self.snapshot_url(self.step))
                if save_now:
                    with self.metrics.paused():
                        self.checkpointer.save(self.step)
                        self.watchdog.progress(self.step)
        finally:
            self.metrics.close()
            self.stream.close()
            self.trackers.close()  # the figures reach the run root, whatever ended the loop
        return self.finish(snapshot_steps)

    # ---- the pieces -------------------------------------------------------------------------------

    def plain_model(self) -> torch.nn.Module:
        """The plain model on its device, the same initial weights on every rank."""
        cfg = self.cfg
        torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
        model = build_model(self.mcfg)
        if cfg.train.init_from:
            model.load_state_dict(load_model(cfg.train.init_from).state_dict())
            log.info("initialised from %s", cfg.train.init_from)
        apply_training_options(model, grad_checkpointing=cfg.train.grad_checkpointing, compile=cfg.train.compile)
        return model.to(self.accelerator.device)

    def optimization(self, module: torch.nn.Module) -> tuple[torch.optim.Optimizer, LRScheduler]:
        """The optimiser of ``module`` (what the strategy trains) and its schedule, stepped by hand once per
        optimiser step, whatever the world size (and skipped or not)."""
        t = self.cfg.train
        optimizer = build_optimizer(module, lr=t.lr, weight_decay=t.weight_decay, betas=t.betas,
                                    algorithm=t.optimizer, muon_lr=t.muon_lr)
        lr_of_step = schedule(self.cfg)
        return optimizer, LambdaLR(optimizer, lambda s: lr_of_step(s) / t.lr)

    def check_finite(self, losses: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """The step's losses and gradient norm finite on every rank (every rank gets the same answer)."""
        reduce_sum = (lambda t: self.accelerator.reduce(t, "sum")) if self.world > 1 else None
        return all_ranks_finite(losses, grad_norm, reduce=reduce_sum)

    def open_data(self, slab) -> BatchStream:
        """This rank's batch stream (its position is a checkpoint part). The cp ranks of a dp group
        draw the same crops; each reads only its inline ``slab`` of them (context parallelism: a
        ``sfm.distributed.context_parallel.CropSlab``, else None)."""
        layout = self.layout
        on_slab = {"slab": (slab.start, slab.stop)} if slab is not None else {}
        return training_stream(self.job.surveys, self.cfg.data, rank=layout.dp_rank, world_size=layout.dp,
                               node_ranks=min(self.world, self.cfg.dist.procs_per_node),
                               worker_init=environment_for_workers(), **on_slab)

    def start_metrics(self) -> MetricsLogger:
        """The metrics logger (its history is a checkpoint part), logging to the trackers."""
        cfg, layout, acc = self.cfg, self.layout, self.accelerator
        cost = StepCost(samples_per_step=self.micro_batches * cfg.data.batch_size * layout.dp,  # cp ranks share
                        voxels_per_sample=math.prod(cfg.data.crop), flops_per_sample=train_flops_per_sample(self.mcfg),
                        peak=PeakFlops(acc.device, torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32))
        return MetricsLogger(acc, self.health, self.trackers, cost, max_steps=cfg.train.max_steps,
                             every_s=cfg.train.log_every_s)

    def track_state(self) -> None:
        """Everything a resumed run needs besides the weights, optimiser and schedule, registered with
        the checkpointer, which saves it with every checkpoint and restores it, in this order, on a
        resume or (what is not kept on rollback) a rollback. The data stream goes on past the bad
        batches of a rollback, and the guard keeps counting; the RNG states are restored last."""
        ckpt = self.checkpointer
        ckpt.register("train", self)
        ckpt.register("data", StreamPosition(self), keep_on_rollback=True)
        ckpt.register("history", self.metrics)
        ckpt.register("health", self.guard, keep_on_rollback=True)
        ckpt.register("rng", checkpoint.RNGState(), per_rank=True, keep_on_rollback=True)

    def resume(self) -> None:
        """Continue from the newest checkpoint every rank can read, or start (writing the job config); then start
        the trackers, whose figures begin after the restored step (what an earlier attempt logged from there on is
        dropped: sfm.train.trackers)."""
        url = self.checkpointer.load()
        self.start_step = self.step
        if url is not None:
            log.info("resumed from %s at step %d", url, self.step)
        elif self.main:
            storage.write_bytes(storage.join(self.run_root, "job_config.json"), self.cfg.to_json().encode())
        with self.metrics.paused():  # not training time (an MLflow server's first answer, ...)
            self.trackers.start(run_params(self.cfg, world_size=self.world, strategy=self.strategy,
                                           dp=self.layout.dp, cp=self.layout.cp), first_step=self.step + 1)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's checkpoint part: the step, and the layout that wrote it."""
        return {"step": self.step, "strategy": self.strategy, "world_size": self.world, "cp": self.layout.cp}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]

    def _feed(self):
        for batch in self.stream:
            self.batch = self.stream.batch - 1
            # float16 and int8 batches cross to the device at a half or a quarter of the bytes and become
            # float32 there (int8: normalised there, sfm.data.int8_batch)
            yield self.injected.apply(self.step + 1, batch).to(self.accelerator.device, non_blocking=True).float()

    def mask_noise(self, _micro: int, imgs: torch.Tensor) -> torch.Tensor:
        """The MAE mask noise [N, L] of this rank's share of the global batch at the stream's position:
        every rank draws the whole dp batch's noise from one seed and keeps its rows, so masks depend on
        the samples, not on the number of ranks (a 2-rank run equals a 1-rank run with the same global
        batch) or on any RNG state (a resumed run continues exactly). cp ranks share their rows."""
        n, layout = imgs.shape[0], self.layout
        self.noise_gen.manual_seed((self.cfg.data.seed * 1_000_003 + self.batch) % (2**63))
        every = torch.rand(layout.dp * n, self.mcfg.num_patches, generator=self.noise_gen,
                           device=self.accelerator.device)
        return every[layout.dp_rank * n:(layout.dp_rank + 1) * n]

    def roll_back(self) -> None:
        """Too many non-finite steps in a row: back to the newest checkpoint; the data stream goes on
        past the bad batches."""
        with self.metrics.paused():
            url = self.checkpointer.load(rollback=True)
            if url is None:
                raise SFMError(f"{self.guard.consecutive} non-finite steps in a row before the first checkpoint; "
                               "lower train.lr or raise train.warmup_steps, or checkpoint sooner "
                               "(train.checkpoint_every)")
            self.guard.rolled_back()
            self.trackers.restart(self.step + 1)
            log.warning("rolled back to %s after %d non-finite steps in a row (rollback %d of %d); the data "
                        "stream continues past the bad batches", url, self.guard.max_consecutive,
                        self.guard.rollbacks, self.guard.max_rollbacks)
            self.watchdog.progress(self.step)

    def snapshot_steps(self) -> set[int]:
        t = self.cfg.train
        return {max(1, round(f * t.max_steps)) for f in t.snapshots if 0 < f < 1}

    def snapshot_url(self, step: int) -> str:
        return storage.join(self.run_root, "snapshots", f"step-{step:06d}")

    def export(self, url: str) -> None:
        """The full model to ``url`` from the main process (sharded: rank 0 gathers the shards into a
        fresh model first, a collective): the same plain safetensors whatever the strategy."""
        model = self.model
        if self.shards is not None:
            full = self.shards.full_state_dict()
            if self.main:
                model = build_model(self.mcfg)
                model.load_state_dict(full)
        if self.main:
            save_model(model, url, {"job": self.cfg.to_dict()})

    def finish(self, snapshot_steps: set[int]) -> TrainSummary | None:
        """Export the model, write the summary (main process), flush the trackers."""
        cfg, layout, acc = self.cfg, self.layout, self.accelerator
        start_step = self.start_step
        final_url = storage.join(self.run_root, "final")
        self.export(final_url)
        digests = replica_digests(self.model) if self.replicated else None  # a collective
        summary = None
        if self.main:
            history = self.metrics.history
            finite = [h["loss"] for h in history if h["loss"] is not None]
            speed = self.metrics.overall()
            steps_run = cfg.train.max_steps - start_step
            summary = TrainSummary(
                steps=cfg.train.max_steps, steps_this_attempt=steps_run, resumed_from_step=start_step,
                world_size=self.world, strategy=self.strategy, dp=layout.dp, cp=layout.cp,
                initial_loss=finite[0] if finite else None, final_loss=finite[-1] if finite else None,
                history=history, samples_per_s=speed.get("samples_per_s"), voxels_per_s=speed.get("voxels_per_s"),
                mfu=speed.get("mfu"), mfu_peak_flops=self.metrics.peak.flops, model_url=final_url,
                seconds=time.perf_counter() - self.metrics.started,
                flops_per_sample=self.metrics.flops_per_sample,
                snapshots={str(s): self.snapshot_url(s) for s in sorted(snapshot_steps) if s < cfg.train.max_steps},
                health={"skipped_nonfinite": self.guard.skipped, "rollbacks": self.guard.rollbacks},
                rank_weight_digests=digests, finished_at=dt.datetime.now(dt.timezone.utc).isoformat())
            storage.write_bytes(storage.join(self.run_root, "summary.json"),
                                json.dumps(summary.to_dict(), indent=1).encode())
            print(f"sfm train: {steps_run} steps ({start_step}->{cfg.train.max_steps}) on {self.world} rank(s) "
                  f"({self.strategy}, dp {layout.dp} x cp {layout.cp}) in {summary.seconds:.1f}s, loss "
                  f"{summary.initial_loss:.4f} -> {summary.final_loss:.4f}, {summary.samples_per_s or 0:.1f} "
                  f"samples/s, MFU {summary.mfu or 0:.1%}", file=sys.stderr)
        acc.wait_for_everyone()
        return summary


def train(job: TrainJob) -> TrainSummary | None:
    """Run (or continue) one training job; returns the summary on the main process."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cfg, run_root = job.config, job.run_root
    cuda = torch.cuda.is_available()
    precision = precision_of(cfg.train, cuda)
    # started by accelerate launch: its ACCELERATE_* settings must be the job's, which the trainer applies
    check_environment(cfg, os.environ, cuda=cuda, precision=precision)
    # under torchrun: one process group over all ranks; run directly: a single process, no group.
    # The timeout bounds every collective: a dead rank fails the others instead of hanging them.
    group = [InitProcessGroupKwargs(backend=cfg.dist.backend_for(cuda),
                                    timeout=dt.timedelta(seconds=cfg.dist.timeout_s))]
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision=precision, kwargs_handlers=group if "WORLD_SIZE" in os.environ else [],
    )
    if cfg.train.threads_per_process > 0:  # after Accelerator, which sets its own default on CPU
        torch.set_num_threads(cfg.train.threads_per_process)
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    cfg.check_parallelism(world)  # the processes torchrun started, whatever the config says
    h = cfg.health
    watchdog = Watchdog(h.step_timeout_s, first_timeout_s=h.first_step_timeout_s).start()
    heartbeat = Heartbeat(run_root, every_s=h.heartbeat_every_s, max_steps=cfg.train.max_steps, enabled=main,
                          world_size=world)
    guard = NonFiniteGuard(h.max_nonfinite_in_a_row, h.max_rollbacks)
    injected = FailureInjection(os.environ.get(failure_injection.ENV, ""), run_root, enabled=main)
    try:
        summary = Trainer(job, cfg, accelerator, RunHealth(watchdog, heartbeat, guard), injected).train()
    except BaseException as err:
        if main:
            with contextlib.suppress(Exception):
                heartbeat.finish(watchdog.last_step or 0, status="failed", error=type(err).__name__)
        raise
    finally:
        watchdog.stop()
    gc.collect()  # an FSDP2 model outlives its last reference (its hooks form cycles): free it, and the
    # collectives and group handles it holds, while the group is up, not after it is gone
    accelerator.end_training()  # ends the process group
    if main:
        heartbeat.finish(cfg.train.max_steps, loss=summary.final_loss, samples_per_s=summary.samples_per_s,
                         skipped_nonfinite=guard.skipped, rollbacks=guard.rollbacks)
    return summary


def main(argv: list[str] | None = None) -> int:
    return job_file_main(argv, TrainJob, "train", train)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
