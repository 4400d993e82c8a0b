"""Batches for training: :class:`CropDataset` (one rank's stream) and :class:`BatchStream` (the loader).

The data path is three parts, each built from the checked ``JobConfig.data``, composed here the way
MONAI composes a dataset of volumes, a patch function and a transform:
:class:`sfm.data.survey.Surveys` (the surveys a process reads), :class:`sfm.data.crops.CropPlan` (sample
index to crop) and :class:`sfm.data.crop_reader.CropReader` (crop to values).

- :class:`CropDataset` (a torch ``IterableDataset``) is one rank's stream of batches
  ``[B, 1, D, H, W]``. Batch ``b`` of rank ``r`` holds samples ``(b * world_size + r) * B + [0, B)``;
  DataLoader worker ``w`` of ``n`` makes batches ``start + w, start + w + n, ...``, which the
  DataLoader hands out in order. So ranks and workers never share a sample, the sequence a rank sees
  does not depend on the number of workers, and a position is just ``(epoch, batch)``.
- :class:`BatchStream` is the loader a training loop consumes: a DataLoader over the dataset (worker
  processes, pinned memory when CUDA is present) with ``state_dict()`` / ``load_state_dict()`` for
  exact resume. :func:`training_stream` builds one from ``JobConfig.data``; :func:`crop_dataset` the
  dataset alone (also read by sample index: :meth:`CropDataset.read`).
"""


from __future__ import annotations

import collections
import itertools
import logging
import sys
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from sfm.errors import SFMError

from sfm.data.crop_reader import CropReader, region_pool_for, wait_all
from sfm.data.crops import Crop, CropPlan
from sfm.data.int8_batch import Int8Batch
from sfm.data.survey import Surveys

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# batches for one rank, split across DataLoader workers


