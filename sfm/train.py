"""MAE pretraining on Hugging Face Accelerate; one process per device, launched by torchrun.

``python -m sfm.train JOB.json`` (under ``torchrun``, or alone for one process) trains on the surveys named in the job file and
writes under its ``run_root``::

    job_config.json        the resolved JobConfig (written first)
    ckpt/step-NNNNNN/      checkpoints (see sfm.checkpoint); a restarted job continues from the newest
    final/                 the exported model (model.safetensors + config.json)
    summary.json           loss history and throughput (written last)
    tensorboard/           Accelerate's TensorBoard logs

The job file is JSON: {"config": JobConfig dict, "surveys": [store URLs], "run_root": URL}.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from sfm import checkpoint, storage
from sfm.config import JobConfig
from sfm.data import training_stream
from sfm.hardware import peak_flops
from sfm.model import build_model, mae_config, train_flops_per_sample
from sfm.model import load as load_model
from sfm.model import save as save_model
from sfm.train_step import TrainStep, apply_training_options, build_optimizer, lr_at, throughput

log = logging.getLogger("sfm.train")


def model_config_for(cfg: JobConfig):
    """The MAEConfig a job trains: the preset, at the job's crop, mask ratio and patch."""
    overrides: dict[str, Any] = {"crop": tuple(cfg.data.crop), "mask_ratio": cfg.model.mask_ratio}
    if cfg.model.patch:
        overrides["patch"] = tuple(cfg.model.patch)
    return mae_config(cfg.model.preset, **overrides)


def schedule(cfg: JobConfig) -> Callable[[int], float]:
    """Learning rate of each optimiser step for this job (warmup + cosine, see train_step.lr_at)."""
    t = cfg.train
    return functools.partial(lr_at, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps)


def train(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run (or continue) one training job; returns the summary on the main process."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cfg = JobConfig.from_dict(job["config"])
    run_root = job["run_root"]
    ckpt_root = storage.join(run_root, "ckpt")
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if cuda else "no")
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if cuda else "gloo")
    # under torchrun: one process group over all ranks; run directly: a single process, no group
    group = [InitProcessGroupKwargs(backend=backend, timeout=dt.timedelta(seconds=cfg.dist.timeout_s))]
    tb_dir = tempfile.mkdtemp(prefix="sfm-tb-")
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision=precision, log_with="tensorboard", project_dir=tb_dir,
        kwargs_handlers=group if "WORLD_SIZE" in os.environ else [],
    )
    if cfg.train.threads_per_process > 0:  # after Accelerator, which sets its own default on CPU
        torch.set_num_threads(cfg.train.threads_per_process)
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)

    torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
    mcfg = model_config_for(cfg)
    model = build_model(mcfg)
    if cfg.train.init_from:
        model.load_state_dict(load_model(cfg.train.init_from).state_dict())
        log.info("initialised from %s", cfg.train.init_from)
    apply_training_options(model, grad_checkpointing=cfg.train.grad_checkpointing, compile=cfg.train.compile)
    model = model.to(accelerator.device)
    optimizer = build_optimizer(model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=cfg.train.betas)
    lr_of_step = schedule(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_of_step(s) / cfg.train.lr)
    # the scheduler is stepped by hand once per optimiser step, whatever the world size
    model, optimizer = accelerator.prepare(model, optimizer)
    rank_seed = cfg.data.seed * 1000 + 17 + rank
    torch.manual_seed(rank_seed)
    # MAE masks come from a generator of their own (different on each rank, saved with every
    # checkpoint): the data loader's workers and libraries draw from the global RNG at times that
    # differ between a run and its resumption, and must not shift the masks.
    mask_rng = torch.Generator(device=accelerator.device).manual_seed(rank_seed)

    micro_batches = max(1, cfg.train.grad_accum)
    start_step, history, data_state = 0, [], None
    resumed = _load_agreed_checkpoint(accelerator, ckpt_root)
    if resumed is not None:
        accelerator.unwrap_model(model).load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        start_step = int(resumed["state"]["step"])
        history = resumed["state"]["history"]
        data_state = resumed["state"].get("data")
        log.info("resumed from %s at step %d", resumed["url"], start_step)
    elif main:
        storage.write_bytes(storage.join(run_root, "job_config.json"), cfg.to_json().encode())

    stream = training_stream(job["surveys"], cfg.data, rank=rank, world_size=world,
                             start_batch=start_step * micro_batches)
    if data_state is not None and data_state.get("world_size") == world:
        stream.load_state_dict(data_state)  # the data position saved with the checkpoint
    batches = (b.to(accelerator.device, non_blocking=True) for b in stream)
    train_step = TrainStep(
        model, optimizer, scheduler, grad_clip=cfg.train.grad_clip, autocast=accelerator.autocast,
        no_sync=(lambda: accelerator.no_sync(model)) if world > 1 else None,
        backward=accelerator.backward, clip_grad_norm=accelerator.clip_grad_norm_, generator=mask_rng,
    )
    flops_per_sample = train_flops_per_sample(mcfg)
    peak = peak_flops(accelerator.device, torch.bfloat16 if precision == "bf16" else torch.float32)
    samples_per_step = micro_batches * cfg.data.batch_size * world
    accelerator.init_trackers("sfm-pretrain", config={"preset": cfg.model.preset, "world_size": world})
    if resumed is not None and resumed["rng"] is not None:
        checkpoint.set_rng_state(resumed["rng"], {"mask": mask_rng})

    from tqdm import tqdm

    bar = tqdm(total=cfg.train.max_steps, initial=start_step, disable=not main, desc="pretrain", mininterval=2,
               file=sys.stderr)
    pending: list[torch.Tensor] = []  # mean loss of each step since history was last written
    t_start = time.perf_counter()
    t_window, steps_in_window, paused = t_start, 0, 0.0
    try:
        for step in range(start_step, cfg.train.max_steps):
            pending.append(train_step(batches, micro_batches).mean())
            steps_in_window += 1
            done = step + 1
            last = done == cfg.train.max_steps
            log_now = done % cfg.train.log_every == 0 or last
            save_now = done % cfg.train.checkpoint_every == 0 or last
            if log_now or save_now:  # a checkpoint holds the loss of every step before it
                step_losses = accelerator.reduce(torch.stack(pending), "mean").tolist()
                history.extend({"step": done - len(step_losses) + i + 1, "loss": v} for i, v in enumerate(step_losses))
                pending.clear()
            if log_now:
                speed = throughput(samples=steps_in_window * samples_per_step,
                                   seconds=time.perf_counter() - t_window - paused, flops_per_sample=flops_per_sample,
                                   voxels_per_sample=math.prod(cfg.data.crop), peak_flops=peak, devices=world)
                metrics = {"loss": history[-1]["loss"], "lr": scheduler.get_last_lr()[0], **speed}
                history[-1].update(metrics)
                accelerator.log(metrics, step=done)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                sps=f"{speed['samples_per_s']:.1f}", vox=f"{speed['voxels_per_s'] / 1e6:.1f}M",
                                mfu=f"{speed['mfu']:.1%}")
                t_window, steps_in_window, paused = time.perf_counter(), 0, 0.0
            bar.update(1)
            if save_now:
                t_save = time.perf_counter()
                _save_checkpoint(accelerator, model, optimizer, scheduler, ckpt_root, done,
                                 {"data": stream.state_dict(), "history": history}, cfg.train.keep_checkpoints,
                                 {"mask": mask_rng})
                paused += time.perf_counter() - t_save
    finally:
        bar.close()
        stream.close()

    summary = None
    steps_run = cfg.train.max_steps - start_step
    if main:
        final_url = storage.join(run_root, "final")
        save_model(accelerator.unwrap_model(model), final_url, {"job": cfg.to_dict()})
        elapsed = time.perf_counter() - t_start
        tail = [h for h in history if "samples_per_s" in h]
        summary = {
            "steps": cfg.train.max_steps, "steps_this_attempt": steps_run, "resumed_from_step": start_step,
            "world_size": world, "initial_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None, "history": history,
            "samples_per_s": tail[-1]["samples_per_s"] if tail else None,
            "voxels_per_s": tail[-1]["voxels_per_s"] if tail else None,
            "mfu": tail[-1]["mfu"] if tail else None, "mfu_peak_flops": peak, "model_url": final_url,
            "seconds": elapsed, "flops_per_sample": flops_per_sample,
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        }
        storage.write_bytes(storage.join(run_root, "summary.json"), json.dumps(summary, indent=1).encode())
        print(f"sfm train: {steps_run} steps ({start_step}->{cfg.train.max_steps}) on {world} rank(s) in "
              f"{elapsed:.1f}s, loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['samples_per_s'] or 0:.1f} samples/s, MFU {summary['mfu'] or 0:.1%}", file=sys.stderr)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # flushes the trackers and ends the process group
    if main:
        storage.upload(tb_dir, storage.join(run_root, "tensorboard"))
    return summary


