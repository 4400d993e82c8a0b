"""MAE pretraining on Hugging Face Accelerate; one process per device, launched by torchrun.

``python -m sfm.train JOB.json`` (under ``torchrun``, or alone for one process) trains on the surveys named in the job file and
writes under its ``run_root``::

    job_config.json        the resolved JobConfig (written first)
    ckpt/step-NNNNNN/      checkpoints (see sfm.checkpoint); a restarted job continues from the newest
    final/                 the exported model (model.safetensors + config.json)
    snapshots/step-NNNNNN/ the model exported part-way, at ``train.snapshots`` fractions of the steps
    summary.json           loss history and throughput (written last)
    tensorboard/           Accelerate's TensorBoard logs

The job file is JSON: {"config": JobConfig dict, "surveys": [store URLs], "run_root": URL}.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, NamedTuple

import torch

from sfm import checkpoint, parallelize, storage
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.health import ROLLBACK, SKIP, Heartbeat, NonFiniteGuard, Watchdog, all_ranks_finite
from sfm.data import training_stream
from sfm.hardware import peak_flops
from sfm.model import build_model, mae_config, train_flops_per_sample
from sfm.model import load as load_model
from sfm.model import save as save_model
from sfm.train_step import TrainStep, apply_training_options, build_optimizer, lr_at, throughput

log = logging.getLogger("sfm.train")


def model_config_for(cfg: JobConfig):
    """The MAEConfig a job trains: the preset, at the job's crop, masking, patch and decoder size."""
    m = cfg.model
    overrides: dict[str, Any] = {"crop": tuple(cfg.data.crop), "mask_ratio": m.mask_ratio, "mask_tube": m.mask_tube}
    if m.patch:
        overrides["patch"] = tuple(m.patch)
    if m.decoder_depth:
        overrides["decoder_depth"] = m.decoder_depth
    if m.decoder_embed_dim:
        overrides["decoder_embed_dim"] = m.decoder_embed_dim
    try:
        return mae_config(m.preset, **overrides)
    except ValueError as err:  # a preset or model setting no model can have: the user's to fix
        raise SFMError(f"[model]/[data] settings do not make a model: {err}") from None


def schedule(cfg: JobConfig) -> Callable[[int], float]:
    """Learning rate of each optimiser step for this job (warmup + cosine, see train_step.lr_at)."""
    t = cfg.train
    return functools.partial(lr_at, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps)


class Layout(NamedTuple):
    """Where this rank sits in the dp x cp mesh: ranks ``d * cp .. d * cp + cp - 1`` share dp index
    ``d`` (the same crops; each holds 1/cp of every crop's tokens), so a cp group sits on one node."""

    world: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int

    @classmethod
    def of(cls, rank: int, world: int, cp: int) -> "Layout":
        """cp must divide world (JobConfig.check_parallelism)."""
        return cls(world, world // cp, cp, rank // cp, rank % cp)


class Faults:
    """Faults injected on purpose, to test the run's health handling (``SFM_INJECT_FAULTS``).

    A comma list of ``nan@STEP`` (rank 0's batch of that step becomes NaN: the loss and the
    gradients turn non-finite) and ``hang@STEP`` (rank 0's data stops before that step, as a hung
    loader would). Steps count from 1. Each fault fires once per run: a marker under
    ``<run_root>/faults/`` keeps a rolled-back, retried or resumed attempt from meeting it again.
    """

    def __init__(self, spec: str, run_root: str, enabled: bool):
        self.pending: set[tuple[str, int]] = set()
        self.root = storage.join(run_root, "faults")
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            kind, _, step = item.partition("@")
            if kind not in ("nan", "hang") or not step.isdigit():
                raise SFMError(f"SFM_INJECT_FAULTS item {item!r} is not nan@STEP or hang@STEP")
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
        """``batch`` for training step ``step`` (1-based), faulted if one is due."""
        if self._take("hang", step):
            log.warning("injected fault: the data stops before step %d (hang)", step)
            threading.Event().wait()  # forever: the watchdog ends the process
        if self._take("nan", step):
            log.warning("injected fault: NaN batch at step %d", step)
            return torch.full_like(batch, float("nan"))
        return batch


def train(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run (or continue) one training job; returns the summary on the main process."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cfg = JobConfig.from_dict(job["config"])
    run_root = job["run_root"]
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if cuda else "no")
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if cuda else "gloo")
    # under torchrun: one process group over all ranks; run directly: a single process, no group.
    # The timeout bounds every collective: a dead rank fails the others instead of hanging them.
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
    cfg.check_parallelism(world)  # the processes torchrun started, whatever the config says
    layout = Layout.of(rank, world, cfg.dist.cp)
    h = cfg.health
    watchdog = Watchdog(h.step_timeout_s, first_timeout_s=h.first_step_timeout_s).start()
    heartbeat = Heartbeat(run_root, every_s=h.heartbeat_every_s, max_steps=cfg.train.max_steps, enabled=main,
                          world_size=world)
    guard = NonFiniteGuard(h.max_nonfinite_in_a_row, h.max_rollbacks)
    faults = Faults(os.environ.get("SFM_INJECT_FAULTS", ""), run_root, enabled=main)
    try:
        summary = _train(job, cfg, accelerator, layout, precision, tb_dir, watchdog, heartbeat, guard, faults)
    except BaseException as err:
        if main:
            with contextlib.suppress(Exception):
                heartbeat.finish(watchdog.last_step or 0, status="failed", error=type(err).__name__)
        raise
    finally:
        watchdog.stop()
    if main:
        heartbeat.finish(cfg.train.max_steps, loss=summary["final_loss"], samples_per_s=summary["samples_per_s"],
                         skipped_nonfinite=guard.skipped, rollbacks=guard.rollbacks)
    return summary