class CropDataset(IterableDataset):
    """One rank's stream of batches, tensors [B, 1, D, H, W] of the reader's dtype (use ``DataLoader(batch_size=None)``);
    [B, 1, stop - start, H, W] when the reader reads a slab. ``rank`` is the data-parallel one (the plan's
    ``world_size`` ranks): the context-parallel ranks of a group share it and differ in the slab.

    Batch ``b`` holds samples ``(b * world_size + rank) * batch_size + [0, batch_size)`` of the plan's
    ``(seed, epoch)`` stream. Iteration starts at ``start_batch`` and, if ``num_batches`` is set, ends
    before batch ``num_batches`` (one epoch); otherwise it never ends. Under a DataLoader with ``n``
    workers, worker ``w`` makes batches ``start_batch + w + k * n``; the DataLoader returns them in order,
    so the sequence is the same for any ``n``.

    Each worker keeps ``prefetch`` batches reading ahead of the one it hands over.
    """

    def __init__(self, plan: CropPlan, reader: CropReader, rank: int = 0, *, start_batch: int = 0,
                 num_batches: int | None = None, prefetch: int = 2):
        super().__init__()
        if not 0 <= rank < plan.world_size:
            raise SFMError(f"rank {rank} is outside a world of {plan.world_size} processes")
        self.plan, self.reader = plan, reader
        self.batch_size, self.rank, self.world_size = plan.batch_size, int(rank), plan.world_size
        self.start_batch = int(start_batch)
        self.num_batches = None if num_batches is None else int(num_batches)
        self.prefetch = max(0, int(prefetch))
        self.epoch = 0

    @property
    def surveys(self) -> Surveys:
        return self.reader.surveys

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def sample_indices(self, batch: int) -> range:
        first = (batch * self.world_size + self.rank) * self.batch_size
        return range(first, first + self.batch_size)

    def locate(self, index: int) -> Crop:
        """The :class:`sfm.data.crops.Crop` of sample ``index`` of this epoch."""
        return self.plan.locate(self.epoch, index)

    def read(self, indices: list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``indices`` of this epoch, [len(indices), 1, *shape] of the reader's dtype, read concurrently."""
        return self.reader.read([self.locate(i) for i in indices], out)

    def close(self) -> None:
        self.reader.close()

    def worker_batches(self, worker: int = 0, workers: int = 1) -> Iterable[int]:
        """The batch numbers DataLoader worker ``worker`` of ``workers`` makes, in order."""
        first = self.start_batch + worker
        if self.num_batches is None:
            return itertools.count(first, workers)
        return range(first, self.num_batches, workers)

    def _start(self, batch: int, buffers: "_BatchBuffers | None") -> tuple[torch.Tensor | Int8Batch, list[Future]]:
        shape = (self.batch_size, 1, *self.reader.shape)
        if buffers is None:  # a worker's batch goes to the main process by handle, not by copy
            out = _shared_empty(shape, self.reader.dtype)
        else:
            out = torch.from_numpy(buffers.take())
        arr = out.numpy()
        crops = [self.locate(i) for i in self.sample_indices(batch)]
        futures = [f for n, c in enumerate(crops) for f in self.reader.submit(c, arr[n])]
        if self.reader.dtype == np.int8:
            affine = [self.surveys[c.survey].affine(negate=c.invert) for c in crops]
            out = Int8Batch(out, torch.tensor(affine, dtype=torch.float32))
        return out, futures

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pending: collections.deque = collections.deque()
        buffers = None if info is not None else _BatchBuffers((self.batch_size, 1, *self.reader.shape),
                                                              keep=self.prefetch + 4, dtype=self.reader.dtype)
        try:
            for batch in self.worker_batches(worker, workers):
                pending.append(self._start(batch, buffers))
                if len(pending) > self.prefetch:
                    out, futures = pending.popleft()
                    wait_all(futures)
                    yield out
            while pending:
                out, futures = pending.popleft()
                wait_all(futures)
                yield out
        finally:
            for _, futures in pending:
                for f in futures:
                    f.cancel()


def _shared_empty(shape: tuple[int, ...], dtype=np.float32) -> torch.Tensor:
    """An uninitialised tensor (``dtype``: float32, float16 or int8) in shared memory. ``torch.empty().share_memory_()``
    would allocate private memory and copy it over: 2.3 against 1.5 s of CPU per GB in page faults."""
    dtype = np.dtype(dtype)
    torch_dtype = {np.dtype(np.float16): torch.float16, np.dtype(np.int8): torch.int8}.get(dtype, torch.float32)
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        return torch.empty(shape, dtype=torch_dtype).share_memory_()
    storage = new_shared(dtype.itemsize * int(np.prod(shape)))
    return torch.empty(0, dtype=torch_dtype).set_(storage).view(shape)


class _BatchBuffers:
    """Batch arrays for one in-process stream, each reused once no tensor is left that uses it.

    A fresh 64 MB batch costs the kernel a page fault and a zeroed page per 4 KiB on first touch:
    0.75 s of CPU per GB delivered, a fifth of the loader's CPU (benchmarks/stream.py). A batch is
    handed out as ``torch.from_numpy(array)``: every tensor and view of it keeps the array alive
    through their shared storage, so the array's reference count says when it is free again. At
    most ``keep`` arrays are kept; past that (a consumer holding many batches) arrays are fresh.
    """

    def __init__(self, shape: tuple[int, ...], keep: int, dtype=np.float32):
        self.shape, self.keep, self.dtype = shape, keep, np.dtype(dtype)
        self.arrays: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        for n in range(len(self.arrays)):
            if sys.getrefcount(self.arrays[n]) == 2:  # the list's reference and the call's: free
                return self.arrays[n]
        array = np.empty(self.shape, dtype=self.dtype)
        if len(self.arrays) < self.keep:
            self.arrays.append(array)
        return array


# --------------------------------------------------------------------------------------------
# the loader a training loop consumes


class BatchStream:
    """``next(stream)`` -> tensor [B, 1, D, H, W] ([B, 1, stop - start, H, W] for a slab) of
    ``data.batch_dtype``, pinned when CUDA is present; for int8 an :class:`sfm.data.int8_batch.Int8Batch`,
    whose ``.to(device).float()`` is the normalised float32 tensor.

    A DataLoader over a :class:`CropDataset` with ``workers`` processes (0: read in this process on
    the reader's threads). Workers are started with ``forkserver``: S3 clients (obstore's runtime,
    aiohttp sessions) do not survive a fork of a process that has used them. A forkserver child has the
    environment the server started with; ``worker_init`` (a DataLoader ``worker_init_fn``, e.g.
    :func:`sfm.distributed.launch.environment_for_workers`) can give it the caller's.

    ``state_dict()`` is ``{"epoch", "batch", ...}``, the next batch this stream will return;
    ``load_state_dict`` continues from there, with exactly the batches an uninterrupted stream
    would have returned, whatever the number of workers.
    """

    def __init__(self, dataset: CropDataset, workers: int = 0, pin_memory: bool | None = None,
                 worker_init: Callable[[int], None] | None = None):
        self.dataset = dataset
        self.workers = max(0, int(workers))
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.worker_init = worker_init
        self.batch = dataset.start_batch
        self._iter = None

    def _loader(self):
        kwargs: dict[str, Any] = {}
        if self.workers:
            import multiprocessing

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["sfm.data.loader"])
            kwargs = {"multiprocessing_context": ctx, "prefetch_factor": 2, "worker_init_fn": self.worker_init}
        return torch.utils.data.DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                                           pin_memory=self.pin_memory, **kwargs)

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> torch.Tensor | Int8Batch:
        if self._iter is None:
            self.dataset.start_batch = self.batch
            self._iter = iter(self._loader())
        try:
            out = next(self._iter)
        except StopIteration:
            self._iter = None
            raise
        except SFMError as err:  # from a worker: the message carries the worker's traceback; keep the error
            raise SFMError(str(err).rsplit("SFMError: ", 1)[-1]) from None
        self.batch += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.dataset.epoch, "batch": self.batch, "seed": self.dataset.plan.seed,
                "rank": self.dataset.rank, "world_size": self.dataset.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["batch"]`` of ``state["epoch"]`` (restarts the workers if running)."""
        seed = self.dataset.plan.seed
        if "seed" in state and int(state["seed"]) != seed:
            raise SFMError(f"the saved data position is for seed {state['seed']}, this stream has seed "
                           f"{seed}; resume with the same data.seed")
        self._shutdown()
        self.dataset.set_epoch(int(state.get("epoch", 0)))
        self.batch = int(state["batch"])

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first batch."""
        self.load_state_dict({"epoch": epoch, "batch": 0})

    def _shutdown(self) -> None:
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def close(self) -> None:
        self._shutdown()
        self.dataset.close()


