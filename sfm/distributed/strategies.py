"""Data parallelism applied to a plain model from outside (torchtitan's ``parallelize.py`` split):
``sfm/model/`` holds no process groups; :mod:`sfm.distributed.parallelize` decides which strategy runs and
calls :func:`apply_strategy`.

Strategies (``[dist] strategy`` in the job config):

- ``ddp``: every rank holds the full model and optimiser state; gradients are all-reduced in
  buckets during backward (``DistributedDataParallel``).
- ``fsdp2-zero2``: FSDP2 (``fully_shard``) with ``reshard_after_forward=False``: parameters and
  optimiser state are sharded, each transformer block's parameters are all-gathered once in forward
  and kept for backward, gradients are reduce-scattered. The ZeRO-2 equivalent in communication.
- ``fsdp2-full``: FSDP2 with ``reshard_after_forward=True``: blocks free their gathered parameters
  after forward and all-gather them again in backward (ZeRO-3): least memory, 1.5x the traffic.

``deepspeed-zero2`` and ``deepspeed-zero3`` (DeepSpeed's ZeRO around the same model, optimiser and schedule)
are built by :mod:`sfm.distributed.deepspeed_zero`, not here: DeepSpeed takes the optimiser as it wraps the model.

On gloo (CPU) FSDP2 has no streams to overlap communication with compute: every all-gather and
reduce-scatter blocks the one compute thread. :class:`OverlappedAllGather` and
:class:`OverlappedReduceScatter` restore the overlap CUDA streams give on NCCL: each unit's forward
all-gather is issued while the previous unit computes (explicit forward prefetch), and gradient
reduce-scatters run in gloo's background thread while backward continues, waited for at the end of
backward (as DDP waits for its buckets). NCCL keeps FSDP2's own stream-based collectives.

The sharding unit is one transformer block (encoder and decoder); the root module holds the rest
(patch embedding, tokens, norms, decoder embedding and head). Call :func:`apply_strategy` after
moving the model to its device and before building the optimiser (FSDP2 replaces parameters with
sharded DTensors). Checkpoints: :func:`save_sharded`/:func:`load_sharded` write and read
``torch.distributed.checkpoint`` (each rank its own shards; ``.metadata`` is written last, so its
presence marks a complete checkpoint), through :class:`FSDP2Shards` for the checkpointer;
:func:`full_state_dict` gathers plain tensors for export.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from sfm import storage
from sfm.config import STRATEGIES

log = logging.getLogger(__name__)

RESHARD_AFTER_FORWARD = {"fsdp2-zero2": False, "fsdp2-full": True}
APPLIED = ("ddp", *RESHARD_AFTER_FORWARD)  # the strategies apply_strategy wraps a model for (DeepSpeed's: its engine)
REPLICATED = ("ddp", "deepspeed-zero2")  # every rank holds the full weights (their digests can be compared)


def data_parallel_mesh(device: torch.device | str) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group (which must be initialised)."""
    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the MAE's encoder and decoder blocks."""
    return [*getattr(model, "blocks", []), *getattr(model, "decoder_blocks", [])]


def apply_strategy(model: nn.Module, strategy: str, mesh: DeviceMesh | None = None, *,
                   param_dtype: torch.dtype | None = None, units: Iterable[nn.Module] | None = None) -> nn.Module:
    """Wrap ``model`` (already on its device, same initial weights on every rank) for data parallel
    training over ``mesh`` (default: all ranks). Returns the module to train: a DDP wrapper, or the
    model itself turned into an FSDP2 module.

    ``param_dtype`` (FSDP2 only, e.g. torch.bfloat16): compute in that dtype with float32 master
    weights and float32 gradient reduction; DDP uses autocast instead.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if strategy not in APPLIED:
        raise ValueError(f"strategy {strategy!r} is not applied here; valid: {', '.join(APPLIED)} "
                         "(DeepSpeed's: sfm.distributed.deepspeed_zero.initialize)")
    device = next(model.parameters()).device
    mesh = mesh or data_parallel_mesh(device)
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       process_group=mesh.get_group())
    reshard = RESHARD_AFTER_FORWARD[strategy]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    units = list(sharding_units(model) if units is None else units)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    if dist.get_backend(mesh.get_group()) == "gloo":
        _try_gloo_overlap(model, units)
    return model


def _try_gloo_overlap(model: nn.Module, units: list[nn.Module]) -> None:
    """Overlap FSDP2's gloo collectives with compute (:mod:`sfm.distributed.gloo_overlap`, built on
    FSDP2's private collectives API). Where this torch lacks that API or changed it, plain FSDP2 runs
    instead, with one log line: only CPU gloo runs lose a speed-up."""
    try:
        from sfm.distributed.gloo_overlap import overlap_gloo_communication

        overlap_gloo_communication(model, units)
    except (ImportError, AttributeError, TypeError) as err:
        log.warning("FSDP2 collectives are not overlapped on gloo (torch %s has no usable private FSDP2 "
                    "collectives API: %s: %s); training continues with plain FSDP2",
                    torch.__version__, type(err).__name__, err)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient communication for the micro-batches of a gradient-accumulation step (not the
    last one): gradients accumulate locally and are reduced once, in the last backward."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards) to ``max_norm``; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor reduced over the mesh
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights as plain CPU tensors, names as in the plain model.

    A collective: every rank must call it. ``rank0_only``: only rank 0 gets the tensors (the others
    an empty dict), e.g. for :func:`sfm.model.save`; otherwise every rank gets them all.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach().cpu() for k, v in state.items()}


def _writer_reader(url: str, write: bool):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if storage.is_s3(url):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        options = storage.s3fs_options()
        return FsspecWriter(url, **options) if write else FsspecReader(url, **options)
    return FileSystemWriter(url) if write else FileSystemReader(url)


def save_sharded(url: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Save model and optimiser state as a ``torch.distributed.checkpoint`` under ``url`` (local or
    s3://): each rank writes only its own shards (DDP: rank 0 writes the replicated tensors). A
    collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, storage_writer=_writer_reader(url, write=True))


def load_sharded(url: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`save_sharded` wrote into a model wrapped the same way. A collective.
    (torch.distributed.checkpoint reshards on load, so another world size can read it.)"""
    import torch.distributed.checkpoint as dcp

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, storage_reader=_writer_reader(url, write=False))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


class FSDP2Shards:
    """An FSDP2 model's and optimiser's shards as a checkpoint part (``sfm.train.checkpoint.Shards``): a
    ``torch.distributed.checkpoint`` each rank writes its shards of, resharded on load (``reshards``)."""

    kind = "fsdp2"
    reshards = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def save(self, url: str) -> None:
        save_sharded(url, self.model, self.optimizer)

    def load(self, url: str) -> None:
        load_sharded(url, self.model, self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)
