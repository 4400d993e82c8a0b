"""One optimiser step of MAE pretraining, with torch alone: what ``sfm.train.trainer`` runs under Accelerate
and what ``benchmarks/gpu_train.py`` times on a bare GPU (which has no metaflow, zarr or boto3).

- :func:`build_optimizer`: AdamW, fused kernels wherever the device has them, no weight decay on
  norms, biases and tokens (as in MAE); or Muon for the blocks' weight matrices beside it (``sfm.train.muon``).
- :func:`lr_at`: linear warmup, then cosine decay.
- :func:`apply_training_options`: activation checkpointing and ``torch.compile``, applied to the
  model from outside, block by block (the way torchtitan's ``parallelize.py`` does).
- :class:`TrainStep`: forward and backward over the micro-batches of one step, clip, step.
- :func:`throughput`: samples/s, voxels/s and model-FLOPs utilisation (MFU) of a timed window.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, Iterable, NamedTuple

import torch

from sfm.distributed.parallelize import StepHooks
from sfm.model import MaskedAutoencoder3D, mfu
from sfm.train.muon import MuonAdamW, muon_parameters


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def weight_decay_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float,
                        **extra) -> list[dict]:
    """Two optimiser groups, as in MAE: weight decay on the matrices and kernels, none on norms,
    biases and the cls/mask tokens; ``extra`` is added to both (e.g. a learning-rate scale)."""
    decay, no_decay = [], []
    for name, p in named_parameters:
        (no_decay if p.ndim < 2 or name.endswith("_token") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, **extra},
            {"params": no_decay, "weight_decay": 0.0, **extra}]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), algorithm: str = "adamw",
                    muon_lr: float = 0.0) -> torch.optim.Optimizer:
    """AdamW without weight decay on norms, biases and the cls/mask tokens.

    Fused (one kernel over all parameters) on CUDA and CPU: on CPU it is much faster than the
    per-tensor loop torch falls back to otherwise (BENCHMARKS.md "Training"), which matters once the
    model is large.

    ``algorithm = "muon"``: the transformer blocks' weight matrices step by Muon at peak rate ``muon_lr``
    (0: ``lr``), everything else by AdamW at ``lr`` (:class:`sfm.train.muon.MuonAdamW`, one optimiser).
    """
    muon_names = set(muon_parameters(model)) if algorithm == "muon" else set()
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrices = [p for name, p in trained if name in muon_names]
    groups = weight_decay_groups([(name, p) for name, p in trained if name not in muon_names], weight_decay)
    if algorithm == "muon":
        groups.append({"params": matrices, "weight_decay": weight_decay, "muon": True, "lr": muon_lr or lr})
        return MuonAdamW(groups, lr=lr, betas=betas)
    device = next(model.parameters()).device
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused or None)


def apply_training_options(model: MaskedAutoencoder3D, *, grad_checkpointing: bool = False,
                           compile: bool = False, compile_backend: str = "inductor") -> MaskedAutoencoder3D:
    """Turn on activation checkpointing (recompute each block in backward) and/or compile each
    transformer block with ``torch.compile``. Blocks are compiled in place, so parameter names and
    checkpoints are unchanged; masking (argsort, gather) stays eager. Returns the same model."""
    model.grad_checkpointing = bool(grad_checkpointing)
    if compile:
        for block in [*model.blocks, *model.decoder_blocks]:
            block.compile(backend=compile_backend)
    return model


class StepResult(NamedTuple):
    """What one optimiser step did: ``losses`` [micro-batches] float32, the gradient norm before
    clipping (a 0-d tensor; inf/NaN when the gradients are not finite), and whether the update was
    applied (False: skipped because ``check_finite`` said no)."""

    losses: torch.Tensor
    grad_norm: torch.Tensor
    applied: bool


class TrainStep:
    """One optimiser step: ``micro_batches`` forward/backward passes (gradients accumulated), then
    gradient clipping, ``optimizer.step()`` and ``scheduler.step()``.

    ``hooks`` (:class:`sfm.distributed.parallelize.StepHooks`) default to plain PyTorch; the trainer passes
    those :func:`sfm.distributed.parallelize.parallelize` builds (Accelerate's ``backward`` and ``autocast``, the
    strategy's ``no_sync`` and global-norm clipping, or DeepSpeed's update),
    so the same step runs under DDP, FSDP2 or context parallelism and on a bare device.

    Args:
        generator: the RNG the MAE masks are drawn from (default: torch's global one).
        mask_noise: ``(micro-batch index, imgs) -> noise [N, L]`` for the MAE masks instead of
            ``generator`` (e.g. derived from the data's position, so that masks do not depend on how
            samples are spread over ranks).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *, grad_clip: float = 0.0,
                 hooks: StepHooks = StepHooks(), generator: torch.Generator | None = None,
                 mask_noise: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.mask_noise = mask_noise
        self.generator = generator
        self.grad_clip = float(grad_clip)
        self.autocast, self.no_sync = hooks.autocast, hooks.no_sync
        self.backward = hooks.backward or (lambda loss: loss.backward())
        self.clip_grad_norm = hooks.clip_grad_norm or torch.nn.utils.clip_grad_norm_
        self.check_finite = hooks.check_finite
        self.update = hooks.update

    def __call__(self, micro_batches: Iterable[torch.Tensor], count: int) -> StepResult:
        """Train on ``count`` micro-batches ``[B, C, D, H, W]`` drawn from ``micro_batches``."""
        losses = []
        batches = iter(micro_batches)
        for i in range(count):
            imgs = next(batches)
            last = i == count - 1
            skip_sync = self.no_sync() if self.no_sync is not None and not last else contextlib.nullcontext()
            with skip_sync:
                with self.autocast():
                    if self.mask_noise is not None:
                        loss, _, _ = self.model(imgs, noise=self.mask_noise(i, imgs))
                    else:
                        loss, _, _ = self.model(imgs, generator=self.generator)
                self.backward(loss / count)
            losses.append(loss.detach().float())
        losses_t = torch.stack(losses)
        norm, applied = self.step_optimizer(losses_t)
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # a skipped first step advances the schedule on purpose; torch warns that the optimiser did not step
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self.scheduler.step()
        return StepResult(losses_t, norm, bool(applied))

    def step_optimizer(self, losses: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Clip, check and step (or the strategy's ``update``); returns the norm before clipping and whether the
        update was applied."""
        if self.update is not None:
            norm, stepped = self.update()
        else:
            norm = self.clip_grad_norm(self.model.parameters(), self.grad_clip if self.grad_clip > 0 else math.inf)
        norm = torch.as_tensor(norm, dtype=torch.float32).detach()
        applied = self.check_finite(losses, norm) if self.check_finite is not None else True
        if self.update is not None:
            if stepped and not applied:
                raise RuntimeError(f"the strategy applied an update whose losses {losses.tolist()} or gradient norm "
                                   f"{float(norm)} are not finite")
            return norm, stepped and applied
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied


def throughput(*, samples: int, seconds: float, flops_per_sample: float, voxels_per_sample: int,
               peak_flops: float, devices: int = 1) -> dict[str, float]:
    """Speed of a timed window in which ``samples`` samples (all devices together) were trained.

    ``mfu`` is the achieved model FLOP/s per device over ``peak_flops`` (one device's peak, or the
    measured matmul rate on CPU); FLOPs are the analytic count of ``sfm.model.flops``.
    """
    samples_per_s = samples / seconds
    return {
        "samples_per_s": samples_per_s,
        "voxels_per_s": samples_per_s * voxels_per_sample,
        "mfu": mfu(flops_per_sample, samples_per_s / devices, peak_flops),
    }
