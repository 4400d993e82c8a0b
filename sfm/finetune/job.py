"""One process of a fine-tuning run: ``python -m sfm.finetune.job JOB.json``, one per rank under torchrun
(:func:`sfm.finetune.run.finetune_node` starts them with :func:`sfm.distributed.launch.run_node`).

The job file is a :class:`FinetuneJob` (:func:`sfm.finetune.run.node_job` builds it), read once at the process's
entry: the job config (its ``[finetune]`` section is the recipe), the arms (:class:`Arm`: the networks to train,
pretrained, random or U-Net, each at the crop of the encoder it is compared with), the task, the labelled surveys
with their roles and the run root. Every rank reads its own crops (:class:`sfm.finetune.samples.LabelledCrops`);
gradients are averaged by DDP over gloo (NCCL on GPUs).

The runs, in order on every rank: each arm, at each paired seed (``[finetune] seed`` on, ``seeds`` of them: the
same crops for every arm of a seed), at each peak rate of the arm's grid (``lrs``, ``lrs_random``, ``lrs_unet``);
:func:`sfm.finetune.loop.planned_steps` steps (scaled with the training labels), early stopping on the validation
labels, each run within its share of ``max_minutes``. Rank 0 scores the validation labels (through
:mod:`sfm.predict.windows`, as ``sfm predict`` will predict), keeps each (arm, seed)'s run at the rate with the best
validation score, writes its task model (``<run_root>/models/<arm>-s<seed>``,
:func:`sfm.model.segmenter.save_segmenter`) and ``<run_root>/summary.json``.

LP-FT for an encoder's arms: ``probe_steps`` steps of the head alone on the frozen encoder (at ``probe_lr``), then
the whole network with layer decay (:func:`sfm.finetune.loop.probe_then_fine_tune`); the U-Net trains whole.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from sfm import storage
from sfm.config import LABEL_IGNORE, FinetuneConfig, JobConfig
from sfm.distributed.job import JobFile
from sfm.distributed.launch import job_file_main
from sfm.errors import SFMError
from sfm.finetune.loop import RunHooks, Schedule, class_weights, masked_loss, planned_steps, probe_then_fine_tune
from sfm.finetune.samples import LabelledCrops, LabelledSurveys, Split, finetune_data, split_roles
from sfm.finetune.scores import validation_score
from sfm.model.segmenter import Segmenter, Task, save_segmenter
from sfm.progress import Progress
from sfm.train.trackers import Trackers, run_params

ARMS = ("pretrained", "random", "unet")
UNET_WIDTH = 16  # the U-Net arm's first level: FaultSeg3D's 16-32-64, whatever [finetune] head_width says


@dataclass
class Arm:
    """One network a fine-tuning run trains: ``kind`` pretrained (the exported encoder at ``url`` plus the
    ``[finetune] head``), random (the MAE architecture ``model`` randomly initialised, the same head) or unet (the
    FaultSeg3D-style U-Net from scratch); every arm at ``crop``, the crop of the encoder the arms are compared with
    (so they read the same crops and predict the same windows). ``encoder``: how lineage names where it came from;
    ``reference``: for a baseline, the encoder it is built like."""

    kind: str
    encoder: str
    crop: tuple[int, int, int]
    url: str = ""
    model: dict[str, Any] | None = None
    reference: str = ""

    def __post_init__(self):
        if self.kind not in ARMS:
            raise ValueError(f"arm kind must be one of {ARMS}, got {self.kind!r}")
        self.crop = tuple(int(c) for c in self.crop)

    def rates(self, recipe: FinetuneConfig) -> tuple[float, ...]:
        """The arm's grid of peak rates."""
        return {"pretrained": recipe.lrs, "random": recipe.lrs_random, "unet": recipe.lrs_unet}[self.kind]

    def task(self, task: str, recipe: FinetuneConfig) -> Task:
        """The arm's :class:`Task` of ``task`` (binary | classes:N): the recipe's head, the U-Net for the U-Net."""
        if self.kind == "unet":
            return Task.parse(task, head="unet", width=UNET_WIDTH)
        return Task.parse(task, head=recipe.head, width=recipe.head_width)

    def build(self, task: Task, seed: int) -> Segmenter:
        """The arm's network for paired seed ``seed`` (random parts drawn on the CPU: the same on every rank): the
        pretrained encoder, or the architecture at seed ``seed``'s random initialisation (the same for every
        budget and head, as the evaluation's random arm), with ``task``'s head initialised from ``seed``."""
        from sfm.model import load
        from sfm.model.mae import MAEConfig, MaskedAutoencoder3D

        mae = None
        if self.kind == "pretrained":
            mae = load(self.url)
        elif self.kind == "random":
            torch.manual_seed(10_000 + seed)
            mae = MaskedAutoencoder3D(MAEConfig.from_dict(self.model))
        torch.manual_seed(seed)
        return Segmenter(mae, task, crop=None if mae is not None else self.crop)


