"""DeepSpeed ZeRO-2 and ZeRO-3 (``[dist] strategy = "deepspeed-zero2" | "deepspeed-zero3"``): plain DeepSpeed around
the project's own model, optimiser and schedule, the same code on gloo (CPU) and NCCL (GPU).

DeepSpeed is an optional extra (``pip install 'sfm[deepspeed]'``), imported only here and only when a run uses it.

What DeepSpeed's engine does: partitions the gradients, the float32 master weights and the AdamW state over the
ranks (ZeRO-3 the parameters too, gathered block by block as forward and backward reach them), clips the global
gradient norm inside ``engine.step()``, skips an update whose gradients are not finite, and with
``mixed_precision = bf16`` keeps bf16 parameters and gradients beside the float32 masters (its ``bf16`` section).

What stays ours: the optimiser (``sfm.train.step.build_optimizer``'s fused AdamW with its weight-decay groups,
handed to DeepSpeed as its client optimiser), the warmup/cosine schedule (stepped by the trainer after every step,
applied or skipped; DeepSpeed's would advance on applied steps only), the micro-batches of a step
(``managed_gradient_accumulation`` off: each ``engine.step()`` is the step's boundary), the masks, the data, and the
checkpoint's completion marker. No ``optimizer`` or ``scheduler`` section is ever given to DeepSpeed.

The project's Muon is refused with these strategies (``sfm.config``): under ZeRO the optimiser sees flat 1-D
partitions, not whole weight matrices, and DeepSpeed's own Muon chooses its matrices and its step size by its
own rules.

Checkpoints (:class:`DeepSpeedShards`): every rank writes its part with ``engine.save_checkpoint`` into a local
staging folder and uploads it under the run root (local or ``s3://``, one code path); loading downloads only the
files this rank reads. ZeRO cannot reshard its optimiser state, so a checkpoint loads only on the world size that
wrote it (the checkpointer refuses another one in one line).
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Any

import torch

from sfm import storage

STAGES = {"deepspeed-zero2": 2, "deepspeed-zero3": 3}
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default bucket sizes, in elements
DEEPSPEED_PERSISTENCE = 100_000  # its default stage3_param_persistence_threshold, in elements
TAG = "zero"  # the one tag of DeepSpeed's folder layout under a checkpoint's shards/ (one checkpoint per folder)
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-2: rank 0's module weights, read by every rank


def engine_config(cfg, world: int, *, params: int, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's config for job ``cfg`` (a :class:`sfm.config.JobConfig` whose strategy is one of ``STAGES``) on
    ``world`` data-parallel ranks, for a model of ``params`` elements.

    The buckets hold an eighth of the model (at least 8 collectives to overlap with backward), never DeepSpeed's
    default 5e8 elements on a smaller model: ZeRO-3 allocates its reduce bucket up front (2 GB in float32). Under
    ZeRO-3 a parameter stays whole on every rank when it holds under 0.1 % of the model (at most DeepSpeed's
    1e5 elements): norms and biases, not worth a gather each."""
    stage = STAGES[cfg.dist.strategy]
    micro, accum = cfg.data.batch_size, max(1, cfg.train.grad_accum)
    bucket = min(DEEPSPEED_BUCKET, max(1, params // 8))
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket,
                    stage3_param_persistence_threshold=min(DEEPSPEED_PERSISTENCE, params // 1000))
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
        "managed_gradient_accumulation": False,  # our TrainStep owns the micro-batches; step() is the boundary
        "gradient_clipping": cfg.train.grad_clip,  # 0: none (the norm is still computed)
        "zero_optimization": zero, "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 2**62,  # the trainer logs; DeepSpeed's own progress lines would repeat it
    }


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]):
    """The DeepSpeed engine training ``model`` (on its device, same initial weights on every rank) with
    ``optimizer`` (built on ``model``; its schedule keeps working on it) over the default process group, which
    must be up. Returns the engine: call it as the model (``engine(imgs, noise=...)``)."""
    import deepspeed

    # DeepSpeed 0.19 gathers and scatters with calls torch 2.13 deprecates: a warning per call, not the job's to fix
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    # On its CPU accelerator DeepSpeed builds a shared-memory all-reduce extension with g++ on first use; only
    # its inference path uses it, so the build is skipped and a CPU run needs no compiler (a no-op on CUDA).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def backward(engine, loss: torch.Tensor) -> None:
    """Backward of one micro-batch's loss, already divided by the micro-batches of the step (TrainStep does)."""
    engine.backward(loss, scale_wrt_gas=False)


def step(engine) -> tuple[torch.Tensor, bool]:
    """The optimiser step (a collective): DeepSpeed clips and steps, or skips an update whose gradients are not
    finite. Returns the global gradient norm before clipping (inf/NaN when not finite) and whether the update
    was applied; the same on every rank."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return torch.tensor(float("nan") if norm is None else float(norm)), bool(engine.was_step_applied())


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full float32 weights (the masters, also under bf16) as plain CPU tensors named as in the plain model,
    on rank 0 (the others get {}). A collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = {name: safe_get_full_fp32_param(p).detach().cpu().clone() for name, p in engine.module.named_parameters()}
    return full if torch.distributed.get_rank() == 0 else {}


def own_files(names: list[str], rank: int) -> list[str]:
    """The files of a DeepSpeed checkpoint folder that rank ``rank`` reads: its own partitions (``zero_pp_rank_R_*``,
    ``bf16_`` prefixed in bf16 runs) and, under ZeRO-2, rank 0's module weights."""
    mine = re.compile(rf"^(bf16_)?zero_pp_rank_{rank}_")
    return [n for n in names if n == MODEL_STATES or mine.match(n)]


class DeepSpeedShards:
    """A DeepSpeed engine's weights and optimiser state as a checkpoint part (``sfm.train.checkpoint.Shards``):
    each rank saves and loads its own partitions; another world size cannot load them (``reshards`` False)."""

    kind = "deepspeed"
    reshards = False

    def __init__(self, engine):
        self.engine = engine
        self.rank = torch.distributed.get_rank()

    def save(self, url: str) -> None:
        """Every rank writes its part into a local folder of its own and uploads it to ``url`` (a collective)."""
        with tempfile.TemporaryDirectory(prefix=f"sfm-deepspeed-save-r{self.rank}-") as stage:
            self.engine.save_checkpoint(stage, tag=TAG, client_state={}, save_latest=False)
            storage.upload(os.path.join(stage, TAG), url)

    def load(self, url: str) -> None:
        """Restore this rank's part of the checkpoint at ``url`` into the live engine (a collective); raises when
        this rank's files are missing or unreadable."""
        names = own_files(storage.list_dir(url), self.rank)
        if not any("optim_states" in n for n in names) or not any("model_states" in n for n in names):
            raise FileNotFoundError(f"{url} lacks rank {self.rank}'s DeepSpeed files (it holds {sorted(names)})")
        with tempfile.TemporaryDirectory(prefix=f"sfm-deepspeed-load-r{self.rank}-") as local:
            os.makedirs(os.path.join(local, TAG))
            for name in names:
                storage.download(storage.join(url, name), os.path.join(local, TAG, name))
            path, _ = self.engine.load_checkpoint(local, tag=TAG, load_module_strict=True, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)  # the schedule is ours
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load rank {self.rank}'s part of {url}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.engine)
