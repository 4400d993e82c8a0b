"""The one place that decides how a plain model trains over the ranks of a launch (torchtitan's
``parallelize.py``): :func:`parallelize` for pretraining, :func:`parallelize_finetuning` for fine-tuning.
Nothing else branches on the strategy; the mechanics stay where they are:

=====================  =================================================================================
what runs              built by
=====================  =================================================================================
``single``             one process (whatever ``[dist] strategy`` says): the model itself, plain PyTorch
``ddp``                :func:`sfm.distributed.strategies.apply_strategy` (``DistributedDataParallel``)
``fsdp2-zero2``,       :func:`sfm.distributed.strategies.apply_strategy` (``fully_shard``, one unit per
``fsdp2-full``         block); its shards are :class:`sfm.distributed.strategies.FSDP2Shards`
``deepspeed-zero2``,   :func:`sfm.distributed.deepspeed_zero.initialize` (the engine takes the optimiser
``deepspeed-zero3``    as it wraps the model); its shards are :class:`sfm.distributed.deepspeed_zero.DeepSpeedShards`
``cp > 1``             :class:`sfm.distributed.context_parallel.ContextParallelMAE` around the model, under
                       the data-parallel strategy; each rank reads its :func:`crop_slab` of every crop
=====================  =================================================================================

The step (:class:`sfm.train.step.TrainStep`) runs whatever comes back through its :class:`StepHooks`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, ContextManager, NamedTuple

import torch
from torch import nn

from sfm.distributed import deepspeed_zero, strategies
from sfm.distributed.context_parallel import ContextParallelMAE, CropSlab, cp_kept_tokens, crop_slab
from sfm.distributed.layout import Layout, cp_group

log = logging.getLogger(__name__)

# builds the optimiser of the module it is given, and what must see the optimiser before DeepSpeed wraps it
# (its schedule): (optimiser, scheduler)
OptimizerFor = Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]


class StepHooks(NamedTuple):
    """How a :class:`sfm.train.step.TrainStep` runs on its device and strategy; each defaults to plain PyTorch.

    - ``autocast``: context for the forward pass, e.g. ``lambda: torch.autocast("cuda", torch.bfloat16)``.
    - ``no_sync``: context that skips the gradient all-reduce on all but the last micro-batch.
    - ``backward``: ``loss -> None`` (default ``loss.backward()``; Accelerate's ``backward`` scales for it).
    - ``clip_grad_norm``: ``(parameters, max_norm) -> norm before clipping``; called every step (with
      ``max_norm=inf`` when ``grad_clip`` is 0) so the norm is always known.
    - ``check_finite``: ``(losses, grad_norm) -> bool``, the same answer on every rank; False skips the
      update (gradients dropped, optimiser untouched; the scheduler still advances, so the learning
      rate stays a function of the step number).
    - ``update``: ``() -> (norm before clipping, applied)``, a strategy's own update in place of clip,
      check and ``optimizer.step()`` (DeepSpeed's engine clips, skips an update whose gradients are not
      finite, steps and clears the gradients). ``check_finite`` still judges the step; an update applied
      although it says no is an error.
    """

    autocast: Callable[[], ContextManager] = contextlib.nullcontext
    no_sync: Callable[[], ContextManager] | None = None
    backward: Callable[[torch.Tensor], None] | None = None
    clip_grad_norm: Callable[..., torch.Tensor] | None = None
    check_finite: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
    update: Callable[[], tuple[torch.Tensor, bool]] | None = None


class Parallelized(NamedTuple):
    """What the training step runs for one strategy on one launch layout.

    ``strategy``: what runs (the config's strategy, or ``single`` on one process); ``model``: what the step
    calls (the plain model, its cp shell, its DDP wrapper, the FSDP2 module or the DeepSpeed engine);
    ``optimizer`` and ``scheduler``: as :data:`OptimizerFor` built them on it; ``shards``: a sharded strategy's
    weights and optimiser state (the checkpointer saves them instead of full weights; export gathers them),
    None when every rank holds the full weights; ``hooks``: how the step runs it; ``slab``: context
    parallelism, this rank's inline voxels of every crop (:func:`sfm.distributed.context_parallel.crop_slab`),
    else None; ``replicated``: several ranks each hold the full weights (their digests can be compared)."""

    strategy: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    shards: strategies.FSDP2Shards | deepspeed_zero.DeepSpeedShards | None
    hooks: StepHooks
    slab: CropSlab | None
    replicated: bool


def parallelize(model: nn.Module, optimizer_for: OptimizerFor, cfg, layout: Layout, accelerator,
                check_finite: Callable[[torch.Tensor, torch.Tensor], bool] | None = None) -> Parallelized:
    """What pretraining job ``cfg`` (a :class:`sfm.config.JobConfig`; ``cfg.dist.strategy``) runs on this rank of
    ``layout``: ``model`` (plain, on its device, the same initial weights on every rank) in its context-parallel
    shell and data-parallel strategy, its optimiser (``optimizer_for`` builds it on what the strategy trains:
    FSDP2 replaces the parameters, DeepSpeed takes the optimiser as it wraps the model), and the step's hooks
    (``accelerator``'s autocast and backward, the strategy's gradient sync, clipping and update;
    ``check_finite`` judges every step). A collective where the layout has several ranks."""
    strategy = cfg.dist.strategy if layout.world > 1 else "single"
    step_model, slab = model, None
    if layout.cp > 1:
        step_model, slab = context_parallel(model, layout, log_it=accelerator.is_main_process)
    if strategy in strategies.APPLIED:
        step_model = strategies.apply_strategy(step_model, strategy, units=strategies.sharding_units(model))
    optimizer, scheduler = optimizer_for(step_model)
    replicated = strategy in strategies.REPLICATED
    if strategy in deepspeed_zero.STAGES:
        params = sum(p.numel() for p in model.parameters())
        config = deepspeed_zero.engine_config(cfg, layout.world, params=params,
                                              bf16=accelerator.mixed_precision == "bf16")
        engine = deepspeed_zero.initialize(model, optimizer, config)
        # DeepSpeed's engine clips, skips non-finite gradients and steps; it reduces gradients in every
        # backward, so it has no no_sync
        hooks = StepHooks(autocast=accelerator.autocast, backward=functools.partial(deepspeed_zero.backward, engine),
                          check_finite=check_finite, update=functools.partial(deepspeed_zero.step, engine))
        return Parallelized(strategy, engine, optimizer, scheduler, deepspeed_zero.DeepSpeedShards(engine), hooks,
                            slab, replicated)
    shards = strategies.FSDP2Shards(step_model, optimizer) if strategy in strategies.RESHARD_AFTER_FORWARD else None
    hooks = StepHooks(
        autocast=accelerator.autocast,
        no_sync=(lambda: strategies.no_sync(step_model)) if layout.world > 1 else None,
        backward=accelerator.backward,
        clip_grad_norm=lambda _params, max_norm: strategies.clip_grad_norm(step_model, max_norm),
        check_finite=check_finite)
    return Parallelized(strategy, step_model, optimizer, scheduler, shards, hooks, slab, replicated)


def context_parallel(model: nn.Module, layout: Layout, *, log_it: bool) -> tuple[ContextParallelMAE, CropSlab]:
    """``model``'s context-parallel shell over this rank's cp group, and the inline slab of every crop this
    rank reads. ``log_it``: say how the tokens are split (once, from the main process)."""
    mcfg = model.cfg
    slab = crop_slab(mcfg.crop, mcfg.patch, layout.cp_rank, layout.cp)
    shell = ContextParallelMAE(model, cp_group(layout), mcfg.crop)
    kept, tokens = cp_kept_tokens(mcfg.num_patches, mcfg.mask_ratio, layout.cp), mcfg.num_patches
    if log_it:
        log.info("context parallel: dp %d x cp %d; each rank reads inline voxels [%d, %d) of every crop and "
                 "holds 1/%d of its %d tokens; %d kept tokens, effective mask ratio %.4f (configured %.4f)",
                 layout.dp, layout.cp, slab.start, slab.stop, layout.cp, tokens, kept,
                 1 - kept / tokens, mcfg.mask_ratio)
    return shell, slab


def parallelize_finetuning(net: nn.Module, world: int) -> nn.Module:
    """What runs a fine-tuning run's batches on ``world`` ranks: ``net`` itself on one process, its DDP wrapper
    over several (the task model is small: every rank holds it whole, whatever ``[dist] strategy`` says). Call
    it after freezing what does not learn: DDP reduces the gradients of the parameters that do."""
    return net if world == 1 else strategies.apply_strategy(net, "ddp")


def fewest_over_ranks(value: int, world: int) -> int:
    """The smallest ``value`` any of the ``world`` ranks holds (an all-reduce; ``value`` itself on one process):
    what a fine-tuning run's ranks agree on where each measured its own (the steps that fit a time budget)."""
    if world == 1:
        return int(value)
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    held = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MIN)
    return int(held.item())
