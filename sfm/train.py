"""MAE pretraining on Hugging Face Accelerate; one process per device, launched by torchrun.

``python -m sfm.train JOB.json`` (under ``torchrun``) trains on the surveys named in the job file and
writes under its ``run_root``::

    job_config.json        the resolved JobConfig (written first)
    ckpt/step-NNNNNN/      checkpoints (see sfm.checkpoint); a restarted job continues from the newest
    final/                 the exported model (model.safetensors + config.json)
    summary.json           loss history and throughput (written last)
    tensorboard/           Accelerate's TensorBoard logs

The job file is JSON: {"config": JobConfig dict, "surveys": [store URLs], "run_root": URL}.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch

from sfm import checkpoint, storage
from sfm.config import JobConfig
from sfm.data import BatchStream, CropSampler
from sfm.hardware import peak_flops
from sfm.model import MaskedAutoencoder3D, build_model, mae_config, train_flops_per_sample
from sfm.model import io as model_io

log = logging.getLogger("sfm.train")


def model_config_for(cfg: JobConfig):
    """The MAEConfig a job trains: the preset, at the job's crop, mask ratio and patch."""
    overrides: dict[str, Any] = {"crop": tuple(cfg.data.crop), "mask_ratio": cfg.model.mask_ratio}
    if cfg.model.patch:
        overrides["patch"] = tuple(cfg.model.patch)
    return mae_config(cfg.model.preset, **overrides)