@dataclass
class FinetuneJob(JobFile):
    """What every rank of a fine-tuning run reads (``python -m sfm.finetune.job JOB.json``), and what the flow's
    later steps score and register."""

    config: JobConfig  # resolved; its [finetune] section is the recipe
    arms: list[Arm]  # the networks to train, in order
    task: str  # binary | classes:N
    run_root: str
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (survey store URL, label store URL)
    roles: list[str] = field(default_factory=list)  # each pair's: train | validation | test
    label_ids: list[str] = field(default_factory=list)  # each pair's label set
    module: ClassVar[str] = "sfm.finetune.job"

    @property
    def seeds(self) -> list[int]:
        """The paired seeds: ``[finetune] seed`` and the ``seeds - 1`` after it."""
        ft = self.config.finetune
        return list(range(ft.seed, ft.seed + ft.seeds))

    def lineage_of(self, arm: Arm) -> dict[str, Any]:
        """What a task model of ``arm`` records of its making: its encoder and the label sets."""
        return {"encoder": arm.encoder, "arm": arm.kind, "labels": list(self.label_ids)}

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "arms": [dataclasses.asdict(a) for a in self.arms],
                "task": self.task, "run_root": self.run_root, "pairs": [list(p) for p in self.pairs],
                "roles": list(self.roles), "label_ids": list(self.label_ids)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FinetuneJob":
        return cls(JobConfig.from_dict(data.get("config")), [Arm(**a) for a in data["arms"]], data["task"],
                   data["run_root"], [tuple(p) for p in data["pairs"]], list(data["roles"]), list(data["label_ids"]))


def training_classes(surveys: LabelledSurveys, split: Split, task: Task) -> list[float]:
    """The fraction of each class among the training labels (what the loss weights balance), after
    checking every label is a class of ``task``."""
    counts = np.zeros(LABEL_IGNORE + 1, np.int64)
    for k, traces in enumerate(split.train):
        if traces.any():
            labels = np.asarray(surveys.labels[k][...])
            counts += np.bincount(labels[traces].ravel(), minlength=LABEL_IGNORE + 1)
    present = np.flatnonzero(counts[:LABEL_IGNORE])
    if present[-1] >= task.classes:
        raise SFMError(f"the training labels hold class {int(present[-1])}, beyond the task {task.name} (classes "
                       f"0..{task.classes - 1}); pass --task classes:{int(present[-1]) + 1}")
    return (counts[:task.classes] / counts[:task.classes].sum()).tolist()


def training_voxels(surveys: LabelledSurveys, split: Split) -> int:
    """Voxels of the labelled training traces (what the steps scale with)."""
    return int(sum(int(t.sum()) * int(info.shape[2]) for t, info in zip(split.train, surveys.surveys)))


class Validation:
    """Rank 0's early-stopping score: the validation parts read once (with the windows ``sfm predict`` runs over
    their surveys), predicted with the recipe's overlap and mirroring, scored
    (:func:`sfm.finetune.scores.validation_score`)."""

    def __init__(self, surveys: LabelledSurveys, split: Split, recipe: FinetuneConfig):
        self.parts = [surveys.read_part(p, recipe.overlap) for p in split.validation]
        self.mirror = recipe.mirror

    def __call__(self, net: Segmenter) -> float:
        return validation_score([p.predict(net, self.mirror) for p in self.parts], [p.labels for p in self.parts])


def wrapped(net: Segmenter, world: int, freeze_encoder: bool):
    """What runs the batches (:func:`sfm.distributed.parallelize.parallelize_finetuning`: ``net``, or over
    several ranks its DDP wrapper), made after the encoder is frozen or not."""
    from sfm.distributed.parallelize import parallelize_finetuning
    from sfm.finetune.loop import set_trainable

    set_trainable(net, freeze_encoder)
    return parallelize_finetuning(net, world)


def ranked(score: float | None) -> float:
    """A validation score to rank runs by: none (no validation labels) or NaN (no positive label) ranks last."""
    return -np.inf if score is None or np.isnan(score) else float(score)