def crop_dataset(store_urls: list[str], data, rank: int = 0, world_size: int = 1, slab: tuple[int, int] | None = None,
                 node_ranks: int = 1, brick_reader: bool = True) -> CropDataset:
    """The :class:`CropDataset` of data-parallel rank ``rank`` of ``world_size`` over ``store_urls``, built
    from ``data`` (``JobConfig.data``, checked: :meth:`sfm.config.DataConfig.check`): its surveys, crop plan
    and reader, reading ``slab`` of each crop (:class:`sfm.data.crop_reader.CropReader`). ``node_ranks``:
    the training processes on this node, which share the pool of decoded regions (it is sized for them).
    ``brick_reader``: see :class:`sfm.data.survey.Surveys`."""
    surveys = Surveys(store_urls, data, brick_reader)
    plan = CropPlan(surveys, data, world_size)
    regions = region_pool_for(plan.regions, data, node_ranks) if plan.regions is not None else None
    return CropDataset(plan, CropReader(surveys, data, slab, regions), rank, prefetch=data.prefetch)


def training_stream(store_urls: list[str], data, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                    slab: tuple[int, int] | None = None, node_ranks: int = 1,
                    worker_init: Callable[[int], None] | None = None) -> BatchStream:
    """The :class:`BatchStream` data-parallel rank ``rank`` of ``world_size`` trains on from batch
    ``start_batch``, configured by ``data`` (``JobConfig.data``, checked), with ``data.workers`` worker
    processes (``worker_init``: see :class:`BatchStream`). Under context parallelism every cp rank of a dp
    group passes the group's dp rank and its own ``slab`` (``(s.start, s.stop)`` of
    :func:`sfm.distributed.context_parallel.crop_slab`): the group trains on the same crops, each rank
    reading only its rows of them. ``node_ranks``: the training processes on this node (:func:`crop_dataset`)."""
    dataset = crop_dataset(store_urls, data, rank, world_size, slab, node_ranks)
    dataset.start_batch = int(start_batch)
    return BatchStream(dataset, workers=data.workers, worker_init=worker_init)
