"""One process of a fine-tuning run: ``python -m sfm.finetune.job JOB.json``, one per rank under torchrun
(:func:`sfm.finetune.run.finetune_node` starts them with :func:`sfm.distributed.launch.run_node`).

The job file is a :class:`FinetuneJob` (:func:`sfm.finetune.run.node_job` builds it), read once at the process's
entry: the job config (its ``[finetune]`` section is the recipe), the encoder (an exported model's URL, or none: a
random initialisation of the config's architecture), the task, the labelled surveys with their roles and the run
root. Every rank reads its
own crops (:class:`sfm.finetune.samples.LabelledCrops`); gradients are averaged by DDP over gloo (NCCL on
GPUs). Rank 0 scores the validation labels for early stopping, then writes the task model
(``<run_root>/model``, :func:`sfm.model.segmenter.save_segmenter`) and ``<run_root>/summary.json``.

LP-FT: ``probe_steps`` steps of the head alone on the frozen encoder (at ``probe_lr``), then
``steps`` steps of the whole network with layer decay (at ``lr``, or ``lr_random`` for a random
encoder), both through :func:`sfm.finetune.loop.train_steps`.
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
from sfm.config import LABEL_IGNORE, JobConfig
from sfm.distributed.job import JobFile
from sfm.distributed.launch import job_file_main
from sfm.errors import SFMError
from sfm.finetune.loop import class_weights, masked_loss, reporting, set_trainable, train_steps
from sfm.finetune.samples import LabelledCrops, LabelledSurveys, Split, finetune_data, split_roles
from sfm.finetune.scores import validation_score
from sfm.model.segmenter import Segmenter, Task, save_segmenter
from sfm.progress import Progress
from sfm.train.trackers import Trackers, run_params


@dataclass
class FinetuneJob(JobFile):
    """What every rank of a fine-tuning run reads (``python -m sfm.finetune.job JOB.json``), and what the flow's
    later steps score and register."""

    config: JobConfig  # resolved; its [finetune] section is the recipe
    encoder_url: str  # the exported encoder to fine-tune; "": the config's architecture, randomly initialised
    encoder: str  # how lineage names it: NAME:vN, its URL, or random
    task: str  # binary | classes:N
    run_root: str
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (survey store URL, label store URL)
    roles: list[str] = field(default_factory=list)  # each pair's: train | validation | test
    label_ids: list[str] = field(default_factory=list)  # each pair's label set
    module: ClassVar[str] = "sfm.finetune.job"

    @property
    def lineage(self) -> dict[str, Any]:
        """What the task model records of its making: the encoder and the label sets."""
        return {"encoder": self.encoder, "labels": list(self.label_ids)}

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "encoder_url": self.encoder_url, "task": self.task,
                "run_root": self.run_root, "pairs": [list(p) for p in self.pairs], "roles": list(self.roles),
                "lineage": self.lineage}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FinetuneJob":
        return cls(JobConfig.from_dict(data.get("config")), data["encoder_url"], data["lineage"]["encoder"],
                   data["task"], data["run_root"], [tuple(p) for p in data["pairs"]], list(data["roles"]),
                   list(data["lineage"]["labels"]))


def encoder_of(job: FinetuneJob, seed: int):
    """The encoder to fine-tune: the exported model at ``job.encoder_url``, or (none) the config's
    architecture at the random initialisation of ``seed`` (the same on every rank, drawn on the CPU)."""
    from sfm.model import load, model_config_for
    from sfm.model.mae import MaskedAutoencoder3D

    if job.encoder_url:
        return load(job.encoder_url)
    torch.manual_seed(10_000 + seed)  # as the evaluation's random arm
    return MaskedAutoencoder3D(model_config_for(job.config))


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


class Validation:
    """Rank 0's early-stopping score: the validation parts read once, predicted plainly, scored
    (:func:`sfm.finetune.scores.validation_score`)."""

    def __init__(self, surveys: LabelledSurveys, split: Split):
        self.parts = [surveys.read_part(p) for p in split.validation]

    def __call__(self, net: Segmenter) -> float:
        from sfm.predict.volume_predict import predict

        return validation_score([predict(net, a) for a, _ in self.parts], [lab for _, lab in self.parts])


def wrapped(net: Segmenter, world: int, freeze_encoder: bool):
    """What runs the batches (:func:`sfm.distributed.parallelize.parallelize_finetuning`: ``net``, or over
    several ranks its DDP wrapper), made after the encoder is frozen or not."""
    from sfm.distributed.parallelize import parallelize_finetuning

    set_trainable(net, freeze_encoder)
    return parallelize_finetuning(net, world)


def fine_tune(job: FinetuneJob, rank: int = 0, world: int = 1) -> dict[str, Any] | None:
    """This rank's share of the run; rank 0 returns the summary (also written to the run root)."""
    t0 = time.perf_counter()
    cfg = job.config
    ft = cfg.finetune
    mae = encoder_of(job, ft.seed)
    surveys = LabelledSurveys(list(job.pairs), finetune_data(cfg, mae.cfg.crop))
    split = split_roles(surveys, job.roles, ft.validation, ft.held_out)
    task = Task.parse(job.task, head=ft.head, width=ft.head_width)
    weights = class_weights(training_classes(surveys, split, task))
    crops = LabelledCrops(surveys, split.train, rank, world)
    torch.manual_seed(ft.seed)
    net = Segmenter(mae, task)
    validate = Validation(surveys, split) if rank == 0 and split.validation else None
    offset = [0]  # the probe's batches come first, fine-tuning's after them: no crop is drawn twice

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        imgs, labels = crops.batch(offset[0] + step)
        return torch.from_numpy(imgs), torch.from_numpy(labels)

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return masked_loss(logits, labels, weights, LABEL_IGNORE)

    # rank 0's losses and validation scores to the [train] trackers, <run_root>/tensorboard/sfm-finetune/ (a retried
    # run's figures replace the earlier attempt's)
    trackers = Trackers(cfg, job.run_root, "sfm-finetune", enabled=rank == 0).start(
        run_params(cfg, world_size=world, encoder=job.encoder, task=job.task), first_step=1)
    probe = ft.linear_first and ft.probe_steps > 0
    if probe:  # LP: the head alone on the frozen encoder
        recipe = dataclasses.replace(ft, steps=ft.probe_steps, lr=ft.probe_lr, layer_decay=1.0)
        progress = Progress(recipe.steps, "fine-tune: linear probe", every_s=cfg.train.log_every_s, enabled=rank == 0)
        train_steps(net, recipe, batches, reporting(loss_of, progress, trackers.under("probe")),
                    forward=wrapped(net, world, True), freeze_encoder=True)
        progress.close()
        offset[0] = ft.probe_steps
    recipe = dataclasses.replace(ft, lr=ft.lr_random) if not job.encoder_url and ft.lr_random > 0 else ft
    progress = Progress(recipe.steps, "fine-tune", every_s=cfg.train.log_every_s, enabled=rank == 0)
    train_steps(net, recipe, batches, reporting(loss_of, progress, trackers.under("finetune")),
                forward=wrapped(net, world, False), validate=validate, score_start=probe)
    progress.close()
    crops.close()
    for step, score in net.validation:
        trackers.log({"finetune/validation_score": score}, step)
    trackers.close()
    if rank != 0:
        return None
    model_url = storage.join(job.run_root, "model")
    save_segmenter(net, model_url, {"lineage": job.lineage})
    summary = {"model_url": model_url, "steps": recipe.steps, "probe_steps": ft.probe_steps if probe else 0,
               "chosen_step": net.chosen_step, "validation": net.validation, "world_size": world,
               "lr": recipe.lr, "class_fractions": [float(1 / (len(weights) * w)) for w in weights.tolist()],
               "seconds": time.perf_counter() - t0}
    storage.write_bytes(storage.join(job.run_root, "summary.json"), json.dumps(summary, indent=1).encode())
    print(f"sfm finetune: {recipe.steps} steps on {world} rank(s), kept step {net.chosen_step} "
          f"({summary['seconds']:.0f}s) -> {model_url}", flush=True)
    return summary


def fine_tune_rank(job: FinetuneJob) -> dict[str, Any] | None:
    """:func:`fine_tune` as this process's rank of the launch (``RANK``, ``WORLD_SIZE`` from the launcher),
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
        return fine_tune(job, rank, world)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return job_file_main(argv, FinetuneJob, "finetune", fine_tune_rank)


if __name__ == "__main__":
    sys.exit(main())