def _load_agreed_checkpoint(accelerator, root: str) -> dict[str, Any] | None:
    """The newest checkpoint every rank can read: each rank falls back past ones it cannot read,
    then all continue from the oldest step any rank reached, so they never resume out of step."""
    rank = accelerator.process_index
    ckpt = checkpoint.load_latest(root, rank, warn=log.warning)
    step = int(ckpt["state"]["step"]) if ckpt is not None else 0
    if accelerator.num_processes > 1:
        agreed = torch.tensor([step], device=accelerator.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        if int(agreed.item()) != step:
            log.warning("another rank cannot read checkpoint step %d; all ranks continue from step %d",
                        step, int(agreed.item()))
            step = int(agreed.item())
            ckpt = checkpoint.load(checkpoint.step_dir(root, step), rank) if step else None
            if ckpt is not None:
                ckpt["url"] = checkpoint.step_dir(root, step)
    return ckpt


def _save_checkpoint(accelerator, model, optimizer, scheduler, root: str, step: int, meta: dict, keep: int,
                     generators: dict[str, torch.Generator]) -> None:
    """Rank 0 clears the step's folder, every rank writes its RNG state, then rank 0 writes the rest
    and marks the checkpoint complete (see sfm.checkpoint)."""
    if accelerator.is_main_process:
        checkpoint.begin(root, step)
    accelerator.wait_for_everyone()
    checkpoint.save_rank_rng(root, step, accelerator.process_index, generators)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint.save(root, step, accelerator.unwrap_model(model).state_dict(), optimizer.state_dict(),
                        scheduler.state_dict(), meta, keep=keep)
    accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    from sfm.errors import SFMError

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sfm.train JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        job = json.load(fh)
    try:
        train(job)
    except SFMError as err:
        print(f"sfm train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