def lr_at(step: int, cfg: JobConfig) -> float:
    """Linear warmup to ``train.lr``, then cosine decay to ``train.min_lr`` at ``train.max_steps``."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: MaskedAutoencoder3D, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW without weight decay on norms, biases and tokens (as in MAE); fused on CUDA."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith("_token") else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), fused=fused or None)


def train(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run (or continue) one training job; returns the summary on the main process."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cfg = JobConfig.from_dict(job["config"])
    run_root = job["run_root"]
    ckpt_root = storage.join(run_root, "ckpt")
    if cfg.train.threads_per_process > 0:
        torch.set_num_threads(cfg.train.threads_per_process)
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if cuda else "no")
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if cuda else "gloo")
    tb_dir = tempfile.mkdtemp(prefix="sfm-tb-")
    accelerator = Accelerator(
        cpu=not cuda, mixed_precision=precision, log_with="tensorboard", project_dir=tb_dir,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=dt.timedelta(seconds=cfg.dist.timeout_s))],
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)

    torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
    mcfg = model_config_for(cfg)
    model = build_model(mcfg)
    model.grad_checkpointing = cfg.train.grad_checkpointing
    if cfg.train.init_from:
        init = model_io.load(cfg.train.init_from)
        model.load_state_dict(init.state_dict())
        log.info("initialised from %s", cfg.train.init_from)
    model = model.to(accelerator.device)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.train.lr)
    # the scheduler is stepped by hand once per optimiser step, whatever the world size
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(cfg.data.seed * 1000 + 17 + rank)  # masks differ across ranks

    start_step, history = 0, []
    resumed = checkpoint.load_latest(ckpt_root, rank, warn=log.warning)
    if resumed is not None:
        accelerator.unwrap_model(model).load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        if resumed["rng"] is not None:
            checkpoint.set_rng_state(resumed["rng"])
        start_step = int(resumed["state"]["step"])
        history = resumed["state"]["history"]
        log.info("resumed from %s at step %d", resumed["url"], start_step)
    elif main:
        storage.write_bytes(storage.join(run_root, "job_config.json"), cfg.to_json().encode())

    micro_batches = max(1, cfg.train.grad_accum)
    sampler = CropSampler(job["surveys"], cfg.data.crop, seed=cfg.data.seed,
                          min_live_fraction=cfg.data.min_live_fraction)
    stream = BatchStream(sampler, cfg.data.batch_size, rank=rank, world_size=world,
                         start_step=start_step * micro_batches)
    flops_per_sample = train_flops_per_sample(mcfg)
    peak = peak_flops(accelerator.device, torch.bfloat16 if precision == "bf16" else torch.float32)
    voxels_per_sample = math.prod(cfg.data.crop)
    accelerator.init_trackers("sfm-pretrain", config={"preset": cfg.model.preset, "world_size": world})

    from tqdm import tqdm

    bar = tqdm(total=cfg.train.max_steps, initial=start_step, disable=not main, desc="pretrain", mininterval=2,
               file=sys.stderr)
    losses: list[torch.Tensor] = []
    t_window, steps_in_window, t_start = time.perf_counter(), 0, time.perf_counter()
    steps_run = 0
    try:
        for step in range(start_step, cfg.train.max_steps):
            for micro in range(micro_batches):
                imgs = torch.from_numpy(next(stream)).to(accelerator.device, non_blocking=True)
                sync = micro == micro_batches - 1
                ctx = accelerator.no_sync(model) if not sync and world > 1 else contextlib.nullcontext()
                with ctx, accelerator.autocast():
                    loss, _, _ = model(imgs)
                accelerator.backward(loss / micro_batches)
                losses.append(loss.detach().float())
            if cfg.train.grad_clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            steps_in_window += 1
            steps_run += 1
            done = step + 1
            if done % cfg.train.log_every == 0 or done == cfg.train.max_steps:
                step_losses = accelerator.reduce(torch.stack(losses).view(-1, micro_batches).mean(1), "mean")
                losses.clear()
                elapsed = time.perf_counter() - t_window
                samples_per_s = steps_in_window * micro_batches * cfg.data.batch_size * world / elapsed
                first = done - len(step_losses)
                for i, value in enumerate(step_losses.tolist()):
                    history.append({"step": first + i + 1, "loss": value})
                metrics = {
                    "loss": history[-1]["loss"], "lr": scheduler.get_last_lr()[0], "samples_per_s": samples_per_s,
                    "voxels_per_s": samples_per_s * voxels_per_sample,
                    "mfu": flops_per_sample * samples_per_s / world / peak,
                }
                history[-1].update({k: v for k, v in metrics.items() if k != "loss"})
                accelerator.log(metrics, step=done)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=f"{samples_per_s:.1f}", mfu=f"{metrics['mfu']:.1%}")
                t_window, steps_in_window = time.perf_counter(), 0
            bar.update(1)
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.max_steps:
                _save_checkpoint(accelerator, model, optimizer, scheduler, ckpt_root, done,
                                 {"data": stream.state_dict(), "history": history}, cfg.train.keep_checkpoints)
    finally:
        bar.close()
        stream.close()

    summary = None
    if main:
        final_url = storage.join(run_root, "final")
        model_io.save(accelerator.unwrap_model(model), final_url, {"job": cfg.to_dict()})
        elapsed = time.perf_counter() - t_start
        tail = [h for h in history if "samples_per_s" in h]
        summary = {
            "steps": cfg.train.max_steps, "steps_this_attempt": steps_run, "resumed_from_step": start_step,
            "world_size": world, "initial_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None, "history": history,
            "samples_per_s": tail[-1]["samples_per_s"] if tail else None,
            "mfu": tail[-1]["mfu"] if tail else None, "model_url": final_url, "seconds": elapsed,
            "flops_per_sample": flops_per_sample, "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        }
        storage.write_bytes(storage.join(run_root, "summary.json"), json.dumps(summary, indent=1).encode())
        print(f"sfm train: {steps_run} steps ({start_step}->{cfg.train.max_steps}) on {world} rank(s) in "
              f"{elapsed:.1f}s, loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['samples_per_s'] or 0:.1f} samples/s", file=sys.stderr)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # flushes the trackers and ends the process group
    if main:
        storage.upload(tb_dir, storage.join(run_root, "tensorboard"))
    return summary


def _save_checkpoint(accelerator, model, optimizer, scheduler, root: str, step: int, meta: dict, keep: int) -> None:
    checkpoint.save_rank_rng(root, step, accelerator.process_index)
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