def _train(job, cfg: JobConfig, accelerator, layout: Layout, precision: str, tb_dir: str, watchdog: Watchdog,
           heartbeat: Heartbeat, guard: NonFiniteGuard, faults: Faults) -> dict[str, Any] | None:
    run_root = job["run_root"]
    ckpt_root = storage.join(run_root, "ckpt")
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    strategy = cfg.dist.strategy if world > 1 else "single"
    sharded = strategy.startswith("fsdp2")

    torch.manual_seed(cfg.data.seed)  # identical initial weights on every rank
    mcfg = model_config_for(cfg)
    model = build_model(mcfg)
    if cfg.train.init_from:
        model.load_state_dict(load_model(cfg.train.init_from).state_dict())
        log.info("initialised from %s", cfg.train.init_from)
    apply_training_options(model, grad_checkpointing=cfg.train.grad_checkpointing, compile=cfg.train.compile)
    model = model.to(accelerator.device)

    # the module the step runs: the model, in a context-parallel shell, under the dp strategy
    slab = None
    step_model: torch.nn.Module = model
    tokens = mcfg.num_patches  # patches per crop
    if layout.cp > 1:
        from sfm.context_parallel import ContextParallelMAE, cp_kept_tokens, crop_slab

        cp_group = _cp_group(layout)
        slab = crop_slab(mcfg.crop, mcfg.patch, layout.cp_rank, layout.cp)
        step_model = ContextParallelMAE(model, cp_group, mcfg.crop)
        kept = cp_kept_tokens(tokens, mcfg.mask_ratio, layout.cp)
        if main:
            log.info("context parallel: dp %d x cp %d; each rank reads inline voxels [%d, %d) of every crop and "
                     "holds 1/%d of its %d tokens; %d kept tokens, effective mask ratio %.4f (configured %.4f)",
                     layout.dp, layout.cp, slab.start, slab.stop, layout.cp, tokens, kept, 1 - kept / tokens,
                     mcfg.mask_ratio)
    if world > 1:
        step_model = parallelize.apply_strategy(step_model, cfg.dist.strategy,
                                                units=parallelize.sharding_units(model))
    optimizer = build_optimizer(step_model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                betas=cfg.train.betas)
    lr_of_step = schedule(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_of_step(s) / cfg.train.lr)
    # the scheduler is stepped by hand once per optimiser step, whatever the world size
    torch.manual_seed(cfg.data.seed * 1000 + 17 + rank)

    def load_checkpoint() -> dict[str, Any] | None:
        """The newest checkpoint all ranks can read, loaded into the model, optimiser and scheduler."""
        if sharded:
            ckpt = _load_agreed_sharded(accelerator, ckpt_root, step_model, optimizer)
        else:
            ckpt = _load_agreed_checkpoint(accelerator, ckpt_root)
            if ckpt is not None:
                if ckpt["model"] is None:
                    raise SFMError(f"checkpoint {ckpt['url']} is sharded (an fsdp2 run); resume it with the "
                                   "same dist.strategy on more than one process")
                model.load_state_dict(ckpt["model"])
                optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        return ckpt

    micro_batches = max(1, cfg.train.grad_accum)
    start_step, history, data_state = 0, [], None
    resumed = load_checkpoint()
    if resumed is not None:
        start_step = int(resumed["state"]["step"])
        history = resumed["state"]["history"]
        data_state = resumed["state"].get("data")
        guard.load_state_dict(resumed["state"].get("health", {}))
        log.info("resumed from %s at step %d", resumed["url"], start_step)
    elif main:
        storage.write_bytes(storage.join(run_root, "job_config.json"), cfg.to_json().encode())

    # the cp ranks of a dp group draw the same crops; each reads only its inline slab of them
    on_slab = {"slab": (slab.start, slab.stop)} if slab is not None else {}
    stream = training_stream(job["surveys"], cfg.data, rank=layout.dp_rank, world_size=layout.dp,
                             start_batch=start_step * micro_batches, **on_slab)
    if data_state is not None and data_state.get("world_size") == layout.dp:
        stream.load_state_dict(data_state)  # the data position saved with the checkpoint
    current = {"step": start_step + 1, "batch": 0}  # the step the next batch is for (faults are keyed on it)

    def feed():
        for batch in stream:
            current["batch"] = stream.batch - 1  # this rank's batch number in the data stream
            yield faults.apply(current["step"], batch).to(accelerator.device, non_blocking=True)

    batches = feed()
    noise_gen = torch.Generator(device=accelerator.device)

    def mask_noise(_micro: int, imgs: torch.Tensor) -> torch.Tensor:
        """The MAE mask noise [N, L] of this rank's share of the global batch at the stream's position:
        every rank draws the whole dp batch's noise from one seed and keeps its rows, so masks depend on
        the samples, not on the number of ranks (a 2-rank run equals a 1-rank run with the same global
        batch) or on any RNG state (a resumed run continues exactly). cp ranks share their rows."""
        n = imgs.shape[0]
        noise_gen.manual_seed((cfg.data.seed * 1_000_003 + current["batch"]) % (2**63))
        every = torch.rand(layout.dp * n, tokens, generator=noise_gen, device=accelerator.device)
        return every[layout.dp_rank * n:(layout.dp_rank + 1) * n]

    reduce_sum = (lambda t: accelerator.reduce(t, "sum")) if world > 1 else None

    def all_finite(losses: torch.Tensor, norm: torch.Tensor) -> bool:
        return all_ranks_finite(losses, norm, reduce=reduce_sum)

    train_step = TrainStep(
        step_model, optimizer, scheduler, grad_clip=cfg.train.grad_clip, autocast=accelerator.autocast,
        no_sync=(lambda: parallelize.no_sync(step_model)) if world > 1 else None, backward=accelerator.backward,
        clip_grad_norm=lambda _params, max_norm: parallelize.clip_grad_norm(step_model, max_norm),
        check_finite=all_finite, mask_noise=mask_noise,
    )
    flops_per_sample = train_flops_per_sample(mcfg)
    peak = peak_flops(accelerator.device, torch.bfloat16 if precision == "bf16" else torch.float32)
    samples_per_step = micro_batches * cfg.data.batch_size * layout.dp  # the cp ranks of a group share samples
    accelerator.init_trackers("sfm-pretrain", config={"preset": cfg.model.preset, "world_size": world,
                                                      "strategy": strategy, "cp": layout.cp})
    if resumed is not None and resumed["rng"] is not None:
        checkpoint.set_rng_state(resumed["rng"])

    def save(done: int) -> None:
        _save_checkpoint(accelerator, model, step_model, optimizer, scheduler, ckpt_root, done,
                         {"data": stream.state_dict(), "history": history, "health": guard.state_dict(),
                          "strategy": strategy, "world_size": world, "cp": layout.cp},
                         cfg.train.keep_checkpoints, sharded)

    snapshot_steps = {max(1, round(f * cfg.train.max_steps)) for f in cfg.train.snapshots if 0 < f < 1}
    from tqdm import tqdm

    bar = tqdm(total=cfg.train.max_steps, initial=start_step, disable=not main, desc="pretrain", mininterval=2,
               file=sys.stderr)
    pending: list[torch.Tensor] = []  # mean loss of each step since history was last written
    t_start = time.perf_counter()
    t_window, steps_in_window, paused = t_start, 0, 0.0
    step = start_step
    try:
        while step < cfg.train.max_steps:
            current["step"] = step + 1
            result = train_step(batches, micro_batches)
            verdict = guard.observe(result.applied)
            if verdict == ROLLBACK:
                t_roll = time.perf_counter()
                pending.clear()
                back = load_checkpoint()
                if back is None:
                    raise SFMError(f"{guard.consecutive} non-finite steps in a row before the first checkpoint; "
                                   "lower train.lr or raise train.warmup_steps, or checkpoint sooner "
                                   "(train.checkpoint_every)")
                guard.rolled_back()
                log.warning("rolled back to %s after %d non-finite steps in a row (rollback %d of %d); the data "
                            "stream continues past the bad batches", back["url"], guard.max_consecutive,
                            guard.rollbacks, guard.max_rollbacks)
                step = int(back["state"]["step"])
                history = back["state"]["history"]
                bar.reset(total=cfg.train.max_steps)
                bar.update(step)
                watchdog.progress(step)
                paused += time.perf_counter() - t_roll
                continue
            if verdict == SKIP:
                log.warning("step %d: non-finite loss or gradient norm (losses %s, grad norm %s); update skipped "
                            "(%d in a row, %d in this run)", step + 1, result.losses.tolist(),
                            float(result.grad_norm), guard.consecutive, guard.skipped)
            step += 1
            watchdog.progress(step)
            pending.append(result.losses.mean())
            steps_in_window += 1
            last = step == cfg.train.max_steps
            log_now = step % cfg.train.log_every == 0 or last
            save_now = step % cfg.train.checkpoint_every == 0 or last
            if log_now or save_now:  # a checkpoint holds the loss of every step before it
                step_losses = accelerator.reduce(torch.stack(pending), "mean").tolist()
                # a skipped (non-finite) step keeps its place in the history with no loss
                history.extend({"step": step - len(step_losses) + i + 1, "loss": v if math.isfinite(v) else None}
                               for i, v in enumerate(step_losses))
                pending.clear()
            if log_now:
                speed = throughput(samples=steps_in_window * samples_per_step,
                                   seconds=time.perf_counter() - t_window - paused, flops_per_sample=flops_per_sample,
                                   voxels_per_sample=math.prod(cfg.data.crop), peak_flops=peak, devices=world)
                metrics = {"loss": history[-1]["loss"], "lr": scheduler.get_last_lr()[0], **speed}
                if metrics["loss"] is None:
                    metrics["loss"] = float("nan")
                history[-1].update({k: v for k, v in metrics.items() if k != "loss"})
                accelerator.log(metrics, step=step)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                sps=f"{speed['samples_per_s']:.1f}", vox=f"{speed['voxels_per_s'] / 1e6:.1f}M",
                                mfu=f"{speed['mfu']:.1%}")
                heartbeat.beat(step, loss=metrics["loss"], samples_per_s=speed["samples_per_s"],
                               skipped_nonfinite=guard.skipped, rollbacks=guard.rollbacks)
                t_window, steps_in_window, paused = time.perf_counter(), 0, 0.0
            bar.update(1)
            if step in snapshot_steps and not last:  # the model part-way, for "does more pretraining help?"
                t_snap = time.perf_counter()
                snapshot = _full_model(model, step_model, mcfg, sharded, main)  # a collective when sharded
                if main:
                    save_model(snapshot, _snapshot_url(run_root, step), {"job": cfg.to_dict()})
                paused += time.perf_counter() - t_snap
            if save_now:
                t_save = time.perf_counter()
                save(step)
                watchdog.progress(step)
                paused += time.perf_counter() - t_save
    finally:
        bar.close()
        stream.close()

    summary = None
    steps_run = cfg.train.max_steps - start_step
    final_url = storage.join(run_root, "final")
    export = _full_model(model, step_model, mcfg, sharded, main)
    digests = _replica_digests(model) if world > 1 and not sharded else None  # a collective
    if main:
        save_model(export, final_url, {"job": cfg.to_dict()})
        elapsed = time.perf_counter() - t_start
        tail = [h for h in history if "samples_per_s" in h]
        finite = [h["loss"] for h in history if h["loss"] is not None]
        summary = {
            "steps": cfg.train.max_steps, "steps_this_attempt": steps_run, "resumed_from_step": start_step,
            "world_size": world, "strategy": strategy, "dp": layout.dp, "cp": layout.cp,
            "initial_loss": finite[0] if finite else None, "final_loss": finite[-1] if finite else None,
            "history": history,
            "samples_per_s": tail[-1]["samples_per_s"] if tail else None,
            "voxels_per_s": tail[-1]["voxels_per_s"] if tail else None,
            "mfu": tail[-1]["mfu"] if tail else None, "mfu_peak_flops": peak, "model_url": final_url,
            "seconds": elapsed, "flops_per_sample": flops_per_sample,
            "snapshots": {str(s): _snapshot_url(run_root, s) for s in sorted(snapshot_steps) if s < cfg.train.max_steps},
            "health": {"skipped_nonfinite": guard.skipped, "rollbacks": guard.rollbacks},
            "rank_weight_digests": digests,  # replicated strategies: one per rank, all equal
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        }
        storage.write_bytes(storage.join(run_root, "summary.json"), json.dumps(summary, indent=1).encode())
        print(f"sfm train: {steps_run} steps ({start_step}->{cfg.train.max_steps}) on {world} rank(s) "
              f"({strategy}, dp {layout.dp} x cp {layout.cp}) in {elapsed:.1f}s, loss {summary['initial_loss']:.4f} "
              f"-> {summary['final_loss']:.4f}, {summary['samples_per_s'] or 0:.1f} samples/s, "
              f"MFU {summary['mfu'] or 0:.1%}", file=sys.stderr)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # flushes the trackers and ends the process group
    if main:
        storage.upload(tb_dir, storage.join(run_root, "tensorboard"))
    return summary