def finetune_runs(job: FinetuneJob, rank: int = 0, world: int = 1) -> dict[str, Any] | None:
    """This rank's share of every run of the job (see the module); rank 0 returns the summary (also written to
    the run root): per (arm, seed) the rate kept, its steps, validation history and task model, and every run."""
    from sfm.distributed.parallelize import fewest_over_ranks

    t0 = time.perf_counter()
    cfg = job.config
    ft = cfg.finetune
    crop = job.arms[0].crop
    surveys = LabelledSurveys(list(job.pairs), finetune_data(cfg, crop))
    split = split_roles(surveys, job.roles, ft.validation, ft.held_out)
    tasks = [arm.task(job.task, ft) for arm in job.arms]
    weights = class_weights(training_classes(surveys, split, tasks[0]))
    steps = planned_steps(ft, training_voxels(surveys, split))
    validate = Validation(surveys, split, ft) if rank == 0 and split.validation else None
    trials = [(arm, task, seed, arm.rates(ft) if split.validation else arm.rates(ft)[:1])
              for arm, task in zip(job.arms, tasks) for seed in job.seeds]
    share = ft.max_minutes * 60 / sum(len(rates) for *_, rates in trials) if ft.max_minutes > 0 else None
    runs, kept = [], []

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return masked_loss(logits, labels, weights, LABEL_IGNORE)

    # rank 0's losses and validation scores to the [train] trackers, <run_root>/tensorboard/sfm-finetune/, each run's
    # under <arm>/seed<S>/lr<R>/ (a retried run's figures replace the earlier attempt's)
    trackers = Trackers(cfg, job.run_root, "sfm-finetune", enabled=rank == 0).start(
        run_params(cfg, world_size=world, encoder=",".join(a.encoder for a in job.arms), task=job.task,
                   arms=",".join(a.kind for a in job.arms)), first_step=1)
    for arm, task, seed, rates in trials:
        crops = LabelledCrops(surveys, split.train, rank, world, seed=seed)
        best: tuple[float, dict[str, Any], Segmenter] | None = None
        for lr in rates:
            started = time.perf_counter()
            net = arm.build(task, seed)
            name, tag = f"fine-tune {arm.kind} seed {seed} lr {lr:g}", f"{arm.kind}/seed{seed}/lr{lr:g}"
            hooks = RunHooks(
                wrap=lambda n, frozen: wrapped(n, world, frozen),
                progress=lambda total, phase: Progress(total, f"{name}: {phase}" if phase != "fine-tune" else name,
                                                       every_s=cfg.train.log_every_s, enabled=rank == 0),
                track=lambda phase: trackers.under(f"{tag}/{'probe' if phase == 'linear probe' else 'finetune'}"))
            schedule = Schedule(lr, steps, deadline=started + share if share else None,
                                agree=lambda n: fewest_over_ranks(n, world))
            probe = probe_then_fine_tune(net, ft, lambda step: tuple(torch.from_numpy(x) for x in crops.batch(step)),
                                         loss_of, schedule, validate=validate, hooks=hooks)
            for step, value in net.validation:
                trackers.log({f"{tag}/finetune/validation_score": value}, step)
            score = max((s for _, s in net.validation), default=None)  # None: no validation labels, one rate
            run = {"arm": arm.kind, "seed": seed, "lr": lr, "steps": steps, "steps_run": net.steps_run,
                   "probe_steps": probe, "chosen_step": net.chosen_step, "validation_score": score,
                   "validation": net.validation, "seconds": time.perf_counter() - started}
            runs.append(run)
            if best is None or score > best[0]:
                best = (score, run, net)
        crops.close()
        score, run, net = best
        model_url = storage.join(job.run_root, "models", f"{arm.kind}-s{seed}")
        if rank == 0:
            save_segmenter(net, model_url, {"lineage": job.lineage_of(arm),
                                            "predict": {"overlap": ft.overlap, "mirror": ft.mirror}})
        kept.append({**run, "encoder": arm.encoder, "model_url": model_url, "rates": list(rates),
                     "chosen_on": "validation labels" if split.validation else "no validation labels: the grid's "
                                                                               "first rate, the last step"})
    trackers.close()
    if rank != 0:
        return None
    best = max(range(len(kept)), key=lambda k: (ranked(kept[k]["validation_score"]), -k))
    summary = {**kept[best], "best": best, "kept": kept, "runs": runs, "world_size": world,
               "class_fractions": [float(1 / (len(weights) * w)) for w in weights.tolist()],
               "seconds": time.perf_counter() - t0}
    storage.write_bytes(storage.join(job.run_root, "summary.json"), json.dumps(summary, indent=1).encode())
    print(f"sfm finetune: {len(runs)} run(s) of up to {steps} steps on {world} rank(s); kept {kept[best]['arm']} "
          f"seed {kept[best]['seed']} at lr {kept[best]['lr']:g}, step {kept[best]['chosen_step']} "
          f"({summary['seconds']:.0f}s) -> {kept[best]['model_url']}", flush=True)
    return summary


def finetune_rank(job: FinetuneJob) -> dict[str, Any] | None:
    """:func:`finetune_runs` as this process's rank of the launch (``RANK``, ``WORLD_SIZE`` from the launcher),
    in the process group it sets up for the job and ends after it."""
    cfg = job.config
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cfg.train.threads_per_process > 0:
        torch.set_num_threads(cfg.train.threads_per_process)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(cfg.dist.backend_for(torch.cuda.is_available()),
                                timeout=dt.timedelta(seconds=cfg.dist.timeout_s))
    try:
        return finetune_runs(job, rank, world)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return job_file_main(argv, FinetuneJob, "finetune", finetune_rank)


if __name__ == "__main__":
    sys.exit(main())