def _snapshot_url(run_root: str, step: int) -> str:
    return storage.join(run_root, "snapshots", f"step-{step:06d}")


def _full_model(model, step_model, mcfg, sharded: bool, main: bool):
    """The plain model with the full weights, on the main process (a collective when ``sharded``:
    rank 0 gathers the shards into a fresh model); other ranks get ``model`` back unchanged."""
    if not sharded:
        return model
    full = parallelize.full_state_dict(step_model)
    if not main:
        return model
    export = build_model(mcfg)
    export.load_state_dict(full)
    return export


def _replica_digests(model: torch.nn.Module) -> list[str]:
    """sha256 of each rank's full weights, gathered from every rank (a collective): replicas that
    drifted apart would show different digests."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    out: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, h.hexdigest())
    return out


def _cp_group(layout: Layout):
    """This rank's context-parallel group (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    mine = None
    for d in range(layout.dp):
        group = dist.new_group(list(range(d * layout.cp, (d + 1) * layout.cp)))
        if d == layout.dp_rank:
            mine = group
    return mine


def _all_ranks(accelerator, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (a collective)."""
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=accelerator.device)
    torch.distributed.all_reduce(flag)
    return flag.item() == 0


def _load_agreed_sharded(accelerator, root: str, step_model, optimizer) -> dict[str, Any] | None:
    """The newest sharded checkpoint every rank can read, loaded into ``step_model`` and ``optimizer``
    (collectively); unreadable ones are passed over with a warning, as in the unsharded case."""
    steps = [checkpoint.complete_steps(root) if accelerator.is_main_process else None]
    torch.distributed.broadcast_object_list(steps, src=0)
    for step in reversed(steps[0]):
        url = checkpoint.step_dir(root, step)
        ckpt, why = None, ""
        try:
            ckpt = checkpoint.load(url, accelerator.process_index)
            if ckpt["shards"] is None:
                why = "it was written by an unsharded strategy"
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
        if not _all_ranks(accelerator, not why):
            log.warning("checkpoint %s is unreadable here or on another rank (%s); falling back to an earlier one",
                        url, why or "another rank")
            continue
        try:
            parallelize.load_sharded(ckpt["shards"], step_model, optimizer)
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
        if _all_ranks(accelerator, not why):
            ckpt["url"] = url
            return ckpt
        log.warning("sharded checkpoint %s cannot be loaded (%s); falling back to an earlier one", url, why)
    return None


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


def _save_checkpoint(accelerator, model, step_model, optimizer, scheduler, root: str, step: int, meta: dict,
                     keep: int, sharded: bool) -> None:
    """Rank 0 clears the step's folder, every rank writes its RNG state (and, sharded, its shards of
    the weights and optimiser state), then rank 0 writes the rest and marks the checkpoint complete
    (see sfm.checkpoint)."""
    if accelerator.is_main_process:
        checkpoint.begin(root, step)
    accelerator.wait_for_everyone()
    checkpoint.save_rank_rng(root, step, accelerator.process_index)
    if sharded:
        parallelize.save_sharded(checkpoint.shards_url(root, step), step_model, optimizer)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if sharded:
            checkpoint.save(root, step, None, None, scheduler.state_dict(), meta, keep=keep)
        else:
            checkpoint.save(root, step, model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), meta,
                            keep=keep)
    accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
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
